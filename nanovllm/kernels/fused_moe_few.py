"""The experts of a mixture-of-experts block for a few tokens (a decode step of a few sequences) in two
Triton kernels, without `moe_align.align`'s grouping: at one token each of its top_k experts is read once
anyway, and the grouping, its zeroed counts and the sum over a token's experts (a kernel each) were a fifth
of the experts' time in a one-sequence decode step of Qwen3-30B-A3B (docs/benchmarks.md).

1. `few_gate_up_kernel`: per (token, slot) pair and BLOCK_N intermediate columns, the token's row times its
   expert's gate and up rows, then silu(gate) * up, into a row per pair;
2. `few_down_kernel`: per token and BLOCK_N output columns, each of its pairs' rows times the expert's down
   projection, scaled by the pair's routing weight, summed over the pairs. The pairs are loaded side by side,
   not one after another: the program's loads of every expert's rows are in flight at once.

In bf16 both round where `fused_moe`'s kernels round, so the two paths' sums differ only by a float32 sum's
order. FP8 experts are read as they are (W8A16: the activations stay unrounded, where the grouped kernels round
them to e4m3) in tiles of their own, `FP8_TILES`: a row of e4m3 holds half the bytes. Under Triton's interpreter
in the CPU tests.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.kernels.one_row_linear import blocks_for, row_sums, scale_args
from nanovllm.utils.fp8_weights import has_row_scales

FEW_PAIRS = 32  # (token, slot) pairs up to which the experts take this path: 4 tokens of Qwen3-MoE's top 8


@triton.jit
def few_gate_up_kernel(x_ptr, w13_ptr, expert_ids_ptr, h_ptr, scale_ptr, stride_se, stride_sn, stride_sk,
                       SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                       INTERMEDIATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
    # FP8 weights (GROUP_K > 0) are summed a group of columns at a time, each group times its scale (row_sums).
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < INTERMEDIATE
    pdl.wait_for_previous(USE_PDL)  # the expert comes from the routing kernel
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K) * HIDDEN
    gate_rows = w13_ptr + expert * (2 * INTERMEDIATE * HIDDEN) + cols[:, None] * HIDDEN
    up_rows = gate_rows + INTERMEDIATE * HIDDEN
    scales = scale_ptr + expert * stride_se
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < HIDDEN
        x = tl.load(x_row + ks, mask=in_k, other=0.0).to(tl.float32)[None, :]
        w_mask = in_cols[:, None] & in_k[None, :]
        gate += row_sums(tl.load(gate_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32) * x, scales, cols,
                         k0, 2 * INTERMEDIATE, HIDDEN, stride_sn, stride_sk, SCALE_ROWS, GROUP_K, BLOCK_N, BLOCK_K)
        up += row_sums(tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32) * x, scales,
                       cols + INTERMEDIATE, k0, 2 * INTERMEDIATE, HIDDEN, stride_sn, stride_sk, SCALE_ROWS, GROUP_K,
                       BLOCK_N, BLOCK_K)
    dtype = h_ptr.dtype.element_ty
    gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)  # rounded as the linear's output is
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(h_ptr + pair * INTERMEDIATE + cols, (silu * up).to(dtype), mask=in_cols)


@triton.jit
def few_down_kernel(h_ptr, w2_ptr, weights_ptr, expert_ids_ptr, out_ptr, scale_ptr, stride_se, stride_sn, stride_sk,
                    SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                    HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    USE_PDL: tl.constexpr):
    # The token's slots side by side ([BLOCK_N, SLOTS, BLOCK_K] tiles, SLOTS the power of two at or above TOP_K),
    # so that every expert's rows are loaded at once; FP8 weights (GROUP_K > 0) by groups of columns, as row_sums.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slots = tl.arange(0, SLOTS)
    in_cols, in_slots = cols < HIDDEN, slots < TOP_K
    pairs = token * TOP_K + slots
    pdl.wait_for_previous(USE_PDL)
    experts = tl.load(expert_ids_ptr + pairs, mask=in_slots, other=0).to(tl.int64)
    rows = w2_ptr + experts[None, :, None] * (HIDDEN * INTERMEDIATE) + cols[:, None, None] * INTERMEDIATE
    row_mask = in_cols[:, None, None] & in_slots[None, :, None]
    acc = tl.zeros((BLOCK_N, SLOTS), dtype=tl.float32)
    for k0 in range(0, INTERMEDIATE, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < INTERMEDIATE
        h = tl.load(h_ptr + pairs[:, None] * INTERMEDIATE + ks[None, :], mask=in_slots[:, None] & in_k[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(rows + ks[None, None, :], mask=row_mask & in_k[None, None, :], other=0.0).to(tl.float32)
        products = w * h[None, :, :]
        if GROUP_K == 0:
            acc += tl.sum(products, axis=2)
        else:
            groups = k0 + tl.arange(0, BLOCK_K // GROUP_K) * GROUP_K
            scales = tl.load(scale_ptr + experts[None, :, None] * stride_se + (cols // SCALE_ROWS)[:, None, None] *
                             stride_sn + (groups // GROUP_K)[None, None, :] * stride_sk,
                             mask=row_mask & (groups < INTERMEDIATE)[None, None, :], other=0.0)
            group_sums = tl.sum(tl.reshape(products, (BLOCK_N, SLOTS, BLOCK_K // GROUP_K, GROUP_K)), axis=3)
            acc += tl.sum(group_sums * scales, axis=2)
    weights = tl.load(weights_ptr + pairs, mask=in_slots, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # Each pair's projection rounded, then its weighted share (as fused_moe's per-pair rows are)
    terms = (acc.to(h_ptr.dtype.element_ty).to(tl.float32) * weights[None, :]).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + cols, tl.sum(terms, axis=1).to(dtype), mask=in_cols)


class FewTiles(NamedTuple):
    """Output columns a program computes, and its warps, in each kernel; down's step of the sum in bytes of a row.
    The engine's are the fastest, or within 4.1%, of `benchmarks/moe_kernels.py`'s settings at 1-4 tokens of
    Qwen3-30B-A3B's layer with the weights read from memory (docs/benchmarks.md)."""
    gate_up_rows: int
    gate_up_warps: int
    down_rows: int = 2
    down_warps: int = 8
    down_step_bytes: int = 256


