"""Where a new Python process's time goes before and during its first generate, as a Ray replica or
`run_batch` spends it: the imports, `LLM(...)`, a first generate of 512 rows and a second of 512 others (the
difference is what the first pays once), with a cProfile of the first generate.

    python -m benchmarks.fresh_process --random-checkpoint /tmp/q06 [--rows 512]
"""
import time

START = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine import llm_engine  # noqa: E402, F401  (the engine's imports, as LLM(...) makes them)

IMPORTED = time.time()


def rows(seed: int, n: int) -> tuple[list, list]:
    """dataset_paths' rows: 100-1,024 prompt tokens, 100-512 output tokens, temperature 0.6."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 512)) for _ in range(n)]
    return prompts, params


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--rows", type=int, default=512)
    args = parser.parse_args()
    from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint
    start = time.time()
    llm = LLM(random_qwen3_0_6b_checkpoint(args.random_checkpoint))
    llm_init = time.time() - start
    profiler = cProfile.Profile()
    seconds = []
    for seed in (1, 2):
        batch = rows(seed, args.rows)
        start = time.time()
        with profiler if seed == 1 else contextlib.nullcontext():
            llm.generate(*batch, use_tqdm=False)
        seconds.append(time.time() - start)
    print(json.dumps(dict(imports=round(IMPORTED - START, 2), llm_init=round(llm_init, 2),
                          first_generate=round(seconds[0], 2), second_generate=round(seconds[1], 2))), flush=True)
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(35)
    llm.exit()


if __name__ == "__main__":
    main()
