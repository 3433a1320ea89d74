"""Throughput benchmark on nano-vllm's workload: 256 requests with prompts of 100-1024 random token ids
and 100-1024 output tokens each (ignore_eos, temperature 0.6), after one warm-up request.

Also reports the engine's start-up time (LLM(...) to ready), peak GPU memory and the decode speed of
a single sequence (a 128-token prompt, 512 output tokens). Without a Qwen3-0.6B download, run it on
a random-weight checkpoint of the same dimensions: `python bench.py --random-checkpoint /tmp/qwen3-0.6b`.
"""
import argparse
import os
import sys
from random import randint, seed
from time import perf_counter

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import REAL_DIMENSIONS, random_checkpoint


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="~/huggingface/Qwen3-0.6B/", help="checkpoint folder")
    parser.add_argument("--random-checkpoint", metavar="DIR",
                        help="benchmark a random bf16 checkpoint of --random-dims' dimensions, written into DIR "
                             "unless DIR already holds one (instead of --model)")
    parser.add_argument("--random-dims", default="qwen3-0.6b", choices=sorted(REAL_DIMENSIONS),
                        help="the real model whose dimensions --random-checkpoint takes")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights from the config alone (with --random-checkpoint, no weights "
                             "file is written: how Qwen3-30B-A3B's 61 GB is benchmarked)")
    parser.add_argument("--quantization", choices=["fp8"],
                        help="fp8: the weights rounded to FP8 at load (vLLM's option); an FP8 checkpoint's own "
                             "format is read without it (e.g. --random-dims qwen3-30b-a3b-fp8)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: keys and values as e4m3 with a scale per token and KV head")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--skip-single", action="store_true", help="skip the single-sequence decode run")
    args = parser.parse_args()
    for name in ("max_input_len", "max_output_len"):
        if getattr(args, name) < MIN_LEN:
            parser.error(f"--{name.replace('_', '-')} must be at least {MIN_LEN} (lengths are drawn from "
                         f"[{MIN_LEN}, it]), got {getattr(args, name)}")
    return args


MIN_LEN = 100  # the shortest prompt and output bench.py draws


def model_path(args: argparse.Namespace) -> str:
    if args.random_checkpoint:
        return random_checkpoint(args.random_checkpoint, args.random_dims, weights=args.load_format != "dummy")
    path = os.path.expanduser(args.model)
    if not os.path.isdir(path):
        sys.exit(f"no checkpoint at {path}: pass --model PATH, or --random-checkpoint DIR to write a random one")
    return path


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py draws, in this order, every prompt and then every request's output length."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(MIN_LEN, args.max_input_len))] for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(MIN_LEN, args.max_output_len))
              for _ in range(args.num_seqs)]
    return prompts, params


def timed_generate(llm: LLM, prompts, params) -> float:
    start = perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return perf_counter() - start


def main():
    args = parse_args()
    path = model_path(args)
    start = perf_counter()
    llm = LLM(path, load_format=args.load_format, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size, gpu_memory_utilization=args.gpu_memory_utilization)
    startup = perf_counter() - start
    num_blocks = llm.executor.model_runner.num_kvcache_blocks
    print(f"Start-up: {startup:.1f}s (LLM(...) to ready), KV cache: {num_blocks} blocks")

    prompts, params = workload(args)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    seconds = timed_generate(llm, prompts, params)
    total = sum(sp.max_tokens for sp in params)
    print(f"Total: {total}tok, Time: {seconds:.2f}s, Throughput: {total / seconds:.2f}tok/s")

    if not args.skip_single:
        prompt = [randint(0, 10000) for _ in range(128)]
        seconds = timed_generate(llm, [prompt], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=512))
        print(f"Single sequence: 512tok, Time: {seconds:.2f}s, Throughput: {512 / seconds:.2f}tok/s")

    if torch.cuda.is_available():
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        print(f"Peak GPU memory (rank 0): {allocated / 2**30:.1f} GiB allocated, {reserved / 2**30:.1f} GiB reserved")
    llm.exit()


if __name__ == "__main__":
    main()
