"""Paged decode attention in Triton, one query token per sequence. It reads the KV cache faster than
flash-attn's split-KV kernel over bench.py's decode batches, and at one sequence it takes under half of
flash-attn's time with its combine (docs/benchmarks.md).

One kernel. Each program attends the query heads that share one KV head (a GQA group) of one
sequence to one split of its keys, tile by tile through the block table (only the tiles that hold
keys). A sequence whose keys fit in one split gets its output there. Otherwise each split writes its
unnormalised output with its softmax maximum and sum, and counts itself in on an arrival counter: the
last of the sequence's splits to arrive combines them, and zeroes the counter for the next call: a
separate combine kernel spent most of its time launching programs for sequences that had nothing to
combine.

Splits of equal length spread sequences of any length evenly over the GPU, and the eight KV heads of
a split are neighbouring programs, so the cache's rows (all heads of a key side by side) are read
while their neighbours are. Small batches take one tile a split: the shortest chain of loads. A
sequence has at most `KEYS_PER_ROUND` keys' worth of programs (8,192 keys); a longer one's
programs take every so many splits in turn. So the grid stops growing with the block table's width
and no step's cost depends on max_model_len: a CUDA graph captured once serves every context length,
and the split count is a run-time argument, so a new width compiles nothing.

The engine's decode steps give the sequences longest first (`seq_order`): a split's programs run one
tile after another, so a long sequence's programs started last would leave the GPU waiting on them at
the launch's end (bench.py's batches over an FP8 cache take 4% less time so, docs/benchmarks.md).
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.kernels.arrivals import arrival_counters
from nanovllm.kernels.fp8_kv_tile import fp8_kv_tile

KEYS_PER_ROUND = 8192  # keys the programs of one sequence attend to before they take their next splits
SMALL_BATCH = 16  # sequences up to which a split is one tile
SHORT_SPLIT_PAIRS = 384  # (sequence, KV head) pairs up to which a bf16 cache's splits are 512 keys (1,024 above)
FP8_SHORT_SPLIT_PAIRS = 512  # and an FP8 cache's (2,048 above)
TILE_BYTES = 65536  # a tile's keys at most (and its values): both, pipelined, within an SM's 227 KB of shared memory
MIN_GROUP_ROWS = 16  # the tensor cores' smallest M
MIN_GROUP_ROWS_FP8 = 8  # and N, where an FP8 cache's products put the group's rows (`softmax_step_fp8`)


@triton.jit(do_not_specialize=["num_splits"])
def split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr, block_tables_stride,
                 context_lens_ptr, seq_order_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, arrivals_ptr,
                 out_ptr, scale, num_splits, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT_KEYS: tl.constexpr, TILE_KEYS: tl.constexpr,
                 MAX_SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, FP8_KV: tl.constexpr, ORDERED: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl.wait_for_previous(USE_PDL)
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    if ORDERED:  # the sequences' programs start in seq_order's order: the longest first
        seq = tl.load(seq_order_ptr + tl.program_id(2)).to(tl.int64)
    else:
        seq = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, GROUP_ROWS)
    dims = tl.arange(0, HEAD_DIM)
    has_row = rows < GROUP
    head = seq * (NUM_KV_HEADS * GROUP) + kv_head * GROUP + rows  # [GROUP_ROWS], in [num_seqs * num_heads)
    context_len = tl.load(context_lens_ptr + seq)
    num_used = tl.cdiv(tl.maximum(context_len, 1), SPLIT_KEYS)  # a padded row's first split writes zeros
    if split >= num_used:  # past the keys
        return
    q = tl.load(q_ptr + head[:, None] * HEAD_DIM + dims[None, :], mask=has_row[:, None], other=0.0)
    if FP8_KV and not q.dtype.is_fp32():
        # e4m3 widens to float16 in one instruction, to bfloat16 in three; a query past float16's largest, 65,504,
        # would overflow: the FP8 cache assumes queries stay below it, as trained models' do
        q = q.to(tl.float16)
    split_max = tl.full((GROUP_ROWS,), float("-inf"), tl.float32)
    split_sum = tl.zeros((GROUP_ROWS,), tl.float32)
    if FP8_KV:  # transposed, as `softmax_step_fp8` takes it
        acc = tl.zeros((HEAD_DIM, GROUP_ROWS), tl.float32)
    else:
        acc = tl.zeros((GROUP_ROWS, HEAD_DIM), tl.float32)
    for taken in tl.range(split, num_used, num_splits):  # this program's splits: one per round of the grid
        acc, split_max, split_sum = attend_split(q, acc, split_max, split_sum, taken * SPLIT_KEYS, context_len, seq,
                                                 kv_head, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                                                 block_tables_ptr, block_tables_stride, scale, dims, NUM_KV_HEADS,
                                                 HEAD_DIM, BLOCK_SIZE, SPLIT_KEYS, TILE_KEYS, SPLIT_BLOCKS, FP8_KV)
    if FP8_KV:
        acc = tl.trans(acc)  # back to [rows, dims]
    out_offsets = head[:, None] * HEAD_DIM + dims[None, :]
    if context_len <= SPLIT_KEYS:  # the only split: the output itself, and nothing to combine
        out = acc / tl.maximum(split_sum, 1e-30)[:, None]  # a padded row (no keys) gives 0
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=has_row[:, None])
        return
    partial = head * num_splits + split
    tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc, mask=has_row[:, None])
    tl.store(partial_max_ptr + partial, split_max, mask=has_row)
    tl.store(partial_sum_ptr + partial, split_sum, mask=has_row)
    tl.debug_barrier()  # every thread's partials stored before the arrival, which releases them
    num_programs = tl.minimum(num_used, num_splits)
    arrival = arrivals_ptr + seq * NUM_KV_HEADS + kv_head
    if tl.atomic_add(arrival, 1, sem="acq_rel") == num_programs - 1:  # the last program to finish combines
        tl.store(arrival, 0)  # zero again for the next call
        out = combine(partial_out_ptr, partial_max_ptr, partial_sum_ptr, head, has_row, num_splits, num_programs,
                      HEAD_DIM, MAX_SPLITS)
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=has_row[:, None])


@triton.jit
def attend_split(q, acc, split_max, split_sum, first_key, context_len, seq, kv_head, k_cache_ptr, v_cache_ptr,
                 k_scales_ptr, v_scales_ptr, block_tables_ptr, block_tables_stride, scale, dims,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 SPLIT_KEYS: tl.constexpr, TILE_KEYS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, FP8_KV: tl.constexpr):
    """The online softmax of the GQA group's rows taken on over the split's keys, tile by tile (none past
    the sequence's keys). An FP8 cache's keys and values widen to q's dtype (float16 then) unscaled: the keys'
    scales scale their scores, the values' scales the probabilities that weigh them."""
    num_tiles = tl.cdiv(tl.minimum(context_len - first_key, SPLIT_KEYS), TILE_KEYS)
    table = block_tables_ptr + seq * block_tables_stride
    if SPLIT_BLOCKS > 0:  # the split's block ids, loaded before its tiles (see `split_blocks`)
        block_index = tl.arange(0, SPLIT_BLOCKS)
        first_block = first_key // BLOCK_SIZE
        blocks = tl.load(table + first_block + block_index, mask=(first_block + block_index) * BLOCK_SIZE < context_len,
                         other=0)
    for tile in tl.range(0, num_tiles):
        keys = first_key + tile * TILE_KEYS + tl.arange(0, TILE_KEYS)
        has_key = keys < context_len
        if SPLIT_BLOCKS > 0:  # the tile lies in one of the split's blocks
            tile_block = (first_key + tile * TILE_KEYS) // BLOCK_SIZE - first_block
            block = tl.sum(tl.where(block_index == tile_block, blocks, 0))
        else:
            block = tl.load(table + keys // BLOCK_SIZE, mask=has_key, other=0)
        if FP8_KV:
            k, v, key_scales, value_scales = fp8_kv_tile(k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
                                                         block, keys, has_key, kv_head, dims, NUM_KV_HEADS,
                                                         HEAD_DIM, BLOCK_SIZE)
            acc, split_max, split_sum = softmax_step_fp8(q, k.to(q.dtype), v.to(q.dtype), key_scales, value_scales,
                                                         has_key, acc, split_max, split_sum, scale)
        else:
            slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
            offsets = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
            k = tl.load(k_cache_ptr + offsets, mask=has_key[:, None], other=0.0)
            v = tl.load(v_cache_ptr + offsets, mask=has_key[:, None], other=0.0)  # in flight with k
            acc, split_max, split_sum = softmax_step(q, k, v, has_key, acc, split_max, split_sum, scale)
    return acc, split_max, split_sum


@triton.jit
def softmax_step(q, k, v, has_key, acc, split_max, split_sum, scale):
    """One tile of keys [TILE_KEYS, dims] and values taken into the online softmax of q's rows: acc [rows, dims]."""
    scores = tl.where(has_key[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
    new_max = tl.maximum(split_max, tl.max(scores, axis=1))  # finite: the first tile holds a key
    rescale = tl.exp(split_max - new_max)
    p = tl.exp(scores - new_max[:, None])
    split_sum = split_sum * rescale + tl.sum(p, axis=1)
    return acc * rescale[:, None] + tl.dot(p.to(v.dtype), v), new_max, split_sum


@triton.jit
def softmax_step_fp8(q, k, v, key_scales, value_scales, has_key, acc, split_max, split_sum, scale):
    """softmax_step over an FP8 cache's tile (widened, unscaled), its products transposed: scores^T = K q^T and
    acc^T [dims, rows] += V^T p^T, the tile's keys and dims on the tensor cores' M and the group's few rows on N (8
    at least, where M's are 16): half the HMMAs of rows on M where a group has 8 rows or fewer (a group of 16
    takes 255 registers against 160, untimed; a bf16 cache's loop, not bound by issuing instructions, ran slower
    transposed: docs/benchmarks.md). The keys' scales scale their scores, the values' scales weigh the
    probabilities, over the tile's largest so that they stay within [0, 1]."""
    scores = tl.where(has_key[:, None], tl.dot(k, tl.trans(q)) * scale * key_scales[:, None], float("-inf"))
    new_max = tl.maximum(split_max, tl.max(scores, axis=0))
    rescale = tl.exp(split_max - new_max)
    p = tl.exp(scores - new_max[None, :])
    split_sum = split_sum * rescale + tl.sum(p, axis=0)
    tile_scale = tl.max(value_scales)
    weighed = tl.dot(tl.trans(v), (p * (value_scales / tile_scale)[:, None]).to(v.dtype)) * tile_scale
    return acc * rescale[None, :] + weighed, new_max, split_sum


@triton.jit
def combine(partial_out_ptr, partial_max_ptr, partial_sum_ptr, head, has_row, num_splits, num_used,
            HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """The output of the GQA group's rows from the num_used splits' partials, read past the L1 cache
    (other programs wrote them)."""
    splits = tl.arange(0, MAX_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    used = has_row[:, None] & (splits[None, :] < num_used)
    partials = head[:, None] * num_splits + splits[None, :]
    maxima = tl.load(partial_max_ptr + partials, mask=used, other=float("-inf"), cache_modifier=".cg")
    top = tl.where(has_row, tl.max(maxima, axis=1), 0.0)
    sums = tl.load(partial_sum_ptr + partials, mask=used, other=0.0, cache_modifier=".cg")
    total = tl.sum(tl.exp(maxima - top[:, None]) * sums, axis=1)
    out = tl.zeros((head.shape[0], HEAD_DIM), tl.float32)
    for split in tl.range(0, num_used):
        partial = head * num_splits + split
        weight = tl.exp(tl.load(partial_max_ptr + partial, mask=has_row, other=0.0, cache_modifier=".cg") - top)
        acc = tl.load(partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], mask=has_row[:, None],
                      other=0.0, cache_modifier=".cg")
        out += weight[:, None] * acc
    return out / tl.where(has_row, total, 1.0)[:, None]


def split_and_tile_keys(num_seqs: int, num_kv_heads: int, fp8_kv: bool, key_bytes: int) -> tuple[int, int]:
    """Keys a program attends to, and keys a tile: one tile at small batches; else the fastest over bench.py's
    batches at Qwen3-0.6B's 8 KV heads and Qwen3-30B-A3B's 4, with either cache, the sequences longest first
    (docs/benchmarks.md): 512-key splits while the (sequence, KV head) pairs (of this rank) are few enough that
    shorter splits fill the GPU (SHORT_SPLIT_PAIRS, FP8_SHORT_SPLIT_PAIRS), then 1,024 keys over a bf16 cache and
    2,048 over an FP8 one (its tiles, half the bytes, take longer splits to pay their pipeline's start). Tiles of
    128 keys, or 64 where key_bytes (a key's head_dim in the cache's type) would take 128 past TILE_BYTES."""
    if num_seqs <= SMALL_BATCH:
        return 64, 64
    tile_keys = 128 if 128 * key_bytes <= TILE_BYTES else 64
    if num_seqs * num_kv_heads <= (FP8_SHORT_SPLIT_PAIRS if fp8_kv else SHORT_SPLIT_PAIRS):
        return 512, tile_keys
    return 2048 if fp8_kv else 1024, tile_keys


def split_blocks(split_keys: int, tile_keys: int, block_size: int) -> int:
    """How many block ids an FP8 cache's split reads, loaded once before its tiles (a power of two): then no load
    in the tile loop feeds the K/V loads' addresses, and Triton pipelines those num_stages - 1 tiles deep (a block
    id loaded in the loop holds them to one). 0 where a tile may straddle blocks: ids are then loaded by key."""
    if block_size % tile_keys:
        return 0
    if split_keys % block_size == 0:  # splits start on a block's first key
        return triton.next_power_of_2(split_keys // block_size)
    if block_size % split_keys == 0:
        return 1
    return triton.next_power_of_2(triton.cdiv(split_keys, block_size) + 1)  # one more where it starts inside one


def split_blocks_and_stages(split_keys: int, tile_keys: int, block_size: int, fp8_kv: bool) -> tuple[int, int]:
    """SPLIT_BLOCKS and the pipeline's stages: an FP8 tile is half a bf16 one's bytes, so two are in flight in
    the shared memory that holds one of bf16's (where its block ids are loaded before the loop). A bf16 cache's
    1,024-key splits take 3 stages, 1-4% faster than 2 at every batch bench.py's decode meets."""
    if not fp8_kv:
        return 0, 3 if split_keys >= 1024 and tile_keys == 128 else 2
    num_split_blocks = split_blocks(split_keys, tile_keys, block_size)
    return num_split_blocks, 3 if num_split_blocks and split_keys > tile_keys else 2


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, split_keys: int | None = None,
                     tile_keys: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     seq_order: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence. q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim], contiguous (an FP8 cache, with kv_scales: e4m3 laid out as `utils/fp8_kv.py` says);
    context_lens: [num_seqs] keys per sequence (0 for a padded row, which gives zeros); block_tables: [num_seqs,
    max_blocks], of any width; split_keys and tile_keys both or neither (then `split_and_tile_keys`'s);
    seq_order: [num_seqs] int32, a permutation of the rows in which their programs start (None: row order), the
    longest first where the engine gives it (`step_io.longest_first`). Returns [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert seq_order is None or (seq_order.shape == context_lens.shape and seq_order.dtype == torch.int32)
    fp8_kv = kv_scales is not None
    if split_keys is None:
        split_keys, tile_keys = split_and_tile_keys(num_seqs, num_kv_heads, fp8_kv, head_dim * k_cache.element_size())
    max_keys = block_tables.size(1) * block_size
    assert split_keys % tile_keys == 0 and split_keys <= KEYS_PER_ROUND
    num_split_blocks, default_stages = split_blocks_and_stages(split_keys, tile_keys, block_size, fp8_kv)
    max_split_programs = KEYS_PER_ROUND // split_keys
    num_splits = min(triton.cdiv(max_keys, split_keys), max_split_programs)
    partial_out = q.new_empty(num_seqs * num_heads * num_splits, head_dim, dtype=torch.float32)
    partial_max, partial_sum = (q.new_empty(num_seqs * num_heads * num_splits, dtype=torch.float32)
                                for _ in range(2))
    out = torch.empty_like(q)
    split_kernel[(num_kv_heads, num_splits, num_seqs)](
        q, k_cache, v_cache, *(kv_scales or (q, q)), block_tables, block_tables.stride(0), context_lens,
        context_lens if seq_order is None else seq_order, partial_out, partial_max, partial_sum,
        arrival_counters("decode_attention", q.device, num_seqs * num_kv_heads), out, scale, num_splits,
        NUM_KV_HEADS=num_kv_heads, GROUP=group,
        GROUP_ROWS=max(MIN_GROUP_ROWS_FP8 if fp8_kv else MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        SPLIT_KEYS=split_keys, TILE_KEYS=tile_keys, MAX_SPLITS=triton.next_power_of_2(max_split_programs),
        SPLIT_BLOCKS=num_split_blocks, FP8_KV=fp8_kv, ORDERED=seq_order is not None, num_warps=num_warps,
        num_stages=default_stages if num_stages is None else num_stages, **pdl.launch_options(q.device))
    return out
