"""The experts of a mixture-of-experts block on CUDA, in two grouped Triton matmuls (as vLLM's fused MoE):

1. `align`: the (token, slot) pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M,
   so that every block of BLOCK_M pairs belongs to one expert (or is padding);
2. `gate_up_kernel`: per block and BLOCK_N intermediate columns, the pairs' tokens times the expert's gate
   and up rows, then silu(gate) * up, into a row per pair;
3. `down_kernel`: those rows times the expert's down projection, scaled by the pair's routing weight;
   a token's top_k rows are then summed.

Every shape, the grids included, follows from the number of tokens alone (the worst case of padding), so a
decode graph captures the block whole: blocks past the padded pairs' count return at once.

Imported only on CUDA (`kernel_choice`), and under Triton's interpreter in the CPU tests.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Tiles(NamedTuple):
    """One launch configuration of both kernels: pairs per block, output columns per block, the reduction's
    step, and Triton's warps and pipeline stages."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


SMALL_TILES = Tiles(16, 64, 64)


def choose_tiles(num_pairs: int, num_experts: int) -> Tiles:
    """Tiles by the pairs an expert gets on average: decode batches stream each expert's weights once in
    blocks of few pairs; long prompts reuse each weight tile across many pairs."""
    del num_pairs, num_experts
    return SMALL_TILES


def align(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """For expert_ids [tokens, top_k]: the pair indices (token * top_k + slot) sorted by expert, each
    expert's run padded to a multiple of block_m with the index tokens * top_k; each block's expert; and the
    padded pairs' count [1]. All of fixed size for the number of tokens, and made without a host sync."""
    flat = expert_ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    max_padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, dim=0)
    sorted_experts, order = torch.sort(flat, stable=True)
    rank_in_expert = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, dim=0) - counts)[sorted_experts]
    destination = (padded_ends - padded)[sorted_experts] + rank_in_expert
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, destination, order)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts, padded_ends[-1:]


@triton.jit
def block_pairs(sorted_pairs_ptr, block_experts_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    """A block's pair indices, which of them are pairs (not padding), and the block's expert."""
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs, tl.load(block_experts_ptr + block).to(tl.int64)


@triton.jit
def gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr, num_pairs,
                   TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, real, expert = block_pairs(sorted_pairs_ptr, block_experts_ptr, block, num_pairs, BLOCK_M)
    tokens = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < INTERMEDIATE
    gate_rows = w13_ptr + expert * (2 * INTERMEDIATE * HIDDEN) + cols[None, :] * HIDDEN
    up_rows = gate_rows + INTERMEDIATE * HIDDEN
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < HIDDEN
        x = tl.load(x_ptr + tokens[:, None] * HIDDEN + ks[None, :], mask=real[:, None] & in_k[None, :], other=0.0)
        w_mask = in_k[:, None] & in_cols[None, :]
        gate += tl.dot(x, tl.load(gate_rows + ks[:, None], mask=w_mask, other=0.0))
        up += tl.dot(x, tl.load(up_rows + ks[:, None], mask=w_mask, other=0.0))
    dtype = out_ptr.dtype.element_ty
    gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)  # rounded as the linear's output is
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + pairs[:, None] * INTERMEDIATE + cols[None, :], (silu * up).to(dtype),
             mask=real[:, None] & in_cols[None, :])


@triton.jit
def down_kernel(h_ptr, w2_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr, num_pairs,
                HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, real, expert = block_pairs(sorted_pairs_ptr, block_experts_ptr, block, num_pairs, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < HIDDEN
    rows = w2_ptr + expert * (HIDDEN * INTERMEDIATE) + cols[None, :] * INTERMEDIATE
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTERMEDIATE, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < INTERMEDIATE
        h = tl.load(h_ptr + pairs[:, None] * INTERMEDIATE + ks[None, :], mask=real[:, None] & in_k[None, :], other=0.0)
        acc += tl.dot(h, tl.load(rows + ks[:, None], mask=in_k[:, None] & in_cols[None, :], other=0.0))
    dtype = out_ptr.dtype.element_ty
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)  # the down projection's output, rounded
    weight = tl.load(weights_ptr + pairs, mask=real, other=0.0)
    tl.store(out_ptr + pairs[:, None] * HIDDEN + cols[None, :], (acc * weight[:, None]).to(dtype),
             mask=real[:, None] & in_cols[None, :])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """`moe.experts_loop`'s result for x [tokens, hidden], w13 [experts, 2 * intermediate, hidden],
    w2 [experts, hidden, intermediate], weights and expert_ids [tokens, top_k]; `tiles` by choose_tiles
    unless given."""
    num_tokens, hidden = x.shape
    num_experts, intermediate = w2.size(0), w2.size(2)
    top_k = expert_ids.size(1)
    num_pairs = num_tokens * top_k
    tiles = tiles or choose_tiles(num_pairs, num_experts)
    sorted_pairs, block_experts, num_padded = align(expert_ids, num_experts, tiles.block_m)
    grid_m = sorted_pairs.numel() // tiles.block_m
    blocks = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages)
    x = x.contiguous()
    h = x.new_empty(num_pairs, intermediate)
    gate_up_kernel[(grid_m, triton.cdiv(intermediate, tiles.block_n))](
        x, w13, h, sorted_pairs, block_experts, num_padded, num_pairs, TOP_K=top_k, HIDDEN=hidden,
        INTERMEDIATE=intermediate, **blocks)
    per_pair = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    down_kernel[(grid_m, triton.cdiv(hidden, tiles.block_n))](
        h, w2, weights.contiguous(), per_pair, sorted_pairs, block_experts, num_padded, num_pairs, HIDDEN=hidden,
        INTERMEDIATE=intermediate, **blocks)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
