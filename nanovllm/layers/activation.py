import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.kernel_choice import choose_kernel


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x, y = x.chunk(2, -1)
    return F.silu(x) * y


class SiluAndMul(nn.Module):
    """silu(gate) * up; one Triton kernel on CUDA."""

    def __init__(self):
        super().__init__()
        self.kernel = choose_kernel(silu_and_mul, "elementwise_kernels:silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)
