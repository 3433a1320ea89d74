"""One sequence's decode graph of a model with real dimensions (dummy weights), kernel by kernel: microseconds
a replay and launches a replay of each kernel, under torch.profiler, beside the replay's own time.

    python -m benchmarks.moe_single_kernels --random-checkpoint /tmp/moe30 [--random-dims qwen3-30b-a3b]

With programmatic dependent launch (`nanovllm/layers/pdl.py`) a kernel's time includes its wait for the one
before, so the table is a breakdown only under NANOVLLM_PDL=0.
"""
import argparse
import json

from benchmarks.graph_replay import kernel_times, queued
from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import REAL_DIMENSIONS, random_checkpoint


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
    kernels = sorted(((name, *times) for name, times in kernel_times(graph).items()), key=lambda row: -row[1])
    print(json.dumps({"us_per_step": round(step_us, 1), "kernels (name, us a replay, launches a replay)": kernels},
                     indent=0))
    llm.exit()


if __name__ == "__main__":
    main()
