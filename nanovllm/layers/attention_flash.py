"""Attention on CUDA: a Triton kernel writes K/V into the paged cache, flash-attn attends.

Imported only by `make_attention_backend` on a CUDA device, so `import nanovllm` needs neither
flash-attn nor Triton.
"""
import torch
import triton
import triton.language as tl
from flash_attn import flash_attn_with_kvcache
from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

from nanovllm.utils.context import Context


@triton.jit
def store_kvcache_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                         D: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: copy its D = num_kv_heads * head_dim values of K and of V into its slot.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offsets = tl.arange(0, BLOCK_D)
    mask = offsets < D
    key = tl.load(key_ptr + token * key_stride + offsets, mask=mask)
    value = tl.load(value_ptr + token * value_stride + offsets, mask=mask)
    tl.store(k_cache_ptr + slot * D + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * D + offsets, value, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor):
    """key, value: [num_tokens, num_kv_heads, head_dim], each token's heads contiguous (rows may be strided);
    caches: [num_blocks, block_size, num_kv_heads, head_dim], contiguous; slot -1 writes nothing."""
    num_tokens, num_kv_heads, head_dim = key.shape
    D = num_kv_heads * head_dim
    for t in (key, value):
        assert t.stride(-1) == 1 and t.stride(1) == head_dim, "each token's K/V heads must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.numel() == num_tokens
    store_kvcache_kernel[(num_tokens,)](key, key.stride(0), value, value.stride(0), k_cache, v_cache, slot_mapping,
                                        D, triton.next_power_of_2(D))


class FlashAttentionBackend:
    """Prefill through `flash_attn_varlen_func`, decode through `flash_attn_with_kvcache`.

    A prefill whose sequences have keys already in the cache (a prefix-cache hit, or earlier
    chunks of the prompt) reads every key through the block table: by then this step's K/V are
    stored too. Otherwise it attends over the step's own k and v, which also serves the
    warm-up pass that runs before the cache exists.
    """

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        if context.is_prefill:
            return self._prefill(q, k, v, k_cache, v_cache, context, scale)
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context.context_lens,
                                      block_table=context.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)  # [num_seqs, num_heads, head_dim]

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        block_table = None
        if context.has_cached_prefix:
            assert k_cache.numel(), "a cached prefix needs the KV cache"
            k, v, block_table = k_cache, v_cache, context.block_tables
        # The forward op itself, without flash_attn_varlen_func's autograd wrapper and its host time.
        out, *_ = _flash_attn_varlen_forward(q, k, v, context.cu_seqlens_q, context.cu_seqlens_k, context.max_seqlen_q,
                                             context.max_seqlen_k, 0.0, scale, True, block_table=block_table)
        return out
