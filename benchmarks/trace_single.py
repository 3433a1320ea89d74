"""The single workload on whichever `nanovllm` comes first on the path: three timed runs, then a Chrome
trace (gzipped) of 64 decode steps, for `benchmarks.trace_gaps`. Runs another tree's engine too, as a script
(with -m, the working directory would come first on the path):

    PYTHONPATH=.device/before:$PWD python benchmarks/trace_single.py --random-checkpoint /tmp/q06 --out before.json
"""
import argparse
from time import perf_counter

import torch

import nanovllm
from benchmarks.profile_engine import export_gzipped_trace, profiled_single_sequence
from benchmarks.workloads import TEMPERATURE, make_workload
from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint


def single_rates(llm: LLM) -> list[int]:
    """The single workload's tok/s, three times, after a warm-up."""
    work = make_workload("single")
    params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=work.max_tokens[0])
    llm.generate(work.prompts, params, use_tqdm=False)
    rates = []
    for _ in range(3):
        start = perf_counter()
        llm.generate(work.prompts, params, use_tqdm=False)
        rates.append(round(work.max_tokens[0] / (perf_counter() - start)))
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--out", required=True, help="the trace's path; written gzipped, as OUT.gz")
    parser.add_argument("--sync-before-launch", action="store_true",
                        help="wait for the device before each step's launch, so no graph is launched while "
                             "another runs (to tell whether launching into a busy device slows its kernels)")
    args = parser.parse_args()
    llm = LLM(random_qwen3_0_6b_checkpoint(args.random_checkpoint))
    if args.sync_before_launch:
        launch = llm.executor.execute_model

        def synced_launch(step):
            torch.cuda.synchronize()
            return launch(step)
        llm.executor.execute_model = synced_launch
    print(nanovllm.__file__, "single tok/s:", single_rates(llm), flush=True)
    export_gzipped_trace(profiled_single_sequence(llm), args.out)
    llm.exit()


if __name__ == "__main__":
    main()
