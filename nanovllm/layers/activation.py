import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import compile_if_cuda


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x, y = x.chunk(2, -1)
    return F.silu(x) * y


class SiluAndMul(nn.Module):

    def __init__(self):
        super().__init__()
        self.silu_and_mul = compile_if_cuda(silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul(x)
