"""One benchmark run, in a new process: one engine, one or more workloads; prints one JSON line each.

    python benchmarks/run_one.py --label this --engine-dir DIR --model MODEL --requests FILE [FILE ...] \
        [--engine-args JSON] [--profile-out PATH ...]

With several request files (the harness's --group, or sampling variants) it starts the engine once, then warms up
and times each in turn. The harness runs it as a script with the engine's folder first on PYTHONPATH, so `import
nanovllm` picks that engine; it imports only the standard library and `host_threads.py` beside it, so nothing of
this repo shadows the engine.
It uses only the original nano-vllm's API: `LLM(path, **kwargs)`, `SamplingParams(temperature, max_tokens,
ignore_eos)`, `generate(token_id_lists, params_list, use_tqdm=False)` and `out["token_ids"]`; a sampling variant's
request file adds its `sampling_kwargs` to SamplingParams.
"""
import argparse
import atexit
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from importlib import metadata
from time import perf_counter

if __package__:  # imported as benchmarks.run_one (the tests)
    from benchmarks.host_threads import HostSampler
else:  # run as a script, beside it
    from host_threads import HostSampler

# package -> the modules whose import says the engine uses it (this engine calls flash-attn's kernel module directly)
VERSIONED = {"torch": ["torch"], "flash-attn": ["flash_attn", "flash_attn_2_cuda"], "triton": ["triton"],
             "transformers": ["transformers"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the engine's name in the results")
    parser.add_argument("--engine-dir", required=True, help="the engine's folder, for its git commit")
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", required=True, nargs="+", metavar="FILE",
                        help="JSON files the harness wrote from Workloads, run in this order on one engine")
    parser.add_argument("--engine-args", default="{}", help="JSON keyword arguments for LLM(...)")
    parser.add_argument("--profile-out", nargs="+", metavar="PATH",
                        help="run each timed generate under cProfile (one PATH per request file); write its stats "
                             "to PATH and the top 20 functions by tottime to PATH.txt")
    args = parser.parse_args(argv)
    if args.profile_out and len(args.profile_out) != len(args.requests):
        parser.error(f"{len(args.profile_out)} --profile-out paths for {len(args.requests)} request files")
    return args


class StepCounter:
    """Counts and times the calls of a step function."""

    def __init__(self, step):
        self.step = step
        self.num_steps = 0
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        start = perf_counter()
        try:
            return self.step(*args, **kwargs)
        finally:
            self.seconds += perf_counter() - start
            self.num_steps += 1


@contextmanager
def counting_steps(llm) -> Iterator[StepCounter | None]:
    """Shadow `llm.step` on the instance while the block runs (both engines' generate loops call `self.step()`);
    None where the engine has no step() or its instance takes no new attributes. The shadow is removed
    afterwards, so the next workload of a group counts its own steps through one wrapper."""
    counter = None
    with suppress(AttributeError):
        llm.step = counter = StepCounter(llm.step)
    try:
        yield counter
    finally:
        if counter is not None:
            del llm.step


def timed_generate(llm, prompts, params, profile_out: str | None) -> tuple[float, list]:
    profiler = cProfile.Profile() if profile_out else None
    start = perf_counter()
    with profiler or nullcontext():
        outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = perf_counter() - start
    if profiler:
        save_profile(profiler, profile_out)
    return seconds, outputs


def save_profile(profiler: cProfile.Profile, path: str):
    profiler.dump_stats(path)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    with open(path + ".txt", "w") as f:
        f.write(text.getvalue())
    print(text.getvalue(), flush=True)


def gpu_facts() -> dict:
    """Peak memory of this process (rank 0) so far and the machine's GPUs, when the engine used CUDA. In a
    group the peak is the process's, over start-up and every workload until this one. An engine whose
    ranks all run in worker processes allocates nothing here: no peak is reported."""
    torch = sys.modules.get("torch")  # an engine that never imported torch used no GPU
    if torch is None or not torch.cuda.is_available():
        return {}
    facts = {"total_gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
             "gpu": torch.cuda.get_device_name(0), "num_gpus": torch.cuda.device_count()}
    if torch.cuda.max_memory_reserved():
        facts.update(peak_reserved_bytes=torch.cuda.max_memory_reserved(),
                     peak_allocated_bytes=torch.cuda.max_memory_allocated())
    return facts


def versions() -> dict:
    """Versions of the packages that set the speed, among those the engine imported."""
    found = {}
    for dist, modules in VERSIONED.items():
        if any(module in sys.modules for module in modules):
            with suppress(metadata.PackageNotFoundError):
                found[dist] = metadata.version(dist)
    return found


def git(folder: str, *args: str) -> str | None:
    done = subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit(folder: str) -> str | None:
    """The folder's commit, with "-dirty" when tracked files changed; None unless the folder is the root of
    a git checkout (.device/reference/nano-vllm lies inside this repo's checkout but is not one)."""
    top = git(folder, "rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(folder):
        return None
    commit = git(folder, "rev-parse", "--short", "HEAD")
    dirty = git(folder, "status", "--porcelain", "--untracked-files=no")
    return commit and commit + ("-dirty" if dirty else "")


def checked_output_tokens(outputs, expected: int) -> int:
    num_tokens = sum(len(out["token_ids"]) for out in outputs)
    if num_tokens != expected:
        sys.exit(f"the engine returned {num_tokens} output tokens, not the {expected} asked for")
    return num_tokens


def start_engine(model: str, engine_args: dict) -> tuple[object, dict]:
    """The engine, and the seconds its import and its start-up (LLM(...) to ready) took."""
    start = perf_counter()
    from nanovllm import LLM
    imported = perf_counter()
    llm = LLM(model, **engine_args)
    return llm, {"import_seconds": imported - start, "startup_seconds": perf_counter() - imported}


def from_json(kwargs: dict) -> dict:
    """A variant's SamplingParams arguments as JSON held them: logit_bias's token ids were object keys, so
    strings; structured outputs, a dict of StructuredOutputsParams' fields."""
    if "logit_bias" in kwargs:
        return {**kwargs, "logit_bias": {int(token): bias for token, bias in kwargs["logit_bias"].items()}}
    if "structured_outputs" in kwargs:
        from nanovllm import StructuredOutputsParams
        return {**kwargs, "structured_outputs": StructuredOutputsParams(**kwargs["structured_outputs"])}
    return kwargs


def run_workload(llm, requests: dict, profile_out: str | None) -> dict:
    """Warm up with one short request, then time the workload's generate; a sampling variant's arguments
    go to SamplingParams only when the request file has them (plain's never does)."""
    from nanovllm import SamplingParams

    def params(max_tokens: int, sampling_kwargs: dict):
        return SamplingParams(temperature=requests["temperature"], max_tokens=max_tokens, ignore_eos=True,
                              **from_json(sampling_kwargs))

    sampling_kwargs = requests.get("sampling_kwargs") or [{}] * len(requests["prompts"])
    warmup = params(requests["warmup_max_tokens"], requests.get("warmup_sampling_kwargs", {}))
    llm.generate([requests["warmup_prompt"]], [warmup], use_tqdm=False)
    timed_params = [params(n, kwargs) for n, kwargs in zip(requests["max_tokens"], sampling_kwargs)]
    with counting_steps(llm) as steps, HostSampler() as host:
        seconds, outputs = timed_generate(llm, requests["prompts"], timed_params, profile_out)
    num_tokens = checked_output_tokens(outputs, sum(requests["max_tokens"]))
    return {"num_requests": len(requests["prompts"]), "output_tokens": num_tokens, "seconds": seconds,
            "output_tok_per_s": num_tokens / seconds, "ms_per_output_token": 1000 * seconds / num_tokens,
            "num_steps": steps.num_steps if steps else None, "step_seconds": steps.seconds if steps else None,
            "profiled": bool(profile_out), "host": host.summary()}


def shut_down(llm):
    if hasattr(llm, "exit"):
        llm.exit()
        atexit.unregister(llm.exit)  # the original also registers exit() with atexit, and fails when run twice


def read_requests(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def main(argv=None):
    args = parse_args(argv)
    workloads = [read_requests(path) for path in args.requests]  # all read before the slow start-up
    profile_outs = args.profile_out or [None] * len(workloads)
    engine_args = json.loads(args.engine_args)
    llm, timings = start_engine(args.model, engine_args)
    commit = git_commit(args.engine_dir)
    for requests, profile_out in zip(workloads, profile_outs):
        result = {"engine": args.label, "workload": requests["workload"],
                  "sampling": requests.get("sampling", "plain"), "engine_dir": args.engine_dir,
                  "commit": commit, "engine_args": engine_args, **timings,
                  **run_workload(llm, requests, profile_out), **gpu_facts(), "versions": versions()}
        print(json.dumps(result), flush=True)  # now, so a later workload's crash or hang does not lose it
    shut_down(llm)


if __name__ == "__main__":
    main()
