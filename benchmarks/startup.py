"""Where this engine's start-up goes: `LLM(...)` to ready, phase by phase, on one GPU.

    python -m benchmarks.startup --random-checkpoint /tmp/q06 [--cold]

`--cold` points torch.compile's and Triton's caches at new empty folders before torch is imported, so
every kernel compiles as on a fresh machine. Phases are timed on the host: loading the weights,
the warm-up steps (where torch.compile and the Triton kernels compile), allocating the KV cache and
capturing the decode graphs; `other` is the rest (the tokenizer, the config, building the model).
"""
import argparse
import cProfile
import json
import os
import pstats
import tempfile
from contextlib import nullcontext
from time import perf_counter


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--cold", action="store_true", help="start with empty compile caches")
    parser.add_argument("--profile", metavar="FILE", help="write a cProfile of LLM(...) to FILE (the 60 costliest "
                                                          "functions, cumulative)")
    args = parser.parse_args()
    if args.cold:
        cache = tempfile.mkdtemp(prefix="nanovllm-cold-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    start = perf_counter()
    from benchmarks.profile_engine import PhaseTimer
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine import model_runner
    from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint
    import_s = perf_counter() - start
    random_qwen3_0_6b_checkpoint(args.random_checkpoint)

    timer = PhaseTimer()
    for name, attr in [("load_weights", "load_model"), ("allocate_kv_cache", "allocate_kv_cache"),
                       ("capture_graphs", "DecodeGraphs")]:
        setattr(model_runner, attr, timer.wrap(name, getattr(model_runner, attr)))
    runner = model_runner.ModelRunner
    runner.warmup_model = timer.wrap("warmup_steps", runner.warmup_model)

    profiler = cProfile.Profile() if args.profile else None
    start = perf_counter()
    with profiler or nullcontext():
        llm = LLM(args.random_checkpoint)
    startup_s = perf_counter() - start
    if profiler:
        with open(args.profile, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)
    start = perf_counter()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
    first_generate_s = perf_counter() - start
    llm.exit()
    phases = {name: round(s, 2) for name, s in timer.seconds.items()}
    phases["other"] = round(startup_s - sum(timer.seconds.values()), 2)
    print(json.dumps(dict(cold=args.cold, import_s=round(import_s, 2), startup_s=round(startup_s, 2),
                          phases=phases, first_generate_s=round(first_generate_s, 2))))


if __name__ == "__main__":
    main()
