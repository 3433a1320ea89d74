"""Where this engine's time goes, end to end, on one GPU with a random checkpoint of real dimensions.

    python -m benchmarks.profile_engine --random-checkpoint /tmp/q06 [--workloads single,many_short,bench]
        [--parts single_kernels,bench_kernels,many_short_kernels,sampling_kernels] [--sampling JSON] [--out DIR]
        [--random-dims qwen3-30b-a3b --load-format dummy] [--extra-args JSON]

For each of --workloads (the harness's, at full size), the host's time per phase of a step (perf_counter):
`schedule`, `build` (the step's host arrays), `launch` (upload and enqueue on the device), `wait` (blocked until
the device has the previous step's tokens: device-bound time), `update` (tokens into the scheduler) and
`outputs`; and `jit_loads`, the Triton kernels the run compiled or loaded (each a miss of Triton's in-memory
cache: on a fresh machine, a compile inside the timed run; None above one rank, whose processes are others, and
without Triton). For each of --parts (default: all), every kernel of one run of that workload by device time
(`<workload>_kernels.txt`), and the device's busy time against the run's wall time, with its idle gaps by length.
--sampling adds SamplingParams to every request, e.g. '{"logprobs": 5}'; --extra-args adds LLM arguments, e.g.
'{"quantization": "fp8"}'. Figures go to --out/profile_engine.json.
"""
import argparse
import json
import os
import traceback
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter, thread_time

import torch

from benchmarks.workloads import TEMPERATURE, make_workload
from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.utils.checkpoint import REAL_DIMENSIONS, random_checkpoint


class PhaseTimer:
    """Seconds and calls per phase, of the functions wrapped under the phase's name."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += perf_counter() - start
                self.calls[name] += 1
        return timed

    def report(self, total: float, num_tokens: int) -> dict:
        rows = {name: dict(seconds=round(s, 3), calls=self.calls[name], share=round(s / total, 3))
                for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        return dict(total_s=round(total, 3), tok_per_s=round(num_tokens / total), phases=rows)


def requests(name: str, vocab_size: int | None, sampling: dict | None):
    """The workload's prompts and SamplingParams, with `sampling`'s extra arguments, and its output tokens."""
    workload = make_workload(name, vocab_size=vocab_size)
    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=n, **(sampling or {}))
              for n in workload.max_tokens]
    return workload.prompts, params, workload.num_output_tokens


@contextmanager
def noting_jit_loads() -> Iterator[list[str] | None]:
    """The names of the Triton kernels this process loads or compiles within the block (each a miss of Triton's
    in-memory cache); None without a Triton that has `knobs` (3.4 and later), as on a CPU with no Triton."""
    try:
        from triton import knobs
    except ImportError:
        yield None
        return
    loads, previous_hook = [], knobs.runtime.jit_cache_hook

    def note(**kwargs) -> None:  # None: Triton goes on to load or compile the kernel
        loads.append(kwargs["repr"].split("[")[0])
    knobs.runtime.jit_cache_hook = note
    try:
        yield loads
    finally:
        knobs.runtime.jit_cache_hook = previous_hook


def timed_workload(llm: LLM, name: str, vocab_size: int | None = None, sampling: dict | None = None) -> dict:
    """The host's time per phase of the steps of one run of a workload, the main thread's CPU seconds, and the
    Triton kernels the run loaded or compiled (where this process runs the model)."""
    prompts, params, num_tokens = requests(name, vocab_size, sampling)
    timer = PhaseTimer()
    patches = [(llm.scheduler, "schedule", "schedule"), (llm.executor, "execute_model", "launch"),
               (llm.executor, "wait", "wait"), (llm.scheduler, "update_from_output", "update"),
               (llm.output_processor, "step_outputs", "outputs")]
    for owner, attr, phase in patches:
        setattr(owner, attr, timer.wrap(phase, getattr(owner, attr)))
    build = llm_engine.build_step_input
    llm_engine.build_step_input = timer.wrap("build", build)
    try:
        with noting_jit_loads() as jit_loads:
            start, cpu_start = perf_counter(), thread_time()
            llm.generate(prompts, params, use_tqdm=False)
            total, cpu_s = perf_counter() - start, thread_time() - cpu_start
    finally:
        llm_engine.build_step_input = build
        for owner, attr, _ in patches:
            delattr(owner, attr)
    one_rank = llm.config.tensor_parallel_size == 1  # the model runs in this process
    return timer.report(total, num_tokens) | dict(cpu_s=round(cpu_s, 3), jit_loads=jit_loads if one_rank else None)


@torch.inference_mode()
def workload_kernels(llm: LLM, name: str, out_dir: str, sampling: dict | None = None) -> dict:
    """Every kernel of one run of a workload: device time per kernel name, written as a table, and the device's
    busy time (the union of kernel intervals) against the run's wall time, so that its idle time counts too."""
    prompts, params, _ = requests(name, None, sampling)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        start = perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall_s = perf_counter() - start
    per_name = defaultdict(lambda: [0.0, 0])
    intervals = []
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name][0] += event.device_time_total
            per_name[event.name][1] += 1
            intervals.append((event.time_range.start, event.time_range.end))
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    with open(os.path.join(out_dir, f"{name}_kernels.txt"), "w") as f:
        for kernel, (us, count) in rows:
            f.write(f"{us / 1e3:10.1f} ms {count:8d} x {us / count:9.1f} us  {kernel[:160]}\n")
    busy_us, gaps = union_length(intervals)
    return dict(wall_s=round(wall_s, 3), device_busy_s=round(busy_us / 1e6, 3),
                kernel_s=round(sum(us for us, _ in per_name.values()) / 1e6, 3), idle_gaps=gap_classes(gaps),
                top_kernels_ms={kernel[:80]: round(us / 1e3, 1) for kernel, (us, _) in rows[:12]})


