"""Causal varlen prompt attention in Triton: flash-attn's `varlen_fwd` for this engine's prompt chunks, so that
the CUDA path needs only torch and Triton.

Each program attends BLOCK_M query tokens of one sequence, for one query head, to that sequence's keys, tile
by tile with an online softmax in base 2 (FlashAttention-2's forward). A chunk's queries are the last q_len of
its k_len positions: a query at row i sees the keys up to position k_len - q_len + i, so a prompt that continues
a cached prefix or an earlier chunk reads those keys too. The tiles every row of a block sees run without the
causal mask, the diagonal's with it; the blocks of last rows, which see the most keys, start first. Keys come
from the step's own k and v (by token) or, with a block table, from the paged caches, which hold the step's
keys by then. Query heads that share a KV head (GQA) read the same keys; head sizes that are not a power of two
are padded to one.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_kv_tile import fp8_kv_tile


@triton.jit(do_not_specialize=["block_tables_stride"])  # a step's table width: one compiled kernel serves every one
def prefill_kernel(q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, out_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
                   block_tables_ptr, block_tables_stride, scale, q_token_stride, q_head_stride, k_token_stride,
                   k_head_stride, out_token_stride, out_head_stride, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_KV: tl.constexpr, PRECISION: tl.constexpr):
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)  # the last rows, which see the most keys, start first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    positions = k_len - q_len + rows  # each query's position among the sequence's keys
    dims = tl.arange(0, PADDED_DIM)
    has_row, has_dim = rows < q_len, dims < HEAD_DIM
    q_offsets = (q_start + rows).to(tl.int64)[:, None] * q_token_stride + head * q_head_stride + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=has_row[:, None] & has_dim[None, :], other=0.0)
    if FP8_KV and not q.dtype.is_fp32():
        # e4m3 widens to float16 in one instruction, to bfloat16 in three; a query past float16's largest, 65,504,
        # would overflow: the FP8 cache assumes queries stay below it, as trained models' do
        q = q.to(tl.float16)
    kv_head = head // GROUP
    scale_log2 = scale * 1.4426950408889634  # softmax in base 2: exp2 is one instruction
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, PADDED_DIM), tl.float32)
    seen_by_all = (k_len - q_len + q_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N  # whole tiles the first row sees
    last_key = tl.minimum(k_len, k_len - q_len + (q_block + 1) * BLOCK_M)  # the block's last query sees no further
    for first in tl.range(0, seen_by_all, BLOCK_N):
        acc, row_max, row_sum = attend_tile(
            q, acc, row_max, row_sum, first, positions, dims, seq, k_start, k_len, kv_head, k_ptr, v_ptr,
            k_scales_ptr, v_scales_ptr, block_tables_ptr, block_tables_stride, scale_log2, k_token_stride,
            k_head_stride, NUM_KV_HEADS, HEAD_DIM, PADDED_DIM, BLOCK_N, PAGED, BLOCK_SIZE, FP8_KV, PRECISION, False)
    for first in tl.range(seen_by_all, last_key, BLOCK_N):  # the diagonal: tiles some rows see only in part
        acc, row_max, row_sum = attend_tile(
            q, acc, row_max, row_sum, first, positions, dims, seq, k_start, k_len, kv_head, k_ptr, v_ptr,
            k_scales_ptr, v_scales_ptr, block_tables_ptr, block_tables_stride, scale_log2, k_token_stride,
            k_head_stride, NUM_KV_HEADS, HEAD_DIM, PADDED_DIM, BLOCK_N, PAGED, BLOCK_SIZE, FP8_KV, PRECISION, True)
    out = acc / row_sum[:, None]
    out_offsets = (q_start + rows).to(tl.int64)[:, None] * out_token_stride + head * out_head_stride + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=has_row[:, None] & has_dim[None, :])


@triton.jit
def attend_tile(q, acc, row_max, row_sum, first, positions, dims, seq, k_start, k_len, kv_head, k_ptr, v_ptr,
                k_scales_ptr, v_scales_ptr, block_tables_ptr, block_tables_stride, scale_log2, k_token_stride,
                k_head_stride, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_KV: tl.constexpr,
                PRECISION: tl.constexpr, CAUSAL_MASK: tl.constexpr):
    """The online softmax of the block's rows taken on over the keys [first, first + BLOCK_N); without
    CAUSAL_MASK every row sees them all."""
    keys = first + tl.arange(0, BLOCK_N)
    has_key = keys < k_len
    table = block_tables_ptr + seq * block_tables_stride
    if PAGED and BLOCK_SIZE % BLOCK_N == 0:  # the tile lies in one cache block
        block = tl.load(table + first // BLOCK_SIZE)
    elif PAGED:
        block = tl.load(table + keys // BLOCK_SIZE, mask=has_key, other=0)
    if FP8_KV:  # a paged e4m3 cache (`utils/fp8_kv.py`): widened unscaled
        k, v, key_scales, value_scales = fp8_kv_tile(k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, block, keys, has_key,
                                                     kv_head, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        k, v = k.to(q.dtype), v.to(q.dtype)
    else:
        if PAGED:
            tokens = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        else:
            tokens = (k_start + keys).to(tl.int64)
        kv_offsets = tokens[:, None] * k_token_stride + kv_head * k_head_stride + dims[None, :]
        if CAUSAL_MASK or PADDED_DIM != HEAD_DIM:
            kv_mask = has_key[:, None] & (dims < HEAD_DIM)[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptr + kv_offsets)
            v = tl.load(v_ptr + kv_offsets)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if FP8_KV:  # keys' scales scale the scores
        scores = scores * key_scales[None, :]
    if CAUSAL_MASK:
        scores = tl.where(has_key[None, :] & (keys[None, :] <= positions[:, None]), scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))  # finite: each row sees the first key of its first tile
    rescale = tl.math.exp2(row_max - new_max)
    p = tl.math.exp2(scores - new_max[:, None])
    row_sum = row_sum * rescale + tl.sum(p, axis=1)
    if FP8_KV:  # values' scales weigh the probabilities, over the tile's largest so they stay within [0, 1]
        tile_scale = tl.max(value_scales)
        weighed = tl.dot((p * (value_scales / tile_scale)[None, :]).to(v.dtype), v, input_precision=PRECISION)
        acc = acc * rescale[:, None] + weighed * tile_scale
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None], input_precision=PRECISION)
    return acc, new_max, row_sum


# Query rows and keys a tile, warps and pipeline stages a program, by case: the fastest on the H200 at 128-wide heads
# in bf16 (`python -m benchmarks.prompt_attention --sweep`, docs/benchmarks.md), and over an FP8 cache in blocks of
# 256 (`--fp8-kv`: its tiles are widened in registers); smaller tiles where a program's registers and shared memory
# would not hold them (the largest heads, float32).
PAGED_TILES, LONG_TILES, SHORT_TILES, SMALL_TILES = (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)
FP8_PAGED_TILES = (64, 64, 4, 3)
SHORT_PROMPT = 2048  # query tokens a sequence, up to which the short prompts' tiles are the faster


def tile_config(head_dim: int, dtype: torch.dtype, paged: bool, max_seqlen_q: int,
                fp8_kv: bool = False) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for heads of head_dim in dtype, keys through a block table (of
    an FP8 cache: fp8_kv) or not, and the longest chunk of queries."""
    if head_dim > 128 or dtype == torch.float32:
        return SMALL_TILES
    if paged:
        return FP8_PAGED_TILES if fp8_kv else PAGED_TILES
    return SHORT_TILES if max_seqlen_q <= SHORT_PROMPT else LONG_TILES


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                      block_table: torch.Tensor | None = None, block_m: int | None = None,
                      block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                      out: torch.Tensor | None = None,
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """flash-attn's varlen_fwd, causal: q [num_tokens, num_heads, head_dim]; k and v by token ([num_keys,
    num_kv_heads, head_dim]) or, with a block table ([num_seqs, max_blocks]), the paged caches ([num_blocks,
    block_size, num_kv_heads, head_dim]; an FP8 cache, with kv_scales: e4m3 laid out as `utils/fp8_kv.py` says);
    cu_seqlens_* [num_seqs + 1]; tiles, warps and stages `tile_config`'s unless given. Returns [num_tokens,
    num_heads, head_dim], in `out` where given."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    paged = block_table is not None
    block_size = k.shape[1] if paged else 1
    fp8_kv = paged and kv_scales is not None  # contiguous, laid out as `utils/fp8_kv.py` says
    if paged and not fp8_kv:
        k, v = (cache.view(-1, num_kv_heads, head_dim) for cache in (k, v))  # a row per cache slot
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and (fp8_kv or k.stride() == v.stride())
    assert not fp8_kv or (k.is_contiguous() and v.is_contiguous())
    default_m, default_n, default_warps, default_stages = tile_config(head_dim, q.dtype, paged, max_seqlen_q, fp8_kv)
    block_m, block_n = block_m or default_m, block_n or default_n
    num_warps, num_stages = num_warps or default_warps, num_stages or default_stages
    out = torch.empty_like(q) if out is None else out
    num_seqs = cu_seqlens_q.numel() - 1
    grid = (triton.cdiv(max_seqlen_q, block_m), num_heads, num_seqs)
    prefill_kernel[grid](
        q, k, v, *(kv_scales or (q, q)), out, cu_seqlens_q, cu_seqlens_k, block_table if paged else cu_seqlens_q,
        block_table.stride(0) if paged else 0, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        out.stride(0), out.stride(1), NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        PADDED_DIM=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n, PAGED=paged,
        BLOCK_SIZE=block_size, FP8_KV=fp8_kv,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    return out

