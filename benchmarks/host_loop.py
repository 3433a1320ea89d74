"""The engine's host work per step, with the device taken out: scheduling, the step's host arrays,
the sampling batch, taking in tokens and making outputs, on a tiny CPU checkpoint whose executor hands
back every step's tokens at once. The same phases as `profile_engine`, so its figures compare; this
machine's CPU is slower than the GPU machine's host, so the ratios between versions are what carry over.
`cpu_ms_per_step` is the main thread's CPU time (its own clock): on a shared machine, steadier than the wall time.

    python -m benchmarks.host_loop [--workloads bench,many_short] [--logprobs K] [--profile FILE]

With --logprobs K every request asks for K log-probabilities, and each step hands back K made-up ones a row.
"""
import argparse
import cProfile
import json
import pstats
import tempfile
from contextlib import nullcontext

from benchmarks.profile_engine import timed_workload
from nanovllm import LLM
from nanovllm.engine.step_io import StepOutput
from nanovllm.layers.sampled_logprobs import SampledLogprobs
from nanovllm.utils.checkpoint import write_random_checkpoint

# The GPU engine's defaults for bench.py's workload on an H200, where they shape the host's work.
ENGINE_ARGS = dict(device="cpu", kvcache_block_size=256, num_kvcache_blocks=4273, max_num_seqs=1024,
                   max_num_batched_tokens=16384, max_model_len=4096)
TOKEN = 7  # every sampled token; the workloads ignore EOS


class InstantExecutor:
    """Stands in for the executor: a step's tokens are ready as it is launched."""

    def __init__(self, num_kvcache_blocks: int, num_logprobs: int | None = None):
        self.num_kvcache_blocks = num_kvcache_blocks
        self.num_logprobs = num_logprobs

    def execute_model(self, step) -> StepOutput:
        n = step.num_sampled
        if self.num_logprobs is None:
            return StepOutput([TOKEN] * n)
        top_ids = [list(range(TOKEN, TOKEN + self.num_logprobs))] * n
        top_logprobs = [[-0.5 - 0.1 * r for r in range(self.num_logprobs)]] * n
        return StepOutput([TOKEN] * n, SampledLogprobs(top_ids, top_logprobs, [-0.5] * n, [1] * n))

    def wait(self, output: StepOutput) -> StepOutput:
        return output


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="bench,many_short")
    parser.add_argument("--logprobs", type=int, metavar="K", help="every request asks for K log-probabilities")
    parser.add_argument("--profile", metavar="FILE", help="cProfile the runs; write the 40 costliest functions")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = write_random_checkpoint(folder, max_position_embeddings=ENGINE_ARGS["max_model_len"])
        llm = LLM(model, **ENGINE_ARGS)
    real_executor, llm.executor = llm.executor, InstantExecutor(llm.executor.num_kvcache_blocks, args.logprobs)
    sampling = dict(logprobs=args.logprobs) if args.logprobs is not None else None
    profiler = cProfile.Profile() if args.profile else None
    try:
        for name in args.workloads.split(","):
            with profiler or nullcontext():
                report = timed_workload(llm, name, vocab_size=llm.config.hf_config.vocab_size, sampling=sampling)
            steps = report["phases"]["launch"]["calls"]
            print(name, json.dumps(dict(steps=steps, host_ms_per_step=round(report["total_s"] / steps * 1e3, 3),
                                        cpu_ms_per_step=round(report["cpu_s"] / steps * 1e3, 3),
                                        phases=report["phases"])), flush=True)
    finally:
        llm.executor = real_executor
        llm.exit()
    if profiler:
        with open(args.profile, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
