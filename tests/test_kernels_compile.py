"""The FP8 KV cache's kernel variants (and the same kernels without it) compiled for an H200 (sm_90) on a CPU, with
Triton's own compiler and ptxas (`hopper_compile.py`, in a process of its own, so that nothing of the compiler is
imported where the interpreted kernel tests run): the interpreter runs what the compiler may refuse (a value whose
type a run-time branch changes), and the engine would fail at start-up there. The FP8 attention kernels must also
load their 8-bit tiles from shared memory with ldmatrix, never a byte at a time (what values laid out by slot cost),
and decode attention's launches fit an SM's shared memory at head_dim 256 (float32's 128-key tiles did not). The
one-row kernel's pipeline over FP8 weights must load its first block of weights, and nothing else, before waiting
for the kernel before it, and the MoE routing kernel nothing at all. The grouped MoE kernels over FP8 experts, row-
or block-scaled, must sum on FP8 tensor cores (e4m3 wgmma)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs Triton", allow_module_level=True)


def test_the_kernels_compile_for_hopper():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, os.path.join(here, "hopper_compile.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert len(results) == 16 and not {case: error for case, error in results.items() if error}
