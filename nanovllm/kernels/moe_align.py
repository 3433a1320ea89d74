"""Step 1 of `fused_moe`: the (token, slot) pairs grouped by expert, each expert's run padded to a multiple of
BLOCK_M (one program up to ALIGN_BLOCK pairs, three small kernels above), and `block_pairs`, which tells the
grouped kernels' programs their block's pairs and expert. Under Triton's interpreter in the CPU tests."""
import torch
import triton
import triton.language as tl

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


@triton.jit(do_not_specialize=["num_pairs"])
def count_kernel(expert_ids_ptr, counts_ptr, ranks_ptr, num_pairs, BLOCK: tl.constexpr):
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = pairs < num_pairs
    _, ranks = count_pairs(expert_ids_ptr, counts_ptr, pairs, real)
    tl.store(ranks_ptr + pairs, ranks, mask=real)


@triton.jit(do_not_specialize=["num_pairs"])
def pad_kernel(counts_ptr, ends_ptr, sorted_pairs_ptr, num_pairs, NUM_EXPERTS: tl.constexpr,
               EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr):
    pad_runs(counts_ptr, ends_ptr, sorted_pairs_ptr, num_pairs, NUM_EXPERTS, EXPERTS, BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs"])
def place_kernel(expert_ids_ptr, ranks_ptr, counts_ptr, ends_ptr, sorted_pairs_ptr, num_pairs, BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = pairs < num_pairs
    experts = tl.load(expert_ids_ptr + pairs, mask=real, other=0)
    ranks = tl.load(ranks_ptr + pairs, mask=real, other=0)
    place_pairs(counts_ptr, ends_ptr, sorted_pairs_ptr, pairs, real, experts, ranks, BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs"])
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
