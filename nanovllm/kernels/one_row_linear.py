"""A Triton matmul for one input row, which a decode step of one sequence is: cuBLAS reads the weights at a
fraction of the memory bandwidth on such shapes, and this kernel streams them.

Two output rows a program, each program reading its rows' whole K (up to 2048 at a time): the fastest of the
block sizes and warp counts `benchmarks/decode_kernels.py` sweeps on Qwen3-0.6B's shapes, with the weights cold
in the cache as a decode step reads them (docs/benchmarks.md).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels import elementwise, pdl

BLOCK_N, MAX_BLOCK_K = 2, 2048


@triton.jit
def one_row_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, K, HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    # y[n] = sum_k x[k] * w[n, k] (+ bias[n]) for this program's BLOCK_N outputs; w is row-major [N, K]. With
    # SILU_AND_MUL, x is silu(gate) * up of the row [gate | up] (2K wide), rounded as silu_and_mul_kernel rounds.
    # The first block of weights is loaded before waiting for the kernel that writes x.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dtype = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K),
                other=0.0)
    pdl.wait_for_previous(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        if SILU_AND_MUL:
            up = tl.load(x_ptr + K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            silu = (x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
            x = (silu * up).to(dtype).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        next_k = offs_k + BLOCK_K  # past K after the last block: nothing loaded
        w = tl.load(w_ptr + offs_n[:, None] * K + next_k[None, :],
                    mask=(offs_n[:, None] < N) & (next_k[None, :] < K), other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   silu_and_mul: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of shape [1, K] and a contiguous weight [N, K], in x's dtype unless
    out_dtype is given (the sum is float32's either way); with silu_and_mul, of silu(gate) * up for
    x = [gate | up] of shape [1, 2K]."""
    n, k = weight.shape
    x = x.contiguous()
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    block_k, num_warps = blocks_for(k)
    one_row_linear_kernel[(triton.cdiv(n, BLOCK_N),)](x, weight, bias if bias is not None else weight, y, n, k,
                                                      HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul,
                                                      BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=num_warps,
                                                      **pdl.launch_options(x.device))
    return y


def blocks_for(k: int) -> tuple[int, int]:
    """(BLOCK_K, warps) for an input of k features: the whole row up to MAX_BLOCK_K, 8 warps above 1024."""
    block_k = min(triton.next_power_of_2(k), MAX_BLOCK_K)
    return block_k, 4 if block_k <= 1024 else 8


def takes_one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() == 2 and x.size(0) == 1 and weight.numel() < 2**31  # the kernel's offsets are int32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the one-row kernel where x is one row."""
    return one_row_linear(x, weight, bias) if takes_one_row(x, weight) else F.linear(x, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`activation.silu_and_mul_linear`: for one row in one kernel, which takes the activation as it reads the
    row (a decode step of one sequence launches one kernel fewer a layer); else the activation's kernel first."""
    if takes_one_row(x, weight):
        return one_row_linear(x, weight, bias, silu_and_mul=True)
    return F.linear(elementwise.silu_and_mul(x), weight, bias)
