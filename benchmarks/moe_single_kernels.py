"""One sequence's decode graph of a model with real dimensions (dummy weights), kernel by kernel: microseconds
a replay and launches a replay of each kernel, under torch.profiler, beside the replay's own time.

    python -m benchmarks.moe_single_kernels --random-checkpoint /tmp/moe30 [--random-dims qwen3-30b-a3b]

With programmatic dependent launch (`nanovllm/layers/pdl.py`) a kernel's time includes its wait for the one
before, so the table is a breakdown only under NANOVLLM_PDL=0.
"""
import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.graph_replay import queued
from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import REAL_DIMENSIONS, random_checkpoint


def kernel_rows(graph, replays: int = 50) -> list:
    """(name, us a replay, launches a replay) of the graph's kernels, the costliest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = [(event.key[:90], round(event.device_time_total / replays, 2), event.count // replays)
            for event in prof.key_averages() if event.device_time_total > 0]
    return sorted(rows, key=lambda row: -row[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--random-dims", default="qwen3-30b-a3b", choices=sorted(REAL_DIMENSIONS))
    args = parser.parse_args()
    llm = LLM(random_checkpoint(args.random_checkpoint, args.random_dims, weights=False), load_format="dummy",
              max_model_len=4096)
    llm.generate([[7] * 128], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64), use_tqdm=False)
    graph = llm.executor.model_runner.decode_graphs.decode_graphs[1]
    step_us = min(queued([graph.replay] * 500) for _ in range(3)) * 1e6
    print(json.dumps({"us_per_step": round(step_us, 1), "kernels (name, us a replay, launches a replay)":
                      kernel_rows(graph)}, indent=0))
    llm.exit()


if __name__ == "__main__":
    main()
