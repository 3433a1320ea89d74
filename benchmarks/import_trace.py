"""Who first asks for each of a list of heavy modules (found or not) during a new process's `LLM(...)`, and
when: an import hook prints the importing stack (the last frames outside importlib) and the seconds since the
process began, then the seconds of the imports and of `LLM(...)`.

    python -m benchmarks.import_trace --random-checkpoint /tmp/q06 [--modules sympy,sklearn,...]

What a fresh Ray replica or `run_batch` pays before its first step: docs/benchmarks.md, the sixth session.
"""
import time

START = time.time()

import argparse  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

HEAVY = ("transformers.generation", "transformers.modeling_utils", "transformers.distributed",
         "torch.distributed.tensor", "torch._dynamo", "torch._inductor", "torch.fx.experimental.symbolic_shapes",
         "torch._subclasses.fake_tensor", "sympy", "scipy", "pandas", "sklearn", "triton", "flash_attn")


class ImportTracer:
    """A meta-path finder that finds nothing: it only reports the first import of each watched module."""

    def __init__(self, modules):
        self.waiting = set(modules)

    def find_spec(self, name, path=None, target=None):
        if name in self.waiting:
            self.waiting.discard(name)
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename][-12:]
            print(f"import {name} at {time.time() - START:.2f} s\n" + "".join(traceback.format_list(frames)),
                  flush=True)
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--modules", default=",".join(HEAVY))
    args = parser.parse_args()
    sys.meta_path.insert(0, ImportTracer(args.modules.split(",")))
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine import llm_engine  # noqa: F401  (the engine's imports, as LLM(...) makes them)
    from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint
    imported = time.time()
    print(f"nanovllm imported at {imported - START:.2f} s", flush=True)
    llm = LLM(random_qwen3_0_6b_checkpoint(args.random_checkpoint))
    print(f"LLM(...) {time.time() - imported:.2f} s, {time.time() - START:.2f} s since the process began",
          flush=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
    llm.exit()


if __name__ == "__main__":
    main()
