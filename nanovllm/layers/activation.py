import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x, y = x.chunk(2, -1)
    return F.silu(x) * y


class SiluAndMul(nn.Module):
    """silu(gate) * up; one Triton kernel where modules are built on CUDA."""

    def __init__(self):
        super().__init__()
        self.kernel = silu_and_mul
        if torch.get_default_device().type == "cuda":
            from nanovllm.layers.elementwise_kernels import silu_and_mul as kernel  # only CUDA builds need Triton
            self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)
