"""Attention in plain PyTorch, for machines without the CUDA kernels, and the reference they are tested against.

Every sequence reads its keys and values back through its block table, so prefix-cache hits, chunked prefill and
decode all go through the paged cache, as the GPU kernels do. Without a cache (the warm-up pass), a prefill attends
over the step's own k and v.
"""
import torch
import torch.nn.functional as F

from nanovllm.utils.context import Context
from nanovllm.utils.fp8_kv import dequantize_kv, quantize_kv, scales_by_slot, value_group_slots, values_by_slot


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    """k and v ([num_tokens, num_kv_heads, head_dim]) into the caches' slots; slot -1 stores nothing. An FP8 cache
    takes each head quantized, its scale into kv_scales' caches, all laid out as `utils/fp8_kv.py` says."""
    written = slot_mapping >= 0
    block_size = k_cache.size(1)
    blocks, slots = slot_mapping[written] // block_size, slot_mapping[written] % block_size
    if kv_scales is None:
        k_cache[blocks, slots], v_cache[blocks, slots] = k[written], v[written]
        return
    (k_e4m3, k_scales), (v_e4m3, v_scales) = quantize_kv(k[written]), quantize_kv(v[written])
    group = value_group_slots(block_size)
    k_cache[blocks, slots], values_by_slot(v_cache)[blocks, slots // group, slots % group] = k_e4m3, v_e4m3
    scales_by_slot(kv_scales[0])[blocks, slots], scales_by_slot(kv_scales[1])[blocks, slots] = k_scales, v_scales


def torch_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, context: Context, scale: float,
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each query attends causally to its sequence's keys. [num_tokens, num_heads, head_dim]"""
    q_lens, k_lens = _lengths(context, q.size(0))
    out = torch.empty_like(q)
    q_start = 0
    for i, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
        rows = slice(q_start, q_start + q_len)
        if k_cache.numel():
            keys, values = _gather(k_cache, v_cache, kv_scales, context.block_tables[i], k_len, q.dtype)
        else:
            keys, values = k[rows], v[rows]
        out[rows] = _attend(q[rows], keys, values, scale)
        q_start += q_len
    return out


def _lengths(context: Context, num_tokens: int) -> tuple[list[int], list[int]]:
    if context.is_prefill:
        return context.cu_seqlens_q.diff().tolist(), context.cu_seqlens_k.diff().tolist()
    return [1] * num_tokens, context.context_lens.tolist()


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
            block_table: torch.Tensor, num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values, [num_tokens, num_kv_heads, head_dim] each, from its blocks."""
    block_size = k_cache.size(1)
    blocks = block_table[:(num_tokens + block_size - 1) // block_size]
    if kv_scales is None:
        return tuple(cache[blocks].flatten(0, 1)[:num_tokens] for cache in (k_cache, v_cache))
    caches = (k_cache[blocks], values_by_slot(v_cache)[blocks].flatten(1, 2))  # [blocks, slot, kv head, dim]
    return tuple(dequantize_kv(cache.flatten(0, 1)[:num_tokens],
                               scales_by_slot(scales)[blocks].flatten(0, 1)[:num_tokens], dtype)
                 for cache, scales in zip(caches, kv_scales))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # The queries are the last q_len of k_len positions: query i sees keys up to k_len - q_len + i.
    q_len, k_len = q.size(0), k.size(0)
    query_pos = torch.arange(k_len - q_len, k_len, device=q.device)
    mask = torch.arange(k_len, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
