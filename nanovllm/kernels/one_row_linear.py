"""A Triton matmul for one input row, which a decode step of one sequence is: cuBLAS reads the weights at a
fraction of the memory bandwidth on such shapes, and this kernel streams them.

A program computes two output rows of a bf16 weight, eight of an FP8 one, reading up to 2,048 columns of them at
a time. FP8 weights go through a loop Triton pipelines, which made Qwen3-8B's one sequence 1.5x faster; bf16's stay
in a loop that loads the next block into registers (through the pipeline, Qwen3-0.6B's one sequence ran 9%
slower). The block sizes and warps are the fastest swept with the weights cold in the cache as a decode step reads them
(`benchmarks/decode_kernels.py` on Qwen3-0.6B's bf16 shapes, `benchmarks/fp8_kernels.py --one-row` on FP8 ones;
docs/benchmarks.md).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels import elementwise, pdl
from nanovllm.utils.fp8_weights import has_row_scales

BLOCK_N, MAX_BLOCK_K = 2, 2048
FP8_BLOCK_N, FP8_WEIGHTS_A_THREAD = 8, 128  # an FP8 weight's rows a program, and a thread's weights (its warps)
FP8_STAGES = 3  # an FP8 weight's blocks in Triton's pipeline: two in flight while a third is summed


@triton.jit
def row_sums(products, scale_ptr, rows, k0, N, K, stride_sn, stride_sk, SCALE_ROWS: tl.constexpr,
             GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The sums along k of products [BLOCK_N, BLOCK_K] (w[rows, k0 + j] * x[k0 + j]); for an FP8 weight
    (GROUP_K > 0) each group of GROUP_K columns times its scale, scale[rows // SCALE_ROWS, k // GROUP_K] (strides
    stride_sn, stride_sk: a per-row scale has stride_sk 0)."""
    if GROUP_K == 0:  # (an else, not an early return: Triton compiles what follows a return too)
        sums = tl.sum(products, axis=1)
    else:
        groups = k0 + tl.arange(0, BLOCK_K // GROUP_K) * GROUP_K
        scales = tl.load(scale_ptr + (rows // SCALE_ROWS)[:, None] * stride_sn + (groups // GROUP_K)[None, :] *
                         stride_sk, mask=(rows < N)[:, None] & (groups < K)[None, :], other=0.0)
        group_sums = tl.sum(tl.reshape(products, (BLOCK_N, BLOCK_K // GROUP_K, GROUP_K)), axis=2)
        sums = tl.sum(group_sums * scales, axis=1)
    return sums


def scale_args(weight: torch.Tensor, scale: torch.Tensor | None, block_k: int) -> dict:
    """row_sums' scale arguments for a weight [..., N, K] and its scale (`utils/fp8_weights.py`'s layouts: per
    row [..., N, 1], per 128x128 block), or for an unquantized weight (scale None)."""
    if scale is None:
        return dict(scale_ptr=weight, stride_sn=0, stride_sk=0, SCALE_ROWS=1, GROUP_K=0)
    per_row = has_row_scales(weight, scale)
    return dict(scale_ptr=scale, stride_sn=scale.stride(-2), stride_sk=0 if per_row else scale.stride(-1),
                SCALE_ROWS=1 if per_row else 128, GROUP_K=block_k if per_row else min(128, block_k))


@triton.jit
def one_row_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, K, scale_ptr, stride_sn, stride_sk,
                          SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SILU_AND_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    # y[n] = sum_k x[k] * w[n, k] (+ bias[n]) for this program's BLOCK_N outputs; w is row-major [N, K], in x's
    # dtype or FP8 with scales (row_sums). The first block of weights is loaded before waiting for the kernel
    # that writes x: with STAGES 1, the next block is loaded into registers while one is summed; above, Triton
    # pipelines the loop STAGES - 1 blocks ahead through shared memory, and x's loads wait (`pdl.after_wait`).
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if STAGES == 1:
        w = weight_block(w_ptr, offs_n, tl.arange(0, BLOCK_K), N, K)
        pdl.wait_for_previous(USE_PDL)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            acc = add_block(acc, w, x_ptr, offs_k, offs_k < K, k0, offs_n, N, K, scale_ptr, stride_sn, stride_sk,
                            SCALE_ROWS, GROUP_K, SILU_AND_MUL, BLOCK_N, BLOCK_K)
            w = weight_block(w_ptr, offs_n, offs_k + BLOCK_K, N, K)  # past K after the last block: nothing loaded
    else:
        pdl.let_next_launch(USE_PDL)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = weight_block(w_ptr, offs_n, offs_k, N, K)
            has_x = (offs_k < K) & (pdl.after_wait(k0, USE_PDL) >= 0)
            acc = add_block(acc, w, x_ptr, offs_k, has_x, k0, offs_n, N, K, scale_ptr, stride_sn, stride_sk,
                            SCALE_ROWS, GROUP_K, SILU_AND_MUL, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def weight_block(w_ptr, offs_n, offs_k, N, K):
    return tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K),
                   other=0.0)


@triton.jit
def add_block(acc, w, x_ptr, offs_k, has_x, k0, offs_n, N, K, scale_ptr, stride_sn, stride_sk,
              SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr, SILU_AND_MUL: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """acc plus the block of weights w times x at offs_k (loaded where has_x). With SILU_AND_MUL, x is
    silu(gate) * up of the row [gate | up] (2K wide), rounded as silu_and_mul_kernel rounds."""
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs_k, mask=has_x, other=0.0).to(tl.float32)
    if SILU_AND_MUL:
        up = tl.load(x_ptr + K + offs_k, mask=has_x, other=0.0).to(tl.float32)
        silu = (x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
        x = (silu * up).to(dtype).to(tl.float32)
    return acc + row_sums(w.to(tl.float32) * x[None, :], scale_ptr, offs_n, k0, N, K, stride_sn, stride_sk,
                          SCALE_ROWS, GROUP_K, BLOCK_N, BLOCK_K)


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   silu_and_mul: bool = False, out_dtype: torch.dtype | None = None,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of shape [1, K] and a contiguous weight [N, K] (FP8 with its `scale`, or
    in x's dtype), in x's dtype unless out_dtype is given (the sum is float32's either way); with silu_and_mul,
    of silu(gate) * up for x = [gate | up] of shape [1, 2K]."""
    n, k = weight.shape
    x = x.contiguous()
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    block_k, num_warps = blocks_for(k) if scale is None else fp8_blocks_for(k)
    block_n = BLOCK_N if scale is None else FP8_BLOCK_N
    one_row_linear_kernel[(triton.cdiv(n, block_n),)](x, weight, bias if bias is not None else weight, y, n, k,
                                                      **scale_args(weight, scale, block_k),
                                                      HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul,
                                                      BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                                                      STAGES=1 if scale is None else FP8_STAGES,
                                                      **pdl.launch_options(x.device))
    return y


def blocks_for(k: int) -> tuple[int, int]:
    """(BLOCK_K, warps) for an input of k features: the whole row up to MAX_BLOCK_K, 8 warps above 1024."""
    block_k = min(triton.next_power_of_2(k), MAX_BLOCK_K)
    return block_k, 4 if block_k <= 1024 else 8


def fp8_blocks_for(k: int) -> tuple[int, int]:
    """blocks_for an FP8 weight's FP8_BLOCK_N rows: the whole row up to MAX_BLOCK_K, FP8_WEIGHTS_A_THREAD a thread."""
    block_k = min(triton.next_power_of_2(k), MAX_BLOCK_K)
    return block_k, max(1, FP8_BLOCK_N * block_k // (32 * FP8_WEIGHTS_A_THREAD))


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