def union_length(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """The length of the union of the intervals, and the lengths of the gaps between its pieces."""
    total, reach, gaps = 0.0, None, []
    for start, end in sorted(intervals):
        if reach is None or end > reach:
            if reach is not None and start > reach:
                gaps.append(start - reach)
            total += end - (start if reach is None else max(start, reach))
            reach = end
    return total, gaps


GAP_CLASSES_US = {"under_10us": 10, "10_to_100us": 100, "100us_to_1ms": 1000, "over_1ms": float("inf")}


def gap_classes(gaps_us: list[float]) -> dict:
    """Idle gaps by length: short ones are kernel boundaries inside a graph, long ones the host's doing."""
    classes, lower = {}, 0
    for name, upper in GAP_CLASSES_US.items():
        inside = [gap for gap in gaps_us if lower <= gap < upper]
        classes[name] = dict(count=len(inside), ms=round(sum(inside) / 1e3, 1))
        lower = upper
    return classes


PARTS = {f"{name}_kernels": name for name in ("single", "bench", "many_short", "sampling")}  # part -> workload


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--random-dims", default="qwen3-0.6b", choices=sorted(REAL_DIMENSIONS))
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--extra-args", type=json.loads, default={}, metavar="JSON", help="more LLM arguments")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--workloads", default="single,many_short,bench", help="workloads whose phases to time")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {', '.join(PARTS)}, or none")
    parser.add_argument("--sampling", type=json.loads, default={}, metavar="JSON",
                        help='extra SamplingParams for the workloads\' requests, e.g. \'{"logprobs": 5}\'')
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    chosen = [part for part in args.parts.split(",") if part != "none"]
    if set(chosen) - set(PARTS):
        parser.error(f"unknown parts {sorted(set(chosen) - set(PARTS))}; known: {', '.join(PARTS)}")
    start = perf_counter()
    path = random_checkpoint(args.random_checkpoint, args.random_dims, weights=args.load_format != "dummy")
    llm = LLM(path, load_format=args.load_format, **args.extra_args)
    report = dict(startup_s=round(perf_counter() - start, 2), kv_blocks=llm.executor.num_kvcache_blocks)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
    parts = [(name, lambda name=name: timed_workload(llm, name, sampling=args.sampling))
             for name in args.workloads.split(",") if name]
    parts += [(part, lambda part=part: workload_kernels(llm, PARTS[part], args.out, args.sampling)) for part in chosen]
    for name, part in parts:
        try:
            report[name] = part()
        except Exception as error:  # one part failing must not lose the others' figures
            traceback.print_exc()
            report[name] = f"failed: {error!r}"
        print(name, json.dumps(report[name]), flush=True)
    report["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    with open(os.path.join(args.out, "profile_engine.json"), "w") as f:
        json.dump(report, f, indent=1)
    llm.exit()


if __name__ == "__main__":
    main()
