"""Programmatic dependent launch (Hopper and later) for the decoder layer's own kernels: a kernel launched
with it starts while the kernel before it is still running. Its programs first load what no earlier
kernel writes (weights), then wait (`griddepcontrol.wait`) until the kernel before has finished and its
writes are visible. In a decode step of one sequence, a chain of a few hundred small kernels, that hides
each launch's latency and each kernel's first weight loads behind the kernel before; a CUDA graph keeps
the overlap (stream capture records it as a programmatic edge).

The rule for a kernel launched this way: nothing it reads or writes that another kernel writes or reads
(activations, the KV cache, a step's inputs) before `wait_for_previous`, or before `after_wait` in a loop
Triton pipelines. A kernel that waits has had every earlier kernel finish, since the one before it waited in
turn.

`NANOVLLM_PDL=0` turns it off (to measure it).
"""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and os.environ.get("NANOVLLM_PDL", "1") != "0"


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch."""
    return device.type == "cuda" and _supported(device.index if device.index is not None else
                                                torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a kernel launch: its USE_PDL and, where enabled, Triton's launch_pdl."""
    return dict(USE_PDL=True, launch_pdl=True) if enabled(device) else dict(USE_PDL=False)


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Let the next kernel start launching, then wait for the one before this to finish."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def let_next_launch(USE_PDL: tl.constexpr):
    """Let the next kernel start launching (`after_wait` waits later)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def after_wait(value, USE_PDL: tl.constexpr):
    """value (int32), given once the kernel before this has finished: a load masked by it cannot start before
    the wait. For a loop Triton pipelines, whose prologue issues the first iterations' loads ahead of the loop
    body: the wait is declared pure, so the pipeliner moves it into the prologue with the loads that depend on
    it, after the weights' loads that come before it in the body."""
    if USE_PDL:
        value = tl.inline_asm_elementwise("griddepcontrol.wait;\n\tmov.b32 $0, $1;", "=r,r", [value],
                                          dtype=tl.int32, is_pure=True, pack=1)
    return value
