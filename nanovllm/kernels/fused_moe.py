"""The experts of a mixture-of-experts block on CUDA, in two grouped Triton matmuls (as vLLM's fused MoE):

0. `router_logits` and `route` (the block calls them first): each token's logits in float32 (one kernel for
   one token), its softmax over the experts, its top_k, renormalised;
1. `align`: the (token, slot) pairs grouped by expert, each expert's run padded to a multiple of BLOCK_M,
   so that every block of BLOCK_M pairs belongs to one expert (or is padding): one program up to
   ALIGN_BLOCK pairs, three small kernels above;
2. `gate_up_kernel`: per block and BLOCK_N intermediate columns, the pairs' tokens times the expert's gate
   and up rows, then silu(gate) * up, into a row per pair;
3. `down_kernel`: those rows times the expert's down projection, scaled by the pair's routing weight;
   a token's top_k rows are then summed.

Up to FEW_PAIRS pairs, `fused_moe_few`'s two kernels take 1-3 instead.

Every shape, the grids included, follows from the number of tokens alone (the worst case of padding), so a
decode graph captures the block whole: blocks past the padded pairs' count return at once.

Under Triton's interpreter in the CPU tests.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.fused_moe_few import FEW_PAIRS, few_token_experts
from nanovllm.kernels.one_row_linear import one_row_linear, takes_one_row


class Tiles(NamedTuple):
    """One launch configuration of both kernels: pairs per block, output columns per block, the reduction's
    step, and Triton's warps and pipeline stages."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# By pairs an expert gets on average, the fastest of benchmarks/moe_kernels.py's sweep at Qwen3-30B-A3B's layer
# (in CUDA graphs; docs/benchmarks.md): decode batches stream each expert's weights once in blocks of few pairs,
# long prompts reuse each weight tile across many pairs.
TILES_BY_PAIRS_PER_EXPERT = ((4, Tiles(16, 64, 128, 4, 3)), (128, Tiles(64, 64, 64, 4, 3)),
                             (None, Tiles(128, 128, 64, 8, 3)))


def choose_tiles(num_pairs: int, num_experts: int) -> Tiles:
    return next(tiles for most, tiles in TILES_BY_PAIRS_PER_EXPERT if most is None or num_pairs <= most * num_experts)


def router_logits(x: torch.Tensor, float_weight: torch.Tensor) -> torch.Tensor:
    """`moe.router_logits`; for one token in one kernel (x read in its dtype), not a cast and cuBLAS's two."""
    if takes_one_row(x, float_weight):
        return one_row_linear(x, float_weight, out_dtype=torch.float32)
    return F.linear(x.float(), float_weight)


@triton.jit
def route_kernel(logits_ptr, weights_ptr, expert_ids_ptr, NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr,
                 TOP_K: tl.constexpr, SLOTS: tl.constexpr, RENORMALISE: tl.constexpr):
    # One program a token: the softmax over its experts, the top TOP_K one at a time (the lowest id of a tie).
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS)
    logits = tl.load(logits_ptr + token * NUM_EXPERTS + experts, mask=experts < NUM_EXPERTS, other=float("-inf"))
    exps = tl.exp(logits.to(tl.float32) - tl.max(logits.to(tl.float32), axis=0))
    probabilities = exps / tl.sum(exps, axis=0)
    slots = tl.arange(0, SLOTS)
    chosen_weights = tl.zeros((SLOTS,), tl.float32)
    chosen_ids = tl.zeros((SLOTS,), tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probabilities, axis=0)
        expert = tl.min(tl.where(probabilities == best, experts, EXPERTS), axis=0)
        expert = tl.minimum(expert, NUM_EXPERTS - 1)  # NaN logits match no expert: still a real one's weights
        chosen_weights = tl.where(slots == slot, best, chosen_weights)
        chosen_ids = tl.where(slots == slot, expert, chosen_ids)
        probabilities = tl.where(experts == expert, -1.0, probabilities)
    if RENORMALISE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_weights, mask=slots < TOP_K)
    tl.store(expert_ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one kernel."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    expert_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    route_kernel[(num_tokens,)](router_logits.contiguous(), weights, expert_ids, NUM_EXPERTS=num_experts,
                                EXPERTS=triton.next_power_of_2(num_experts), TOP_K=top_k,
                                SLOTS=triton.next_power_of_2(top_k), RENORMALISE=renormalise, num_warps=1)
    return weights, expert_ids


