"""Who imports the heavy modules and registers custom ops during a fresh process's LLM(...)."""
import sys, time, traceback
T0 = time.time()
WATCH = ("transformers.generation", "transformers.modeling_utils", "torch.distributed.tensor", "sklearn", "sympy",
         "torch._dynamo", "scipy", "pandas", "torch.fx.experimental.symbolic_shapes", "transformers.distributed",
         "flash_attn", "triton", "torch._inductor", "torch._subclasses.fake_tensor")
seen = set()
class Finder:
    def find_spec(self, name, path=None, target=None):
        if name in WATCH and name not in seen:
            seen.add(name)
            stack = [f for f in traceback.extract_stack() if "importlib" not in f.filename][-12:]
            print(f"IMPORT {name} at {time.time() - T0:.2f}s\n" + "".join(traceback.format_list(stack)), flush=True)
        return None
sys.meta_path.insert(0, Finder())
import torch
print(f"torch imported {time.time() - T0:.2f}s", flush=True)
real = torch.library.custom_op
def traced(name, *a, **k):
    stack = traceback.extract_stack()[-3]
    print(f"CUSTOM_OP {name} from {stack.filename}:{stack.lineno} at {time.time() - T0:.2f}s", flush=True)
    return real(name, *a, **k)
torch.library.custom_op = traced
from torch._library import custom_ops
real_reg = custom_ops.CustomOpDef._register_to_dispatcher
def timed_reg(self, *a, **k):
    t = time.time(); r = real_reg(self, *a, **k)
    print(f"  _register_to_dispatcher {self._name} {time.time() - t:.3f}s", flush=True)
    return r
custom_ops.CustomOpDef._register_to_dispatcher = timed_reg
from nanovllm import LLM, SamplingParams
import nanovllm.engine.llm_engine  # noqa
print(f"nanovllm imported {time.time() - T0:.2f}s", flush=True)
t = time.time()
llm = LLM(sys.argv[1])
print(f"LLM(...) {time.time() - t:.2f}s, total {time.time() - T0:.2f}s", flush=True)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
llm.exit()
import os, transformers
d = os.path.dirname(transformers.__file__)
print("transformers", transformers.__version__, d, "writable", os.access(d, os.W_OK),
      "pycache", os.path.isdir(os.path.join(d, "__pycache__")), "PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"))
