"""Matmuls that read FP8 weights (e4m3, a scale per output row or per 128x128 block: `utils/fp8_weights.py`),
half the bytes of bf16: what a decode step of a large model, which reads every weight once, spends its time on.

- one row (a decode step of one sequence): `one_row_linear`'s kernel, scaling each group of columns it sums;
- more rows: `quantize_groups` rounds the activations to e4m3, dynamically as vLLM does: for block scales with
  a scale per row and 128 columns (its per-token-group scales), for row scales with one a row (its per-token
  scales; the norm before the matmul does it where there is one, `FP8Rows`). Then `fp8_matmul_kernel` sums
  tiles of them by tiles of the weight on FP8 tensor cores (W8A8: twice bf16's rate, and no conversion of the
  weight), scaling each 128 columns' sum by the activations' scales and the weight's block scales (or the
  weight's row scales once at the end); on Hopper, above TORCH_MATMUL_ROWS rows with block scales and
  TORCH_ROWWISE_ROWS with row scales (but where `keeps_decode_tiles`), torch's FP8 matmul (cuBLAS: block-scaled,
  row-wise) instead.

Tiles by rows (`fp8_tiles.py`): decode batches take narrow tiles, so that even a small weight spreads over the
GPU's multiprocessors, and an output of few of them splits each tile's sum over several programs, the last of which
to finish adds their float32 partial sums; prompts take wide tiles.
Under Triton's interpreter in the CPU tests.
"""
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.arrivals import arrival_counters
from nanovllm.kernels.fp8_tiles import Tiles, choose_split_k, choose_tiles, keeps_decode_tiles
from nanovllm.kernels.one_row_linear import one_row_linear, takes_one_row
from nanovllm.utils.fp8_weights import FP8, FP8_MAX, FP8Rows, has_row_scales, split_rows

GROUP = 128  # for block scales, activations get a scale per row and GROUP columns (vLLM's per-token-group scales)


