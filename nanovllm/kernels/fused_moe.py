"""The experts of a mixture-of-experts block on CUDA, in two grouped Triton matmuls (as vLLM's fused MoE), once
`moe_route` has chosen each token's experts:

1. `moe_align.align`: the (token, slot) pairs grouped by expert, each expert's run padded to a multiple of BLOCK_M,
   so that every block of BLOCK_M pairs belongs to one expert (or is padding): one program up to
   ALIGN_BLOCK pairs, three small kernels above;
2. `gate_up_kernel`: per block and BLOCK_N intermediate columns, the pairs' tokens times the expert's gate
   and up rows, then silu(gate) * up, into a row per pair;
3. `down_kernel`: those rows times the expert's down projection, scaled by the pair's routing weight;
   a token's top_k rows are then summed (`topk_sum`).

Up to FEW_PAIRS pairs, `fused_moe_few`'s two kernels take 1-3 instead.

Every shape, the grids included, follows from the number of tokens alone (the worst case of padding), so a
decode graph captures the block whole: blocks past the padded pairs' count return at once.

Under Triton's interpreter in the CPU tests.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_linear import quantize_groups
from nanovllm.kernels.fused_moe_few import FEW_PAIRS, few_token_experts
from nanovllm.kernels.moe_align import align, block_pairs
from nanovllm.utils.fp8_weights import has_row_scales


class Tiles(NamedTuple):
    """One launch configuration of both kernels: pairs per block, output columns per block, the reduction's
    step, Triton's warps and pipeline stages, and whether the product is taken transposed (`swap_ab`: the
    weight's rows on the tensor cores' M, a block's pairs on N, so that a block of 16 or 32 pairs is not padded
    to an M of 64, nor are its sums)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False


# By pairs an expert gets on average, the fastest of benchmarks/moe_kernels.py's sweep at Qwen3-30B-A3B's layer
# (in CUDA graphs; docs/benchmarks.md): decode batches stream each expert's weights once in blocks of few pairs,
# long prompts reuse each weight tile across many pairs.
TILES_BY_PAIRS_PER_EXPERT = ((4, Tiles(16, 64, 128, 4, 3)), (128, Tiles(64, 64, 64, 4, 3)),
                             (None, Tiles(128, 128, 64, 8, 3)))
# FP8 experts (a tile of e4m3 holds half bf16's bytes) from benchmarks/fp8_kernels.py's sweeps at the same layer:
# transposed products at 64 and 256 tokens (4 and 16 pairs an expert; 0.96x and 0.93x the time of the untransposed
# tiles), 64x64x128 at 1,024 (0.75x the bf16 tiles' time; the best transposed tiles took 1.11x its time). A step of
# the sum (block_k) stays within one group of 128 columns, whose scales it applies.
FP8_TILES_BY_PAIRS_PER_EXPERT = ((4, Tiles(16, 64, 128, 4, 3, swap_ab=True)),
                                 (16, Tiles(32, 128, 128, 4, 3, swap_ab=True)),
                                 (128, Tiles(64, 64, 128, 4, 3)), (None, Tiles(128, 128, 64, 8, 3)))


def choose_tiles(num_pairs: int, num_experts: int, fp8: bool = False) -> Tiles:
    table = FP8_TILES_BY_PAIRS_PER_EXPERT if fp8 else TILES_BY_PAIRS_PER_EXPERT
    return next(tiles for most, tiles in table if most is None or num_pairs <= most * num_experts)


