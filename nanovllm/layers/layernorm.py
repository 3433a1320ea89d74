from functools import partial

import torch
from torch import nn

from nanovllm.kernels import on_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x.to(orig_dtype) * weight


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the residual, then normalise; returns (normalised, new residual)."""
    residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(residual, weight, eps), residual


def residual_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """rms_norm, or add_rms_norm where a residual is given."""
    if residual is None:
        return rms_norm(x, weight, eps)
    return add_rms_norm(x, residual, weight, eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, after a residual add where one is given; one Triton kernel on CUDA, which
    with `quantize_rows` also rounds the rows to e4m3 per token for the FP8 matmul that reads them
    (`utils.fp8_weights.FP8Rows`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, quantize_rows: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.kernel = residual_rms_norm
        if on_cuda():
            from nanovllm.kernels import elementwise
            self.kernel = partial(elementwise.residual_rms_norm, quantize=quantize_rows)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernel(x, residual, self.weight, self.eps)