ALIGN_BLOCK = 1024  # pairs a program of the counting and placing kernels takes; up to it, one program aligns


@triton.jit
def count_pairs(expert_ids_ptr, counts_ptr, pairs, real):
    """The pairs' experts, and each pair's rank among its expert's pairs (in the order the atomics land)."""
    experts = tl.load(expert_ids_ptr + pairs, mask=real, other=0)
    return experts, tl.atomic_add(counts_ptr + experts, 1, mask=real)


@triton.jit
def pad_runs(counts_ptr, ends_ptr, sorted_pairs_ptr, num_pairs, NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr,
             BLOCK_M: tl.constexpr):
    """Each expert's run padded to a multiple of BLOCK_M: the runs' ends, and the padding's slots."""
    experts = tl.arange(0, EXPERTS)
    is_expert = experts < NUM_EXPERTS
    counts = tl.load(counts_ptr + experts, mask=is_expert, other=0, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(ends_ptr + experts, ends, mask=is_expert)
    slots = (ends - padded + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_pairs_ptr + slots, tl.full((EXPERTS, BLOCK_M), num_pairs, tl.int64),
             mask=is_expert[:, None] & (slots < ends[:, None]))


@triton.jit
def place_pairs(counts_ptr, ends_ptr, sorted_pairs_ptr, pairs, real, experts, ranks, BLOCK_M: tl.constexpr):
    counts = tl.load(counts_ptr + experts, mask=real, other=0, cache_modifier=".cg")
    ends = tl.load(ends_ptr + experts, mask=real, other=0, cache_modifier=".cg")
    starts = ends - (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(sorted_pairs_ptr + starts + ranks, pairs.to(tl.int64), mask=real)


@triton.jit
def count_kernel(expert_ids_ptr, counts_ptr, ranks_ptr, num_pairs, BLOCK: tl.constexpr):
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = pairs < num_pairs
    _, ranks = count_pairs(expert_ids_ptr, counts_ptr, pairs, real)
    tl.store(ranks_ptr + pairs, ranks, mask=real)


@triton.jit
def pad_kernel(counts_ptr, ends_ptr, sorted_pairs_ptr, num_pairs, NUM_EXPERTS: tl.constexpr,
               EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr):
    pad_runs(counts_ptr, ends_ptr, sorted_pairs_ptr, num_pairs, NUM_EXPERTS, EXPERTS, BLOCK_M)


@triton.jit
def place_kernel(expert_ids_ptr, ranks_ptr, counts_ptr, ends_ptr, sorted_pairs_ptr, num_pairs, BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = pairs < num_pairs
    experts = tl.load(expert_ids_ptr + pairs, mask=real, other=0)
    ranks = tl.load(ranks_ptr + pairs, mask=real, other=0)
    place_pairs(counts_ptr, ends_ptr, sorted_pairs_ptr, pairs, real, experts, ranks, BLOCK_M)


@triton.jit
def align_kernel(expert_ids_ptr, counts_ptr, ends_ptr, sorted_pairs_ptr, num_pairs, NUM_EXPERTS: tl.constexpr,
                 EXPERTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    # The three kernels' work in one program, for up to BLOCK pairs (a decode step's): one launch, not three.
    pairs = tl.arange(0, BLOCK)
    real = pairs < num_pairs
    experts, ranks = count_pairs(expert_ids_ptr, counts_ptr, pairs, real)
    tl.debug_barrier()  # every count in before the runs are padded
    pad_runs(counts_ptr, ends_ptr, sorted_pairs_ptr, num_pairs, NUM_EXPERTS, EXPERTS, BLOCK_M)
    tl.debug_barrier()  # every end stored before a pair is placed
    place_pairs(counts_ptr, ends_ptr, sorted_pairs_ptr, pairs, real, experts, ranks, BLOCK_M)


def align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For expert_ids [tokens, top_k]: the pair indices (token * top_k + slot) grouped by expert (in no set
    order within an expert), each expert's run padded to a multiple of block_m with the index tokens * top_k;
    and the padded runs' ends [num_experts] (the last is the padded pairs' count). Two launches up to
    ALIGN_BLOCK pairs, four above, of sizes set by the number of tokens, and no host sync; past the last
    end, `sorted_pairs` holds nothing."""
    flat = expert_ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    max_padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int64, device=device)
    experts = dict(NUM_EXPERTS=num_experts, EXPERTS=triton.next_power_of_2(num_experts))
    if num_pairs <= ALIGN_BLOCK:
        align_kernel[(1,)](flat, counts, ends, sorted_pairs, num_pairs, **experts,
                           BLOCK=triton.next_power_of_2(num_pairs), BLOCK_M=block_m)
        return sorted_pairs, ends
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_pairs, ALIGN_BLOCK),)
    count_kernel[grid](flat, counts, ranks, num_pairs, BLOCK=ALIGN_BLOCK)
    pad_kernel[(1,)](counts, ends, sorted_pairs, num_pairs, **experts, BLOCK_M=block_m)
    place_kernel[grid](flat, ranks, counts, ends, sorted_pairs, num_pairs, BLOCK=ALIGN_BLOCK, BLOCK_M=block_m)
    return sorted_pairs, ends


@triton.jit
def block_pairs(sorted_pairs_ptr, ends_ptr, block, num_pairs, NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Whether the block lies past the padded pairs; its pair indices, which of them are pairs (not
    padding), and its expert: the number of runs that end at or before the block's start."""
    experts = tl.arange(0, EXPERTS)
    ends = tl.load(ends_ptr + experts, mask=experts < NUM_EXPERTS, other=2**30)
    first = block * BLOCK_M
    pairs = tl.load(sorted_pairs_ptr + first + tl.arange(0, BLOCK_M))
    past = first >= tl.max(tl.where(experts < NUM_EXPERTS, ends, 0), axis=0)
    return past, pairs, pairs < num_pairs, tl.sum((ends <= first).to(tl.int64), axis=0)


@triton.jit
def gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, ends_ptr, num_pairs, TOP_K: tl.constexpr,
                   HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                   EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    past, pairs, real, expert = block_pairs(sorted_pairs_ptr, ends_ptr, tl.program_id(0), num_pairs, NUM_EXPERTS,
                                            EXPERTS, BLOCK_M)
    if past:
        return
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
def down_kernel(h_ptr, w2_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, ends_ptr, num_pairs, HIDDEN: tl.constexpr,
                INTERMEDIATE: tl.constexpr, NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    past, pairs, real, expert = block_pairs(sorted_pairs_ptr, ends_ptr, tl.program_id(0), num_pairs, NUM_EXPERTS,
                                            EXPERTS, BLOCK_M)
    if past:
        return
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
    unless given; up to FEW_PAIRS (token, slot) pairs, `few_token_experts` unless tiles are given."""
    num_tokens, hidden = x.shape
    num_experts, intermediate = w2.size(0), w2.size(2)
    top_k = expert_ids.size(1)
    num_pairs = num_tokens * top_k
    if tiles is None and num_pairs <= FEW_PAIRS:
        return few_token_experts(x, w13, w2, weights, expert_ids)
    tiles = tiles or choose_tiles(num_pairs, num_experts)
    sorted_pairs, ends = align(expert_ids, num_experts, tiles.block_m)
    grid_m = sorted_pairs.numel() // tiles.block_m
    blocks = dict(NUM_EXPERTS=num_experts, EXPERTS=triton.next_power_of_2(num_experts), BLOCK_M=tiles.block_m,
                  BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    x = x.contiguous()
    h = x.new_empty(num_pairs, intermediate)
    gate_up_kernel[(grid_m, triton.cdiv(intermediate, tiles.block_n))](
        x, w13, h, sorted_pairs, ends, num_pairs, TOP_K=top_k, HIDDEN=hidden,
        INTERMEDIATE=intermediate, **blocks)
    per_pair = x.new_empty(num_pairs, hidden)  # each rounded, as transformers rounds an expert's weighted output
    down_kernel[(grid_m, triton.cdiv(hidden, tiles.block_n))](
        h, w2, weights.contiguous(), per_pair, sorted_pairs, ends, num_pairs, HIDDEN=hidden,
        INTERMEDIATE=intermediate, **blocks)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)