@triton.jit
def product(x, w, SWAP_AB: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] by w [BLOCK_K, BLOCK_N], on the tensor cores as it is or transposed (SWAP_AB)."""
    if SWAP_AB:
        return tl.trans(tl.dot(tl.trans(w), tl.trans(x)))
    return tl.dot(x, w)


@triton.jit
def scaled_step(x, w, x_scale_ptr, x_rows, in_x_rows, X_GROUPS, scale_ptr, rows, k0, in_rows, stride_sn, stride_sk,
                SCALES: tl.constexpr, SWAP_AB: tl.constexpr):
    """One step of the reduction, x [BLOCK_M, BLOCK_K] by w [BLOCK_K, BLOCK_N]: for FP8 (SCALES 1 or 2) both
    in e4m3 on FP8 tensor cores, times the activations' scales of x_rows at k0 and, per 128x128 block (SCALES 2),
    the weight's of `rows`; per-row weight scales (SCALES 1) come after the whole sum."""
    if SCALES == 0:
        step = product(x, w, SWAP_AB)
    else:
        step = product(x, w, SWAP_AB) * tl.load(x_scale_ptr + x_rows * X_GROUPS + k0 // 128, mask=in_x_rows,
                                                other=0.0)[:, None]
        if SCALES == 2:
            step *= tl.load(scale_ptr + (rows // 128) * stride_sn + (k0 // 128) * stride_sk, mask=in_rows,
                            other=0.0)[None, :]
    return step


@triton.jit
def row_scales(acc, scale_ptr, rows, in_rows, stride_sn, SCALES: tl.constexpr):
    """acc times the weight's per-row scales of `rows` (SCALES 1), as it is otherwise."""
    if SCALES == 1:
        acc *= tl.load(scale_ptr + rows * stride_sn, mask=in_rows, other=0.0)[None, :]
    return acc


@triton.jit(do_not_specialize=["num_pairs"])  # prompts vary it: no compile mid-run
def gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, ends_ptr, num_pairs, x_scale_ptr, X_GROUPS, scale_ptr,
                   stride_se, stride_sn, stride_sk, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                   INTERMEDIATE: tl.constexpr, NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr,
                   SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SWAP_AB: tl.constexpr):
    # SCALES: 0 for x and weights in the model's dtype; for FP8 weights with a scale per row (1) or per 128x128
    # block (2), x in e4m3 with its scales per token and 128 columns (`fp8_linear.quantize_groups`).
    past, pairs, real, expert = block_pairs(sorted_pairs_ptr, ends_ptr, tl.program_id(0), num_pairs, NUM_EXPERTS,
                                            EXPERTS, BLOCK_M)
    if past:
        return
    tokens = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < INTERMEDIATE
    gate_rows = w13_ptr + expert * (2 * INTERMEDIATE * HIDDEN) + cols[None, :] * HIDDEN
    up_rows = gate_rows + INTERMEDIATE * HIDDEN
    scales = scale_ptr + expert * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < HIDDEN
        x = tl.load(x_ptr + tokens[:, None] * HIDDEN + ks[None, :], mask=real[:, None] & in_k[None, :], other=0.0)
        w_mask = in_k[:, None] & in_cols[None, :]
        gate += scaled_step(x, tl.load(gate_rows + ks[:, None], mask=w_mask, other=0.0), x_scale_ptr, tokens, real,
                            X_GROUPS, scales, cols, k0, in_cols, stride_sn, stride_sk, SCALES, SWAP_AB)
        up += scaled_step(x, tl.load(up_rows + ks[:, None], mask=w_mask, other=0.0), x_scale_ptr, tokens, real,
                          X_GROUPS, scales, cols + INTERMEDIATE, k0, in_cols, stride_sn, stride_sk, SCALES, SWAP_AB)
    gate = row_scales(gate, scales, cols, in_cols, stride_sn, SCALES)
    up = row_scales(up, scales, cols + INTERMEDIATE, in_cols, stride_sn, SCALES)
    dtype = out_ptr.dtype.element_ty
    gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)  # rounded as the linear's output is
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + pairs[:, None] * INTERMEDIATE + cols[None, :], (silu * up).to(dtype),
             mask=real[:, None] & in_cols[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def down_kernel(h_ptr, w2_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, ends_ptr, num_pairs, h_scale_ptr, H_GROUPS,
                scale_ptr, stride_se, stride_sn, stride_sk, HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr,
                NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, SCALES: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr):
    # For FP8 (SCALES 1 or 2), h in e4m3 with its scales per pair and 128 columns.
    past, pairs, real, expert = block_pairs(sorted_pairs_ptr, ends_ptr, tl.program_id(0), num_pairs, NUM_EXPERTS,
                                            EXPERTS, BLOCK_M)
    if past:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < HIDDEN
    rows = w2_ptr + expert * (HIDDEN * INTERMEDIATE) + cols[None, :] * INTERMEDIATE
    scales = scale_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTERMEDIATE, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < INTERMEDIATE
        h = tl.load(h_ptr + pairs[:, None] * INTERMEDIATE + ks[None, :], mask=real[:, None] & in_k[None, :], other=0.0)
        acc += scaled_step(h, tl.load(rows + ks[:, None], mask=in_k[:, None] & in_cols[None, :], other=0.0),
                           h_scale_ptr, pairs, real, H_GROUPS, scales, cols, k0, in_cols, stride_sn, stride_sk, SCALES,
                           SWAP_AB)
    acc = row_scales(acc, scales, cols, in_cols, stride_sn, SCALES)
    dtype = out_ptr.dtype.element_ty
    acc = acc.to(dtype).to(tl.float32)  # the down projection's output, rounded
    weight = tl.load(weights_ptr + pairs, mask=real, other=0.0)
    tl.store(out_ptr + pairs[:, None] * HIDDEN + cols[None, :], (acc * weight[:, None]).to(dtype),
             mask=real[:, None] & in_cols[None, :])


@triton.jit
def topk_sum_kernel(per_pair_ptr, out_ptr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
    # A token's TOP_K rows summed in float32 and rounded once, as torch's sum over them rounds.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_cols = cols < HIDDEN
    total = tl.zeros((BLOCK,), tl.float32)
    for slot in tl.static_range(TOP_K):
        total += tl.load(per_pair_ptr + (token * TOP_K + slot) * HIDDEN + cols, mask=in_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + cols, total.to(out_ptr.dtype.element_ty), mask=in_cols)


def topk_sum(per_pair: torch.Tensor, top_k: int) -> torch.Tensor:
    """per_pair [tokens * top_k, hidden] summed over each token's top_k rows: [tokens, hidden]. One read of the rows
    (torch's reduction over the middle dimension of [tokens, top_k, hidden] read them at a third of the bandwidth)."""
    num_pairs, hidden = per_pair.shape
    assert per_pair.is_contiguous() and num_pairs % top_k == 0
    out = per_pair.new_empty(num_pairs // top_k, hidden)
    block = min(1024, triton.next_power_of_2(hidden))
    topk_sum_kernel[(num_pairs // top_k, triton.cdiv(hidden, block))](per_pair, out, TOP_K=top_k, HIDDEN=hidden,
                                                                       BLOCK=block)
    return out


def expert_scale_args(w: torch.Tensor, scale: torch.Tensor | None) -> dict:
    """The kernels' scale arguments for stacked expert weights [experts, N, K] and their scales, per row
    [experts, N, 1] or per 128x128 block; SCALES 0 for unquantized weights (scale None)."""
    if scale is None:
        return dict(scale_ptr=w, stride_se=0, stride_sn=0, stride_sk=0, SCALES=0)
    per_row = has_row_scales(w, scale)
    return dict(scale_ptr=scale, stride_se=scale.stride(0), stride_sn=scale.stride(1), stride_sk=scale.stride(2),
                SCALES=1 if per_row else 2)


def launch_blocks(tiles: Tiles, num_experts: int) -> dict:
    """A grouped kernel's tile and launch arguments."""
    return dict(NUM_EXPERTS=num_experts, EXPERTS=triton.next_power_of_2(num_experts), BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SWAP_AB=tiles.swap_ab, num_warps=tiles.num_warps,
                num_stages=tiles.num_stages)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor, tiles: Tiles | None = None, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, down_tiles: Tiles | None = None) -> torch.Tensor:
    """`moe.experts_loop`'s result for x [tokens, hidden], w13 [experts, 2 * intermediate, hidden],
    w2 [experts, hidden, intermediate] (FP8 with their scales, or in x's dtype), weights and expert_ids
    [tokens, top_k]; `tiles` by choose_tiles unless given, the down kernel's `down_tiles` where given (the same
    block_m: both walk the same aligned blocks of pairs); up to FEW_PAIRS (token, slot) pairs,
    `few_token_experts` unless tiles are given."""
    num_tokens, hidden = x.shape
    num_experts, intermediate = w2.size(0), w2.size(2)
    top_k = expert_ids.size(1)
    num_pairs = num_tokens * top_k
    if tiles is None and num_pairs <= FEW_PAIRS:
        return few_token_experts(x, w13, w2, weights, expert_ids, w13_scale=w13_scale, w2_scale=w2_scale)
    tiles = tiles or choose_tiles(num_pairs, num_experts, fp8=w13_scale is not None)
    down_tiles = down_tiles or tiles
    assert down_tiles.block_m == tiles.block_m
    assert w13_scale is None or 128 % tiles.block_k == 0 == 128 % down_tiles.block_k, "a step spans groups of scales"
    sorted_pairs, ends = align(expert_ids, num_experts, tiles.block_m)
    grid_m = sorted_pairs.numel() // tiles.block_m
    x = x.contiguous()
    x_in, x_scale = quantize_groups(x) if w13_scale is not None else (x, x)
    h = x.new_empty(num_pairs, intermediate)
    gate_up_kernel[(grid_m, triton.cdiv(intermediate, tiles.block_n))](
        x_in, w13, h, sorted_pairs, ends, num_pairs, x_scale, x_scale.size(1), **expert_scale_args(w13, w13_scale),
        TOP_K=top_k, HIDDEN=hidden, INTERMEDIATE=intermediate, **launch_blocks(tiles, num_experts))
    h_in, h_scale = quantize_groups(h) if w2_scale is not None else (h, h)
    per_pair = x.new_empty(num_pairs, hidden)  # each rounded, as transformers rounds an expert's weighted output
    down_kernel[(grid_m, triton.cdiv(hidden, down_tiles.block_n))](
        h_in, w2, weights.contiguous(), per_pair, sorted_pairs, ends, num_pairs, h_scale, h_scale.size(1),
        **expert_scale_args(w2, w2_scale), HIDDEN=hidden, INTERMEDIATE=intermediate,
        **launch_blocks(down_tiles, num_experts))
    return topk_sum(per_pair, top_k)
