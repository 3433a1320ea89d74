"""One Triton kernel from a layer's fused q/k/v projection to attention's inputs: per-head RMSNorm of
the query and key heads, their rotary embedding, and the K/V store into the paged cache: the steps
`models/decoder.DecoderAttention` spells out in PyTorch, which are seven kernels a layer and, at one decoding
sequence, cost more than the attention itself.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.kernels.fp8_kv_tile import value_offsets
from nanovllm.utils.fp8_kv import FP8_KV_MAX, MIN_SCALE


# Positions and slots are views of a step's upload buffer or of the decode graphs' inputs: no alignment is
# assumed of them, so that no new layout of those buffers compiles another variant mid-run.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def prepare_qkv_kernel(qkv_ptr, qkv_stride, positions_ptr, q_weight_ptr, k_weight_ptr, eps, cos_sin_ptr,
                       q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scales_ptr, v_scales_ptr,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       QK_ROWS: tl.constexpr, V_ROWS: tl.constexpr, KEEP_KV: tl.constexpr, STORE: tl.constexpr,
                       QK_NORM: tl.constexpr, FP8_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr,
                       MIN_SCALE: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per token. Its query and key heads are rows of two halves, the pairs that rotary mixes.
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    KV_SIZE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    head = tl.arange(0, QK_ROWS)[:, None]
    dim = tl.arange(0, HALF)[None, :]
    is_q = head < NUM_HEADS
    is_k = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV_HEADS)
    if QK_NORM:  # weights: loaded before waiting for the kernel that writes qkv
        w1 = tl.where(is_q, tl.load(q_weight_ptr + dim), tl.load(k_weight_ptr + dim)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + dim), tl.load(k_weight_ptr + HALF + dim)).to(tl.float32)
    pdl.wait_for_previous(USE_PDL)
    row = qkv_ptr + token * qkv_stride
    x1 = tl.load(row + head * HEAD_DIM + dim, mask=is_q | is_k, other=0.0).to(tl.float32)
    x2 = tl.load(row + head * HEAD_DIM + HALF + dim, mask=is_q | is_k, other=0.0).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    if QK_NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1))[:, None] / HEAD_DIM + eps)
        # Rounded where the PyTorch layers round: the normalised value, then its product with the weight.
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + position * HEAD_DIM + dim)
    sin = tl.load(cos_sin_ptr + position * HEAD_DIM + HALF + dim)
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    q_row = q_ptr + token * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM
    tl.store(q_row + dim, y1, mask=is_q)
    tl.store(q_row + HALF + dim, y2, mask=is_q)
    k_head = (head - NUM_HEADS) * HEAD_DIM  # masked off on query rows
    v_head = tl.arange(0, V_ROWS)[:, None]
    v_dim = tl.arange(0, HEAD_DIM)[None, :]
    has_v = v_head < NUM_KV_HEADS
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + v_head * HEAD_DIM + v_dim, mask=has_v)
    if KEEP_KV:
        tl.store(k_ptr + token * KV_SIZE + k_head + dim, y1, mask=is_k)
        tl.store(k_ptr + token * KV_SIZE + k_head + HALF + dim, y2, mask=is_k)
        tl.store(v_ptr + token * KV_SIZE + v_head * HEAD_DIM + v_dim, v, mask=has_v)
    if STORE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            if FP8_KV:  # each head over its scale, its largest magnitude over 448, laid out as `utils/fp8_kv.py` says
                k_scale = tl.maximum(tl.maximum(tl.max(tl.abs(y1.to(tl.float32)), axis=1),
                                                tl.max(tl.abs(y2.to(tl.float32)), axis=1)) / FP8_MAX, MIN_SCALE)
                v_scale = tl.maximum(tl.max(tl.abs(v.to(tl.float32)), axis=1) / FP8_MAX, MIN_SCALE)
                block, within = slot // BLOCK_SIZE, slot % BLOCK_SIZE
                k_rows = tl.arange(0, QK_ROWS) - NUM_HEADS
                v_rows = tl.arange(0, V_ROWS)
                tl.store(k_scales_ptr + (block * NUM_KV_HEADS + k_rows) * BLOCK_SIZE + within, k_scale,
                         mask=(k_rows >= 0) & (k_rows < NUM_KV_HEADS))
                tl.store(v_scales_ptr + (block * NUM_KV_HEADS + v_rows) * BLOCK_SIZE + within, v_scale,
                         mask=v_rows < NUM_KV_HEADS)
                tl.store(k_cache_ptr + slot * KV_SIZE + k_head + dim, e4m3(y1, k_scale, FP8_MAX), mask=is_k)
                tl.store(k_cache_ptr + slot * KV_SIZE + k_head + HALF + dim, e4m3(y2, k_scale, FP8_MAX), mask=is_k)
                v_offsets = ((block * NUM_KV_HEADS + v_head) * (HEAD_DIM * BLOCK_SIZE)
                             + value_offsets(within, v_dim, HEAD_DIM, BLOCK_SIZE))
                tl.store(v_cache_ptr + v_offsets, e4m3(v, v_scale, FP8_MAX), mask=has_v)
            else:
                tl.store(k_cache_ptr + slot * KV_SIZE + k_head + dim, y1, mask=is_k)
                tl.store(k_cache_ptr + slot * KV_SIZE + k_head + HALF + dim, y2, mask=is_k)
                tl.store(v_cache_ptr + slot * KV_SIZE + v_head * HEAD_DIM + v_dim, v, mask=has_v)


@triton.jit
def e4m3(x, scale, FP8_MAX: tl.constexpr):
    """x's rows over their scales, as e4m3 (within its range)."""
    return tl.clamp(x.to(tl.float32) / scale[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


def prepare_qkv(qkv: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                norms: tuple[torch.Tensor, torch.Tensor, float] | None, cos_sin_cache: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor | None, keep_kv: bool,
                kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    """q and k by head from the fused projection qkv ([num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]),
    normalised per head where `norms` gives the RMSNorm weights of q and k and their eps (([head_dim], [head_dim],
    eps); None for a model without them), then rotated by the cos/sin table ([max_position, 1, head_dim], float32);
    k and v stored at slot_mapping (slot -1, or no cache, stores nothing). Returns q, and k and v where keep_kv asks
    for them. An FP8 cache takes each head as e4m3 and its scale into kv_scales, laid out as `utils/fp8_kv.py`
    says. qkv is read once, and everything written once. head_dim must be a power of two;
    caches contiguous."""
    num_tokens, d = qkv.size(0), cos_sin_cache.size(-1)
    assert qkv.stride(-1) == 1 and d & (d - 1) == 0 and qkv.size(1) == (num_heads + 2 * num_kv_heads) * d
    q = qkv.new_empty(num_tokens, num_heads, d)
    k, v = (qkv.new_empty(num_tokens, num_kv_heads, d) for _ in range(2)) if keep_kv else (None, None)
    store = k_cache.numel() > 0 and slot_mapping is not None
    fp8_kv = store and kv_scales is not None
    if store:
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.numel() == num_tokens
    q_weight, k_weight, eps = norms if norms is not None else (cos_sin_cache, cos_sin_cache, 0.0)  # unread
    prepare_qkv_kernel[(num_tokens,)](
        qkv, qkv.stride(0), positions, q_weight, k_weight, eps, cos_sin_cache,
        q, k if keep_kv else q, v if keep_kv else q, k_cache if store else q, v_cache if store else q,
        slot_mapping if store else positions, *(kv_scales or (q, q)), NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, QK_ROWS=triton.next_power_of_2(num_heads + num_kv_heads),
        V_ROWS=triton.next_power_of_2(num_kv_heads), KEEP_KV=keep_kv, STORE=store, QK_NORM=norms is not None,
        FP8_KV=fp8_kv, BLOCK_SIZE=k_cache.size(1) if fp8_kv else 1, FP8_MAX=FP8_KV_MAX, MIN_SCALE=MIN_SCALE,
        **pdl.launch_options(qkv.device))
    return q, k, v
