"""A single sequence's decode step with the engine taken out: after the single workload has run (so the graphs'
input buffer holds a real step of one row), its decode and sample graphs are replayed on their own, launched
these ways, on whichever `nanovllm` comes first on the path:

- `queued`: every step launched at once and one wait at the end (the device never waits for the host);
- `one_ahead`: as the engine drives them: step i is launched, then step i - 1 is waited for;
- `drained`: each step waited for before the next is launched (no graph is launched while another runs);
- `alternating`: `queued` (and `one_ahead`), with second captures of both graphs taking every other step (so no
  graph exec is launched while its previous launch is still queued or running).

    python -m benchmarks.graph_replay --random-checkpoint /tmp/q06
    PYTHONPATH=.device/before:$PWD python benchmarks/graph_replay.py --random-checkpoint /tmp/q06  # another tree
"""
import argparse
import json
import statistics
from time import perf_counter

import torch

import nanovllm
from benchmarks.trace_single import single_rates
from nanovllm import LLM
from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint


def one_row_graphs(llm: LLM):
    """The decode graph and the first sample graph of batch size 1, and a second capture of each."""
    runner = llm.executor.model_runner
    graphs = runner.decode_graphs
    decode = graphs.decode_graphs[1]
    sample = graphs.sample_graphs.get(1) or next(g for key, g in graphs.sample_graphs.items() if key[0] == 1)
    logits = graphs.logits[:1]
    if hasattr(runner, "_sample_plain"):  # 1e0e5af
        def run_sample():
            return runner._sample_plain(logits, graphs.buffers["temperatures"][:1])
    else:
        from nanovllm.engine.step_io import NO_FILTER

        def run_sample():
            return runner._sample(logits, graphs.buffers["sampling_slots"][:1], NO_FILTER)
    second_decode, second_sample = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.inference_mode():
        with torch.cuda.graph(second_decode, decode.pool()):
            runner._decode(graphs.decode_inputs(1), logits)
        with torch.cuda.graph(second_sample, decode.pool()):
            run_sample()
    torch.cuda.synchronize()
    return (decode, sample), (second_decode, second_sample)


def recapture_decode(runner, bs: int = 1, own_pool: bool = False, debug: bool = False) -> torch.cuda.CUDAGraph:
    """The engine's decode graph of `bs` rows captured again, after one eager run as the engine captures, in the
    engine's graphs' pool (or one of its own); with `debug`, kept for `debug_dump`."""
    graphs = runner.decode_graphs
    with torch.inference_mode():
        runner._decode(graphs.decode_inputs(bs), graphs.logits[:bs])
        graph = torch.cuda.CUDAGraph()
        if debug:
            graph.enable_debug_mode()
        with torch.cuda.graph(graph, None if own_pool else graphs.decode_graphs[1].pool()):
            runner._decode(graphs.decode_inputs(bs), graphs.logits[:bs])
    torch.cuda.synchronize()
    return graph


def profiled_replays(graph: torch.cuda.CUDAGraph, replays: int):
    """torch.profiler's record of the graph replayed `replays` times (the device's activity only)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return prof


def kernel_times(graph: torch.cuda.CUDAGraph, replays: int = 50) -> dict[str, tuple[float, int]]:
    """The graph's kernels by name: (microseconds a replay, launches a replay), under torch.profiler."""
    prof = profiled_replays(graph, replays)
    return {event.key[:90]: (round(event.device_time_total / replays, 2), event.count // replays)
            for event in prof.key_averages() if event.device_time_total > 0}


def queued(steps: list) -> float:
    torch.cuda.synchronize()
    start = perf_counter()
    for step in steps:
        step()
    torch.cuda.synchronize()
    return (perf_counter() - start) / len(steps)


def one_ahead(steps: list) -> float:
    torch.cuda.synchronize()
    start, previous = perf_counter(), None
    for step in steps:
        step()
        done = torch.cuda.Event()
        done.record()
        if previous is not None:
            previous.synchronize()
        previous = done
    torch.cuda.synchronize()
    return (perf_counter() - start) / len(steps)


def drained(steps: list) -> float:
    start = perf_counter()
    for step in steps:
        step()
        torch.cuda.synchronize()
    return (perf_counter() - start) / len(steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(random_qwen3_0_6b_checkpoint(args.random_checkpoint))
    rates = single_rates(llm)
    first, second = one_row_graphs(llm)

    def step(decode, sample):
        return lambda: (decode.replay(), sample.replay())

    same = [step(*first)] * args.steps
    modes = dict(queued=(queued, same), one_ahead=(one_ahead, same), drained=(drained, same),
                 alternating=(queued, [step(*(first if i % 2 else second)) for i in range(args.steps)]),
                 alternating_one_ahead=(one_ahead, [step(*(first if i % 2 else second)) for i in range(args.steps)]),
                 decode_only=(queued, [first[0].replay] * args.steps))
    report = {name: [round(run(steps) * 1e6, 1) for _ in range(args.repeats)] for name, (run, steps) in modes.items()}
    report = {name: dict(us_per_step=runs, median=statistics.median(runs)) for name, runs in report.items()}
    print(nanovllm.__file__, "single tok/s:", rates, json.dumps(report), flush=True)
    llm.exit()


if __name__ == "__main__":
    main()