BF16_TILES = FewTiles(gate_up_rows=2, gate_up_warps=8)
FP8_TILES = FewTiles(gate_up_rows=8, gate_up_warps=8)


def few_token_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      expert_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                      w2_scale: torch.Tensor | None = None, tiles: FewTiles | None = None) -> torch.Tensor:
    """`fused_moe.fused_experts` for few tokens (up to FEW_PAIRS pairs): the same arguments and result; `tiles`
    (BF16_TILES, or FP8_TILES where scales are given) are for benchmarks."""
    num_tokens, hidden = x.shape
    intermediate, top_k = w2.size(2), expert_ids.size(1)
    tiles = tiles or (BF16_TILES if w13_scale is None else FP8_TILES)
    x, weights, expert_ids = x.contiguous(), weights.contiguous(), expert_ids.contiguous()
    options = pdl.launch_options(x.device)
    h = x.new_empty(num_tokens * top_k, intermediate)
    block_k, _ = blocks_for(hidden)  # the warps are the tiles'
    few_gate_up_kernel[(num_tokens * top_k, triton.cdiv(intermediate, tiles.gate_up_rows))](
        x, w13, expert_ids, h, **expert_scales(w13, w13_scale, block_k), TOP_K=top_k, HIDDEN=hidden,
        INTERMEDIATE=intermediate, BLOCK_N=tiles.gate_up_rows, BLOCK_K=block_k, num_warps=tiles.gate_up_warps,
        **options)
    out = torch.empty_like(x)
    block_k = min(tiles.down_step_bytes // w2.element_size(), triton.next_power_of_2(intermediate))
    assert (w2_scale is None or has_row_scales(w2, w2_scale) or block_k % 128 == 0
            or block_k >= intermediate), "a step of the down sum spans whole 128-column groups of block scales"
    few_down_kernel[(num_tokens, triton.cdiv(hidden, tiles.down_rows))](
        h, w2, weights, expert_ids, out, **expert_scales(w2, w2_scale, block_k), TOP_K=top_k,
        SLOTS=triton.next_power_of_2(top_k), HIDDEN=hidden, INTERMEDIATE=intermediate, BLOCK_N=tiles.down_rows,
        BLOCK_K=block_k, num_warps=tiles.down_warps, **options)
    return out


def expert_scales(w: torch.Tensor, scale: torch.Tensor | None, block_k: int) -> dict:
    """`one_row_linear.scale_args` for stacked expert weights [experts, N, K], with the stride between experts."""
    return dict(**scale_args(w, scale, block_k), stride_se=0 if scale is None else scale.stride(0))
