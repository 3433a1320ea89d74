"""The decoder layer's elementwise steps in Triton: the residual add with RMSNorm, and SiLU-and-multiply.

Each is one kernel, rounding where the PyTorch layers (`layernorm.py`, `activation.py`) round, so the
CUDA path computes what the CPU path does. Written by hand rather than by torch.compile: compiling the
layer was most of a cold start-up's compile time, and these are all it fused.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
                    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * HIDDEN
    cols = tl.arange(0, BLOCK)
    in_row = cols < HIDDEN
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + cols, mask=in_row).to(tl.float32)
    pdl.wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + row + cols, mask=in_row, other=0.0)
    if ADD_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row + cols, mask=in_row, other=0.0).to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row + cols, x, mask=in_row)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    tl.store(out_ptr + row + cols, ((x * inv_rms).to(dtype).to(tl.float32) * weight).to(dtype), mask=in_row)


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < WIDTH
    dtype = out_ptr.dtype.element_ty
    pdl.wait_for_previous(USE_PDL)
    gate = tl.load(x_ptr + row * 2 * WIDTH + cols, mask=in_row, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * WIDTH + WIDTH + cols, mask=in_row, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * WIDTH + cols, (silu * up).to(dtype), mask=in_row)


def residual_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """RMSNorm of x [..., hidden] over its last dimension, after adding the residual where one is given:
    then returns (normalised, x + residual), as `layernorm.residual_rms_norm` does."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    hidden = x.size(-1)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    rms_norm_kernel[(x.numel() // hidden,)](x, residual, weight, out, residual_out, eps, HIDDEN=hidden,
                                            BLOCK=triton.next_power_of_2(hidden), ADD_RESIDUAL=residual is not None,
                                            **pdl.launch_options(x.device))
    return out if residual is None else (out, residual_out)


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, for x = [gate | up] of [num_tokens, 2 * width]."""
    assert x.is_contiguous()
    num_tokens, width = x.size(0), x.size(1) // 2
    out = x.new_empty(num_tokens, width)
    silu_and_mul_kernel[(num_tokens, triton.cdiv(width, SILU_BLOCK))](x, out, WIDTH=width, BLOCK=SILU_BLOCK,
                                                                            **pdl.launch_options(x.device))
    return out
