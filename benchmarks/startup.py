"""Where a new process's start goes, up to a ready engine, on one GPU: what a Ray replica or `run_batch` pays
before its first step.

    python -m benchmarks.startup --random-checkpoint /tmp/q06 [--cold] [--profile FILE]

Prints one JSON line: `process_s` (the interpreter's start, up to this script's first line), `import_s` (torch
and nanovllm), `cuda_init_s` (the CUDA context), `startup_s` (`LLM(...)`) and its phases, timed on the host:
the config, the tokenizer, building the model, loading the weights, the warm-up steps (where the Triton kernels
compile or load), allocating the KV cache, the cache-write warm-up and capturing the decode graphs (`other`: the
rest); then the first generate's seconds, the modules imported, how many had no cached bytecode (compiled from
source again) and which heavy ones are among them. `--cold` points Triton's cache at a new empty folder first,
so every kernel compiles as on a fresh machine. To time another tree's engine, run this from that tree's folder
with this one on PYTHONPATH (`-m` puts the working directory first).
"""
import os
import time

START = time.time()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from time import perf_counter  # noqa: E402

# Modules a lean start does not need: their presence says that something pulled them in.
HEAVY = ("transformers.models.auto.auto_factory", "transformers.generation.utils", "torch._dynamo",
         "torch._inductor", "torch.distributed.tensor", "sympy", "scipy", "pandas", "sklearn", "ray")


def process_age_s() -> float:
    """Seconds since this process was created (Linux: /proc, to the kernel's clock tick)."""
    with open("/proc/self/stat") as f:
        started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")


def num_compiled_from_source() -> int:
    """Modules imported from a .py file whose bytecode is not cached (compiled again by every new process)."""
    # read from each module's own namespace: a lazy module's __getattr__ would import what it stands for
    cached = (getattr(module, "__dict__", {}).get("__cached__") for module in list(sys.modules.values()))
    return sum(1 for path in cached if isinstance(path, str) and not os.path.exists(path))


def wrap_phases(timer):
    """Time the engine's start-up steps under `timer`, where LLM(...) calls them."""
    from nanovllm.engine import llm_engine, model_runner
    steps = [(llm_engine, "make_config", "config"), (llm_engine, "load_tokenizer", "tokenizer"),
             (model_runner, "build_model", "build_model"), (model_runner, "load_weights", "load_weights"),
             (model_runner, "allocate_kv_cache", "allocate_kv_cache"), (model_runner, "DecodeGraphs", "capture_graphs"),
             (model_runner.ModelRunner, "warmup_model", "warmup_steps"),
             (model_runner.ModelRunner, "warmup_cache_writes", "warmup_cache_writes")]
    for owner, name, phase in steps:
        setattr(owner, name, timer.wrap(phase, getattr(owner, name)))


def timed_startup(model: str, profile: str | None) -> tuple[object, float, dict]:
    """LLM(model), the seconds it took and their phases; with `profile`, its 60 costliest functions there."""
    from benchmarks.profile_engine import PhaseTimer
    from nanovllm import LLM
    timer = PhaseTimer()
    wrap_phases(timer)
    profiler = cProfile.Profile() if profile else None
    start = perf_counter()
    with profiler or nullcontext():
        llm = LLM(model)
    startup_s = perf_counter() - start
    if profiler:
        with open(profile, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)
    phases = {name: round(s, 2) for name, s in timer.seconds.items()}
    phases["other"] = round(startup_s - sum(timer.seconds.values()), 2)
    return llm, startup_s, phases


def main():
    process_s = process_age_s() - (time.time() - START)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--cold", action="store_true", help="start with an empty Triton cache")
    parser.add_argument("--profile", metavar="FILE", help="write a cProfile of LLM(...) to FILE")
    args = parser.parse_args()
    if args.cold:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="nanovllm-cold-triton-")
    start = perf_counter()
    import torch

    from nanovllm import SamplingParams
    from nanovllm.engine import llm_engine  # noqa: F401  (the engine's imports, as LLM(...) makes them)
    from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint
    import_s = perf_counter() - start
    model = random_qwen3_0_6b_checkpoint(args.random_checkpoint)
    start = perf_counter()
    torch.zeros(1, device="cuda")
    cuda_init_s = perf_counter() - start
    llm, startup_s, phases = timed_startup(model, args.profile)
    start = perf_counter()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
    first_generate_s = perf_counter() - start
    llm.exit()
    heavy_modules = [m for m in HEAVY if m in sys.modules]
    print(json.dumps(dict(cold=args.cold, process_s=round(process_s, 2), import_s=round(import_s, 2),
                          cuda_init_s=round(cuda_init_s, 2), startup_s=round(startup_s, 2), phases=phases,
                          first_generate_s=round(first_generate_s, 2), num_modules=len(sys.modules),
                          num_compiled_from_source=num_compiled_from_source(), heavy_modules=heavy_modules)))


if __name__ == "__main__":
    main()