@triton.jit(do_not_specialize=["ROWS", "stride_scale_row", "stride_scale_group"])  # prompts vary them
def quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, ROWS, stride_scale_row, stride_scale_group, WIDTH: tl.constexpr,
                           GROUPS: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, GROUP: tl.constexpr,
                           SILU_AND_MUL: tl.constexpr, FP8_MAX: tl.constexpr):
    # A row's groups of GROUP columns: scale = amax / FP8_MAX (a tiny floor for all-zero groups), q = x / scale
    # in e4m3. With SILU_AND_MUL, of silu(gate) * up of the row [gate | up], rounded as silu_and_mul_kernel's.
    # Rows from ROWS on (padding) are zeros.
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (groups[:, None] < GROUPS) & (cols < WIDTH)
    load_mask = mask & (row < ROWS)
    dtype = x_ptr.dtype.element_ty
    if SILU_AND_MUL:
        gate = tl.load(x_ptr + row * 2 * WIDTH + cols, mask=load_mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * WIDTH + WIDTH + cols, mask=load_mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        x = (silu * up).to(dtype).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * WIDTH + cols, mask=load_mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / FP8_MAX
    tl.store(q_ptr + row * WIDTH + cols, (x / scale[:, None]).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_scale_row + groups * stride_scale_group, scale, mask=groups < GROUPS)


def quantize_groups(x: torch.Tensor, silu_and_mul: bool = False, for_torch: bool = False,
                    per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, width] in e4m3 with a float32 scale per row and group of GROUP columns ([rows, groups]), or per
    row (per_token: [rows, 1]): x = q * scale up to e4m3's rounding. With silu_and_mul, of silu(gate) * up for
    x = [gate | up] ([rows, 2 * width]). for_torch: as torch's block-scaled matmul takes them, rows padded with zeros
    to a multiple of 4 and the scales column-major (per-token scales are as its row-wise matmul takes them)."""
    x = x.contiguous()
    rows, width = x.size(0), x.size(1) // (2 if silu_and_mul else 1)
    group = triton.next_power_of_2(width) if per_token else GROUP
    groups = triton.cdiv(width, group)
    block_scaled = for_torch and not per_token
    padded_rows = -(-rows // 4) * 4 if block_scaled else rows
    q = torch.empty(padded_rows, width, dtype=FP8, device=x.device)
    if block_scaled:
        scale = torch.empty(groups, padded_rows, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    per_program = min(triton.next_power_of_2(groups), 8)
    quantize_groups_kernel[(padded_rows, triton.cdiv(groups, per_program))](
        x, q, scale, rows, scale.stride(0), scale.stride(1), WIDTH=width, GROUPS=groups,
        GROUPS_PER_PROGRAM=per_program, GROUP=group, SILU_AND_MUL=silu_and_mul, FP8_MAX=FP8_MAX,
        num_warps=min(16, max(4, group // 1024)))
    return q, scale


@triton.jit(do_not_specialize=["M"])
def fp8_matmul_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, partial_ptr, arrivals_ptr, M, N, K,
                      K_PER_SPLIT, stride_sn, stride_sk, stride_xs_row, stride_xs_group, BLOCK_SCALES: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * x_scale[m, k // 128] * w[n, k] * scale (+ bias[n]): x and w [N, K] in e4m3, summed
    # on FP8 tensor cores a step of BLOCK_K at a time, each step's sum scaled by its group's scales (a stride of 0
    # between groups: one scale a row); the weight's scale[n // 128, k // 128] (BLOCK_SCALES) there too, or scale[n]
    # (per row) once at the end. With SPLIT_K > 1, each of a tile's SPLIT_K programs sums K_PER_SPLIT columns into
    # float32 partials, and the last of them to arrive adds them up.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    plane = M.to(tl.int64) * N  # a split's partial sums
    in_rows, in_cols = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * K_PER_SPLIT, tl.minimum(K, (split + 1) * K_PER_SPLIT), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=in_rows[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=in_k[:, None] & in_cols[None, :],
                    other=0.0)
        x_scales = tl.load(x_scale_ptr + rows * stride_xs_row + (k0 // 128) * stride_xs_group, mask=in_rows,
                           other=0.0)
        step = tl.dot(x, w) * x_scales[:, None]
        if BLOCK_SCALES:
            step *= tl.load(scale_ptr + (cols // 128) * stride_sn + (k0 // 128) * stride_sk, mask=in_cols,
                            other=0.0)[None, :]
        acc += step
    in_tile = in_rows[:, None] & in_cols[None, :]
    if SPLIT_K > 1:
        tile_offsets = rows[:, None] * N + cols[None, :]
        tl.store(partial_ptr + split * plane + tile_offsets, acc, mask=in_tile)
        tl.debug_barrier()  # every thread's partials stored before the arrival, which releases them
        arrival = arrivals_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(arrival, 1, sem="acq_rel") == SPLIT_K - 1:  # the last to arrive adds the partials up
            tl.store(arrival, 0)  # zero again for the next call
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for other in tl.static_range(SPLIT_K):
                acc += tl.load(partial_ptr + other * plane + tile_offsets, mask=in_tile, other=0.0,
                               cache_modifier=".cg")
            store_tile(acc, y_ptr, scale_ptr, bias_ptr, rows, cols, in_tile, N, stride_sn, BLOCK_SCALES, HAS_BIAS)
    else:
        store_tile(acc, y_ptr, scale_ptr, bias_ptr, rows, cols, in_tile, N, stride_sn, BLOCK_SCALES, HAS_BIAS)


@triton.jit
def store_tile(acc, y_ptr, scale_ptr, bias_ptr, rows, cols, in_tile, N, stride_sn, BLOCK_SCALES: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    in_cols = cols < N
    if not BLOCK_SCALES:
        acc *= tl.load(scale_ptr + cols * stride_sn, mask=in_cols, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=in_tile)


def fp8_matmul(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
               tiles: Tiles | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] in e4m3 with its scales (`quantize_groups`, any layout) times an FP8 weight [N, K] with its
    scale, (+ bias), in out_dtype; `tiles` by choose_tiles and `split_k` by choose_split_k unless given."""
    (m, k), n = x.shape, weight.size(0)
    per_row = has_row_scales(weight, scale)
    tiles = tiles or choose_tiles(m, n, k, per_row)
    split_k = split_k or choose_split_k(m, n, k, tiles)
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split_k)
    k_per_split = triton.cdiv(triton.cdiv(k, tiles.block_k), split_k) * tiles.block_k
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else y  # else unused
    arrivals = arrival_counters("fp8_matmul", x.device, grid[0] * grid[1]) if split_k > 1 else y  # else unused
    fp8_matmul_kernel[grid](
        x, x_scale, weight, scale, bias if bias is not None else scale, y, partial, arrivals, m, n, k, k_per_split,
        scale.stride(0), 0 if per_row else scale.stride(1), *scale_strides(x_scale), BLOCK_SCALES=not per_row,
        HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SPLIT_K=split_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return y


def scale_strides(x_scale: torch.Tensor) -> tuple[int, int]:
    """The (row, group) strides of activation scales [rows, groups]: a row's one scale (per token) serves every
    group."""
    return x_scale.stride(0), x_scale.stride(1) if x_scale.size(1) > 1 else 0


# Above this many rows, torch's FP8 matmul (cuBLAS): block-scaled weights by 1x128 activation groups (at
# Qwen3-30B-A3B's q/k/v and o, 0.66x and 0.94x fp8_matmul's best time at 256 rows, 0.58x and 0.56x at 2,048, and
# slower at 64), row-scaled weights row-wise by a scale per token (benchmarks/fp8_kernels.py, docs/benchmarks.md).
TORCH_MATMUL_ROWS = 64
TORCH_ROWWISE_ROWS = 64


def takes_torch_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether torch's FP8 matmul serves this product: on Hopper (`hopper_scaled_mm`), above TORCH_MATMUL_ROWS
    rows with block scales of whole blocks, their columns (the reduction's groups) a multiple of 4 as cuBLAS asks;
    above TORCH_ROWWISE_ROWS with row scales but where `keeps_decode_tiles`, both sizes multiples of 16."""
    out_features, in_features = weight.shape
    if not (x.is_cuda and hopper_scaled_mm(x.device)):
        return False
    if has_row_scales(weight, scale):
        return (x.size(0) > TORCH_ROWWISE_ROWS and not keeps_decode_tiles(x.size(0), out_features, in_features)
                and out_features % 16 == 0 == in_features % 16)
    return x.size(0) > TORCH_MATMUL_ROWS and out_features % GROUP == 0 and in_features % (4 * GROUP) == 0


@functools.cache
def hopper_scaled_mm(device: torch.device) -> bool:
    """torch serves 1x128 by 128x128 scales on NVIDIA's sm_90 alone, with cuBLAS 12.9 or later."""
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return (hasattr(F, "scaled_mm") and torch.version.hip is None and cuda >= (12, 9)
            and torch.cuda.get_device_capability(device)[0] == 9)


def torch_matmul(quantized: tuple[torch.Tensor, torch.Tensor], rows: int, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`fp8_matmul` by torch's FP8 matmul, the first `rows`: block-scaled on activations quantized `for_torch`, or
    row-wise for row scales on activations quantized per token."""
    q, q_scale = quantized
    recipes = ((F.ScalingType.RowWise, F.ScalingType.RowWise) if has_row_scales(weight, scale)
               else (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128))
    y = F.scaled_mm(q, weight.t(), q_scale, recipes[0], scale.t(), recipes[1], output_dtype=out_dtype)[:rows]
    return y if bias is None else y + bias


def linear(x: torch.Tensor | FP8Rows, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """`linear.dequantized_linear` on CUDA: one row in the one-row kernel, more through `rows_matmul` (rows
    quantized already where x carries their e4m3 copy)."""
    x, quantized = split_rows(x)
    assert quantized is None or has_row_scales(weight, scale), "rows quantized per token meet per-channel weights"
    if takes_one_row(x, weight):
        return one_row_linear(x, weight, bias, scale=scale)
    return rows_matmul(x, weight, scale, bias, quantized=quantized)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` of silu(gate) * up for x = [gate | up]: one row in one kernel, more with the activation taken
    as they are quantized."""
    if takes_one_row(x, weight):
        return one_row_linear(x, weight, bias, silu_and_mul=True, scale=scale)
    return rows_matmul(x, weight, scale, bias, silu_and_mul=True)


def rows_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                silu_and_mul: bool = False, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """More than one row: quantized by `quantize_groups` (per token for row scales) unless `quantized` already,
    then torch's matmul (many rows, Hopper) or fp8_matmul."""
    per_token = has_row_scales(weight, scale)
    if takes_torch_matmul(x, weight, scale):
        quantized = quantized or quantize_groups(x, silu_and_mul, for_torch=True, per_token=per_token)
        return torch_matmul(quantized, x.size(0), weight, scale, bias, x.dtype)
    quantized = quantized or quantize_groups(x, silu_and_mul, per_token=per_token)
    return fp8_matmul(*quantized, weight, scale, bias, out_dtype=x.dtype)
