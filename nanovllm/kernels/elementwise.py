"""The decoder layer's elementwise steps in Triton: the residual add with RMSNorm (its output also quantized
for an FP8 matmul that reads it), and SiLU-and-multiply.

Each is one kernel, rounding where the PyTorch layers (`layernorm.py`, `activation.py`) round, so the
CUDA path computes what the CPU path does. Written by hand rather than by torch.compile: compiling the
layer was most of a cold start-up's compile time, and these are all it fused.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.utils.fp8_weights import FP8, FP8_MAX, FP8Rows


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, q_ptr, scale_ptr, eps,
                    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr,
                    FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * HIDDEN
    cols = tl.arange(0, BLOCK)
    in_row = cols < HIDDEN
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)  # zeros past HIDDEN: out's max
    pdl.wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + row + cols, mask=in_row, other=0.0)
    if ADD_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row + cols, mask=in_row, other=0.0).to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row + cols, x, mask=in_row)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    out = ((x * inv_rms).to(dtype).to(tl.float32) * weight).to(dtype)
    tl.store(out_ptr + row + cols, out, mask=in_row)
    if QUANTIZE:  # in e4m3 with a scale per token, as `fp8_linear.quantize_groups_kernel` rounds a row
        out = out.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(out), axis=0), 1e-10) / FP8_MAX
        tl.store(q_ptr + row + cols, (out / scale).to(q_ptr.dtype.element_ty), mask=in_row)
        tl.store(scale_ptr + tl.program_id(0), scale)


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


def residual_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      quantize: bool = False):
    """RMSNorm of x [..., hidden] over its last dimension, after adding the residual where one is given:
    then returns (normalised, x + residual), as `layernorm.residual_rms_norm` does. With quantize, the rows of a 2-D
    x, if more than one, come normalised as FP8Rows, beside their e4m3 copy with a scale per token
    (`fp8_linear.quantize_groups(x, per_token=True)`'s) for the FP8 matmul that reads them; one row goes to the
    one-row kernel as it is."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    hidden, rows = x.size(-1), x.numel() // x.size(-1)
    quantize = quantize and x.dim() == 2 and rows > 1
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    q = torch.empty(x.shape, dtype=FP8, device=x.device) if quantize else None
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device) if quantize else None
    rms_norm_kernel[(rows,)](x, residual, weight, out, residual_out, q, scale, eps, HIDDEN=hidden,
                             BLOCK=triton.next_power_of_2(hidden), ADD_RESIDUAL=residual is not None,
                             QUANTIZE=quantize, FP8_MAX=FP8_MAX, **pdl.launch_options(x.device))
    if quantize:
        out = FP8Rows(out, q, scale)
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
