"""Which implementation a layer runs, chosen once, when the layer is built: its plain PyTorch function, or,
where the model is built on CUDA (`ModelRunner` builds it under `torch.device(...)`), a fused kernel.

The kernels are named as "module:attribute" in `nanovllm.layers` and imported only when chosen, so
`import nanovllm` needs neither Triton nor flash-attn. Each PyTorch version stays beside its kernel as the
reference its tests compare against, and is what a CPU runs.
"""
import importlib

import torch


def choose_kernel(native, cuda: str):
    """`native`, or the kernel `cuda` ("module:attribute") where the model is being built on CUDA."""
    if torch.get_default_device().type != "cuda":
        return native
    module, attribute = cuda.split(":")
    return getattr(importlib.import_module(f"nanovllm.layers.{module}"), attribute)
