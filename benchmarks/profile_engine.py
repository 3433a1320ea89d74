"""Where this engine's time goes, on one GPU: the host's time per phase of a step, the device's time per
decode-graph replay, and the kernels of a single sequence's decode step.

    python -m benchmarks.profile_engine --random-checkpoint /tmp/q06 --out $OUT

Phases are timed on the host with perf_counter: `schedule`, `build` (the step's host arrays),
`launch` (upload and enqueue on the device), `wait` (blocked until the device has the previous step's
tokens: device-bound time), `update` (tokens into the scheduler) and `outputs`. Also counts torch.compile
graphs, which must not grow after start-up.
"""
import argparse
import json
import os
import traceback
from collections import defaultdict
from time import perf_counter

import torch

from benchmarks.gpu_timing import mean_replay_ms
from benchmarks.workloads import TEMPERATURE, make_workload
from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint


class PhaseTimer:
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


def timed_workload(llm: LLM, name: str, vocab_size: int | None = None, sampling: dict | None = None) -> dict:
    """The phases of one run of a workload, its requests sampled with `sampling`'s extra SamplingParams."""
    workload = make_workload(name, vocab_size=vocab_size)
    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=n, **(sampling or {}))
              for n in workload.max_tokens]
    timer = PhaseTimer()
    patches = [(llm.scheduler, "schedule"), (llm.executor, "execute_model"), (llm.executor, "wait"),
               (llm.scheduler, "update_from_output"), (llm.output_processor, "step_outputs")]
    names = ["schedule", "launch", "wait", "update", "outputs"]
    for (owner, attr), name in zip(patches, names):
        setattr(owner, attr, timer.wrap(name, getattr(owner, attr)))
    build = llm_engine.build_step_input
    llm_engine.build_step_input = timer.wrap("build", build)
    compiled_before = graphs_compiled()
    try:
        start = perf_counter()
        llm.generate(workload.prompts, params, use_tqdm=False)
        total = perf_counter() - start
    finally:
        llm_engine.build_step_input = build
        for owner, attr in patches:
            delattr(owner, attr)
    report = timer.report(total, workload.num_output_tokens)
    report["graphs_compiled_during_run"] = graphs_compiled() - compiled_before
    return report


@torch.inference_mode()
def workload_kernels(llm: LLM, name: str, out_dir: str, sampling: dict | None = None) -> dict:
    """Every kernel of one run of a workload, whole: device time per kernel name, written as a table, and
    the device's busy time (the union of kernel intervals) against the run's wall time, so that the time
    the device sat idle is counted too."""
    workload = make_workload(name)
    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=n, **(sampling or {}))
              for n in workload.max_tokens]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        start = perf_counter()
        llm.generate(workload.prompts, params, use_tqdm=False)
        wall_s = perf_counter() - start
    per_name = defaultdict(lambda: [0.0, 0])
    intervals = []
    for event in profiler.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        per_name[event.name][0] += event.device_time_total
        per_name[event.name][1] += 1
        intervals.append((event.time_range.start, event.time_range.end))
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    with open(os.path.join(out_dir, f"{name}_kernels.txt"), "w") as f:
        for kernel, (us, count) in rows:
            f.write(f"{us / 1e3:10.1f} ms {count:8d} x {us / count:9.1f} us  {kernel[:160]}\n")
    busy_us, gaps = union_length(intervals)
    top = {kernel[:80]: round(us / 1e3, 1) for kernel, (us, _) in rows[:12]}
    return dict(wall_s=round(wall_s, 3), device_busy_s=round(busy_us / 1e6, 3),
                kernel_s=round(sum(us for us, _ in per_name.values()) / 1e6, 3), idle_gaps=gap_classes(gaps),
                top_kernels_ms=top)


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


def load_graph_inputs(llm: LLM, bs: int, context_len: int):
    """Every one of bs rows attends to context_len keys in distinct blocks, storing no K/V."""
    graphs = llm.executor.model_runner.decode_graphs
    blocks_per_seq = -(-context_len // llm.config.kvcache_block_size)
    num_blocks = llm.executor.num_kvcache_blocks
    table = torch.arange(bs * blocks_per_seq, device="cuda").remainder(num_blocks).view(bs, blocks_per_seq)
    buffers = graphs.buffers
    buffers["block_tables"].fill_(-1)
    buffers["block_tables"][:bs, :blocks_per_seq] = table.int()
    buffers["context_lens"].fill_(context_len)
    buffers["positions"].fill_(context_len - 1)
    buffers["pending_rows"].fill_(-1)
    buffers["slot_mapping"].fill_(-1)
    buffers["token_ids"].random_(0, 10000)
    if "sampling_slots" in buffers:  # the sampler's scratch slot (since issue 20)
        buffers["sampling_slots"].fill_(llm.config.max_num_seqs)


class DecodeStepReplay:
    """A decode step of batch-size bucket bs as the engine replays it: the model's graph, then the sampler's."""

    def __init__(self, graphs, bs: int):
        self.graphs, self.bs = graphs, bs

    def replay(self):
        self.graphs.decode_graphs[self.bs].replay()
        sample_graphs = self.graphs.sample_graphs  # keyed by (bs, filter); by bs alone before issue 20
        sample_graphs[(self.bs, 0) if (self.bs, 0) in sample_graphs else self.bs].replay()


@torch.inference_mode()
def graph_replay_ms(llm: LLM, context_len: int = 512) -> dict:
    """Device time of one decode step's replays (the model's and the sampler's graphs) per batch size, every
    row attending to context_len keys."""
    graphs = llm.executor.model_runner.decode_graphs
    times = {}
    for bs in [b for b in (1, 8, 64, 256, 512, 1024) if b in graphs.decode_graphs]:
        load_graph_inputs(llm, bs, context_len)
        times[bs] = round(mean_replay_ms(DecodeStepReplay(graphs, bs), warmup=3, replays=20), 4)
    graphs.buffers["context_lens"].zero_()
    return times


@torch.inference_mode()
def graph_replay_kernels(llm: LLM, out_dir: str, shapes=((1, 384), (256, 1024))) -> dict:
    """The kernels of one decode step's replays, per (batch size, keys per row): a profiler table of
    REPLAYS replays, written to a file, and the device time per replay it adds up to."""
    graphs = llm.executor.model_runner.decode_graphs
    totals = {}
    for bs, context_len in shapes:
        load_graph_inputs(llm, bs, context_len)
        graph = DecodeStepReplay(graphs, graphs.bucket(bs))
        graph.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for _ in range(REPLAYS):
                graph.replay()
            torch.cuda.synchronize()
        averages = profiler.key_averages()
        table = averages.table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90)
        with open(os.path.join(out_dir, f"graph_kernels_bs{bs}_keys{context_len}.txt"), "w") as f:
            f.write(table)
        kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
        totals[f"bs{bs}_keys{context_len}"] = dict(
            us_per_replay=round(sum(e.device_time_total for e in kernels) / REPLAYS, 1),
            kernels_per_replay=round(sum(e.count for e in kernels) / REPLAYS, 1))
    graphs.buffers["context_lens"].zero_()
    return totals


