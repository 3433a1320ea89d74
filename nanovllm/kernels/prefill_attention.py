"""Causal varlen prompt attention in Triton: flash-attn's `varlen_fwd` for this engine's prompt chunks, so that
the CUDA path needs only torch and Triton.

Each program attends BLOCK_M query tokens of one sequence, for one query head, to that sequence's keys, tile
by tile with an online softmax (FlashAttention-2's forward). A chunk's queries are the last q_len of its k_len
positions: a query at row i sees the keys up to position k_len - q_len + i, so a prompt that continues a
cached prefix or an earlier chunk reads those keys too. Keys come from the step's own k and v (by token) or,
with a block table, from the paged caches, which hold the step's keys by then. Query heads that share a KV
head (GQA) read the same keys; head sizes that are not a power of two are padded to one.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def prefill_kernel(q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, out_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
                   block_tables_ptr, block_tables_stride, scale, q_token_stride, q_head_stride, k_token_stride,
                   k_head_stride, out_token_stride, out_head_stride, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_KV: tl.constexpr, PRECISION: tl.constexpr):
    q_block = tl.program_id(0)
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
    kv_head = head // GROUP
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, PADDED_DIM), tl.float32)
    last_key = tl.minimum(k_len, k_len - q_len + (q_block + 1) * BLOCK_M)  # the block's last query sees no further
    for first in tl.range(0, last_key, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        has_key = keys < k_len
        if PAGED:
            block = tl.load(block_tables_ptr + seq * block_tables_stride + keys // BLOCK_SIZE, mask=has_key, other=0)
            tokens = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        else:
            tokens = (k_start + keys).to(tl.int64)
        kv_offsets = tokens[:, None] * k_token_stride + kv_head * k_head_stride + dims[None, :]
        kv_mask = has_key[:, None] & has_dim[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if FP8_KV:  # a paged e4m3 cache: a scale per key and KV head (`utils/fp8_kv.py`)
            key_scale = tl.load(k_scales_ptr + tokens * NUM_KV_HEADS + kv_head, mask=has_key, other=0.0)[None, :]
            value_scale = tl.load(v_scales_ptr + tokens * NUM_KV_HEADS + kv_head, mask=has_key, other=0.0)[:, None]
            k, v = k.to(q.dtype), (v.to(tl.float32) * value_scale).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if FP8_KV:
            scores = scores * key_scale
        visible = has_key[None, :] & (keys[None, :] <= positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))  # finite: key 0 is visible to every row
        rescale = tl.exp(row_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
    out = acc / row_sum[:, None]
    out_offsets = (q_start + rows).to(tl.int64)[:, None] * out_token_stride + head * out_head_stride + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=has_row[:, None] & has_dim[None, :])


def tile_sizes(head_dim: int) -> tuple[int, int]:
    """Query rows and keys a tile: 64 x 64, smaller for the largest heads (the registers a program holds)."""
    return (64, 64) if head_dim <= 128 else (64, 32)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                      block_table: torch.Tensor | None = None, block_m: int | None = None,
                      block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                      out: torch.Tensor | None = None,
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """flash-attn's varlen_fwd, causal: q [num_tokens, num_heads, head_dim]; k and v by token ([num_keys,
    num_kv_heads, head_dim]) or, with a block table ([num_seqs, max_blocks]), the paged caches ([num_blocks,
    block_size, num_kv_heads, head_dim]; e4m3 with kv_scales, [num_blocks, block_size, num_kv_heads] float32 each);
    cu_seqlens_* [num_seqs + 1]. Returns [num_tokens, num_heads, head_dim], in `out` where given."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    paged = block_table is not None
    block_size = k.shape[1] if paged else 1
    if paged:
        k, v = (cache.view(-1, num_kv_heads, head_dim) for cache in (k, v))  # a row per cache slot
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.stride() == v.stride()
    default_m, default_n = tile_sizes(head_dim)
    block_m, block_n = block_m or default_m, block_n or default_n
    out = torch.empty_like(q) if out is None else out
    num_seqs = cu_seqlens_q.numel() - 1
    grid = (triton.cdiv(max_seqlen_q, block_m), num_heads, num_seqs)
    prefill_kernel[grid](
        q, k, v, *(kv_scales or (q, q)), out, cu_seqlens_q, cu_seqlens_k, block_table if paged else cu_seqlens_q,
        block_table.stride(0) if paged else 0, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        out.stride(0), out.stride(1), NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        PADDED_DIM=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n, PAGED=paged,
        BLOCK_SIZE=block_size, FP8_KV=paged and kv_scales is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    return out

