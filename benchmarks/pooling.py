"""The pooling engine on its workload: `--num-prompts` prompts of 16-512 random token ids (seeded) embedded by a
random checkpoint (Qwen3-0.6B's dimensions unless --random-dims), after one warm-up request: prompt tokens per
second, the engine's start-up and the peak GPU memory it reserved (the KV cache included, at the defaults).

    python -m benchmarks.pooling --random-checkpoint /tmp/q06 [--load-format dummy] [--num-prompts 4096] [--profile]

--profile runs the workload once more under torch's profiler and prints the device's busy time against the wall
time, its idle gaps and the kernels that take the most device time.
"""
import argparse
import json
import random
from collections import defaultdict
from time import perf_counter

import torch

from benchmarks.profile_engine import gap_classes, union_length
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
    parser.add_argument("--profile", action="store_true")
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
        if args.profile:
            profile(llm, prompts)
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    print(f"Start-up: {startup:.1f}s; {len(outputs)} prompts, {tokens} tokens in {seconds:.2f}s: "
          f"{tokens / seconds:,.0f} prompt tok/s")
    if torch.cuda.is_available():
        print(f"Peak GPU memory: {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved")


def profile(llm: LLM, prompts: list[dict]):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        start = perf_counter()
        llm.embed(prompts, use_tqdm=False)
        wall_s = perf_counter() - start
    per_name, intervals = defaultdict(float), []
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name] += event.device_time_total
            intervals.append((event.time_range.start, event.time_range.end))
    busy_us, gaps = union_length(intervals)
    print(f"Profiled: {wall_s:.2f}s wall, device busy {busy_us / 1e6:.2f}s; idle gaps {gap_classes(gaps)}")
    for name, us in sorted(per_name.items(), key=lambda kv: -kv[1])[:15]:
        print(f"{us / 1e3:9.1f} ms  {name[:120]}")


if __name__ == "__main__":
    main()