REPLAYS = 10


def host_profile(llm: LLM, out_dir: str) -> str:
    """cProfile of the single workload's generate: where the host's time per step goes."""
    import cProfile
    import pstats
    prompt = make_workload("single").prompts[0]
    params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=256)
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate([prompt], params, use_tqdm=False)
    profiler.disable()
    path = os.path.join(out_dir, "single_host_profile.txt")
    with open(path, "w") as f:
        stats = pstats.Stats(profiler, stream=f)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
    return path


def profiled_single_sequence(llm: LLM):
    """The torch profiler (host and device) over a single sequence's 64 decode steps, after one unprofiled run."""
    prompt = make_workload("single").prompts[0]
    params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=64)
    llm.generate([prompt], params, use_tqdm=False)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        llm.generate([prompt], params, use_tqdm=False)
    return profiler


def single_sequence_kernels(llm: LLM, out_dir: str) -> str:
    table = profiled_single_sequence(llm).key_averages().table(sort_by="cuda_time_total", row_limit=60,
                                                                max_name_column_width=90)
    with open(os.path.join(out_dir, "single_sequence_kernels.txt"), "w") as f:
        f.write(table)
    return table


def single_sequence_trace(llm: LLM, out_dir: str) -> str:
    """A Chrome trace (host calls and device kernels) of a single sequence's decode steps, to read where the
    device waits for the host."""
    return export_gzipped_trace(profiled_single_sequence(llm), os.path.join(out_dir, "single_trace.json"))


def export_gzipped_trace(profiler, path: str) -> str:
    """The profiler's Chrome trace at path + ".gz" (a tenth of the size: the device machine returns little)."""
    import gzip
    import shutil
    profiler.export_chrome_trace(path)
    with open(path, "rb") as raw, gzip.open(path + ".gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    os.remove(path)
    return path + ".gz"


PARTS = {
    "graph_replay_ms_at_512_keys": lambda llm, args: graph_replay_ms(llm),
    "graph_replay_kernels": lambda llm, args: graph_replay_kernels(llm, args.out, args.kernel_shapes),
    "single_sequence_kernels": lambda llm, args: single_sequence_kernels(llm, args.out),
    "single_sequence_trace": lambda llm, args: single_sequence_trace(llm, args.out),
    "host_profile": lambda llm, args: host_profile(llm, args.out),
    "single_kernels": lambda llm, args: workload_kernels(llm, "single", args.out, args.sampling),
    "bench_kernels": lambda llm, args: workload_kernels(llm, "bench", args.out, args.sampling),
    "many_short_kernels": lambda llm, args: workload_kernels(llm, "many_short", args.out, args.sampling),
    "sampling_kernels": lambda llm, args: workload_kernels(llm, "sampling", args.out, args.sampling),
}


def kernel_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]


def graphs_compiled() -> int:
    """torch.compile's count of graphs compiled so far in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--workloads", default="single,many_short,bench")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {', '.join(PARTS)}, or none")
    parser.add_argument("--kernel-shapes", default="1x384,256x1024", type=kernel_shapes,
                        help="graph_replay_kernels' (batch size)x(keys per row) list")
    parser.add_argument("--sampling", type=json.loads, default={}, metavar="JSON",
                        help='extra SamplingParams for the workloads\' requests, e.g. \'{"logprobs": 5}\'')
    args = parser.parse_args()
    random_qwen3_0_6b_checkpoint(args.random_checkpoint)
    start = perf_counter()
    llm = LLM(args.random_checkpoint)
    report = dict(startup_s=round(perf_counter() - start, 2), kv_blocks=llm.executor.num_kvcache_blocks,
                  graphs_compiled_at_start=graphs_compiled())
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
    parts = [(name, lambda name=name: timed_workload(llm, name, sampling=args.sampling))
             for name in args.workloads.split(",")]
    chosen = args.parts.split(",")
    parts += [(part, lambda part=part: PARTS[part](llm, args)) for part in PARTS if part in chosen]
    for name, part in parts:
        try:
            report[name] = part()
        except Exception as error:  # one part failing must not lose the others' figures
            traceback.print_exc()
            report[name] = f"failed: {error!r}"
        print(name, report[name] if isinstance(report[name], str) else json.dumps(report[name]), flush=True)
    report["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    with open(os.path.join(args.out, "profile_engine.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict)}))
    llm.exit()


if __name__ == "__main__":
    main()
