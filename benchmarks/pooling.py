"""The pooling engine on its workload: `--num-prompts` prompts of 16-512 random token ids (seeded) embedded by a
random checkpoint (Qwen3-0.6B's dimensions unless --random-dims), after one warm-up request: prompt tokens per
second, the engine's start-up and the peak GPU memory it reserved (the KV cache included, at the defaults).

    python -m benchmarks.pooling --random-checkpoint /tmp/q06 [--load-format dummy] [--num-prompts 4096]
"""
import argparse
import json
import random
from time import perf_counter

import torch

from nanovllm import LLM
from nanovllm.utils.checkpoint import REAL_DIMENSIONS, random_checkpoint


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", metavar="DIR", required=True,
                        help="a random checkpoint of --random-dims' dimensions, written into DIR unless it holds one")
    parser.add_argument("--random-dims", default="qwen3-0.6b", choices=sorted(REAL_DIMENSIONS))
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--num-prompts", type=int, default=4096)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--extra-args", default="{}", help="JSON engine arguments, e.g. '{\"device\": \"cpu\"}'")
    args = parser.parse_args()
    path = random_checkpoint(args.random_checkpoint, args.random_dims, weights=args.load_format != "dummy")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10000) for _ in range(rng.randint(args.min_len, args.max_len))]}
               for _ in range(args.num_prompts)]
    start = perf_counter()
    with LLM(path, runner="pooling", load_format=args.load_format, **json.loads(args.extra_args)) as llm:
        startup = perf_counter() - start
        llm.embed(prompts[:1], use_tqdm=False)
        start = perf_counter()
        outputs = llm.embed(prompts, use_tqdm=False)
        seconds = perf_counter() - start
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    print(f"Start-up: {startup:.1f}s; {len(outputs)} prompts, {tokens} tokens in {seconds:.2f}s: "
          f"{tokens / seconds:,.0f} prompt tok/s")
    if torch.cuda.is_available():
        print(f"Peak GPU memory: {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved")


if __name__ == "__main__":
    main()
