"""Whether a decode graph's replay time depends on when it was captured or on what its inputs hold: the
one-row graph captured at start-up and one captured again before any generate, both replayed before and
after a generate (which leaves its last step's inputs, 190 keys, in the graphs' buffers; before it they
hold the warm-up's), graphs of 2-8 rows against their recaptures, and the gaps between the kernels of one
replay under torch.profiler.

    python benchmarks/graph_gap.py --random-checkpoint /tmp/q06 [--tree .device/before] --out DIR

(Run as a script, so that --tree's `nanovllm` comes first on the path.)
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernel_gaps(graph, trace_path: str, replays: int = 20) -> tuple[dict, dict]:
    """The replay's kernels, span and busy time (us, medians), and the median gap before each kernel of
    it, keyed by (its index, its name)."""
    from benchmarks.graph_replay import profiled_replays
    profiled_replays(graph, replays).export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset")),
                        key=lambda e: e["ts"])
    os.remove(trace_path)
    per_replay = len(events) // replays
    spans, busy, gaps = [], [], {}
    for r in range(replays):
        replay = events[r * per_replay:(r + 1) * per_replay]
        spans.append(replay[-1]["ts"] + replay[-1]["dur"] - replay[0]["ts"])
        busy.append(sum(e["dur"] for e in replay))
        for i, (before, kernel) in enumerate(zip(replay, replay[1:])):
            gaps.setdefault((i, kernel["name"][:40]), []).append(kernel["ts"] - before["ts"] - before["dur"])
    summary = dict(kernels=per_replay, span=statistics.median(spans), busy=statistics.median(busy))
    return summary, {key: statistics.median(values) for key, values in gaps.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--tree", default=ROOT, help="the tree whose engine runs (its nanovllm/ first on the path)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sys.path[:0] = [os.path.abspath(args.tree), ROOT]

    from benchmarks.graph_replay import queued, recapture_decode
    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint
    os.makedirs(args.out, exist_ok=True)
    llm = LLM(random_qwen3_0_6b_checkpoint(args.random_checkpoint))
    runner = llm.executor.model_runner
    graphs = runner.decode_graphs

    def us(graph) -> float:
        return round(min(queued([graph.replay] * 1000) for _ in range(3)) * 1e6, 1)

    early = recapture_decode(runner)
    report = {"tree": args.tree, "engine bs1": us(graphs.decode_graphs[1]), "recaptured before generate": us(early)}
    llm.generate([[7] * 128], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64), use_tqdm=False)
    late = recapture_decode(runner)
    report.update({"engine bs1 after generate": us(graphs.decode_graphs[1]),
                   "recaptured before generate, replayed after": us(early),
                   "recaptured after generate": us(late)})
    for bs in (2, 4, 8):
        report[f"engine bs{bs}"] = us(graphs.decode_graphs[bs])
        report[f"recaptured bs{bs}"] = us(recapture_decode(runner, bs))
    trace = os.path.join(args.out, "trace.json")
    report["profiled engine"], engine_gaps = kernel_gaps(graphs.decode_graphs[1], trace)
    report["profiled recaptured"], late_gaps = kernel_gaps(late, trace)
    report["gap sums, us: engine / recaptured"] = [round(sum(engine_gaps.values()), 1),
                                                   round(sum(late_gaps.values()), 1)]
    print(json.dumps(report, indent=1), flush=True)
    llm.exit()


if __name__ == "__main__":
    main()
