"""Attention on CUDA: a Triton kernel prepares q/k/v and stores K/V (`prepare_qkv`), flash-attn attends.

Chosen by `Attention` only where the model is built on CUDA (`kernel_choice`), so `import nanovllm` needs
neither flash-attn nor Triton.
"""
import torch
from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

from nanovllm.layers.attention_backend import HeadLayout
from nanovllm.layers.decode_attention import decode_attention
from nanovllm.layers.prepare_qkv import prepare_qkv
from nanovllm.utils.context import Context


class FlashAttentionBackend:
    """Prefill through `flash_attn_varlen_func`; decode through the Triton `decode_attention`, at any
    block-table width.

    A prefill whose sequences have keys already in the cache (a prefix-cache hit, or earlier
    chunks of the prompt) reads every key through the block table: by then this step's K/V are
    stored too. Otherwise it attends over the step's own k and v, which also serves the
    warm-up pass that runs before the cache exists.
    """

    def prepare_qkv(self, qkv, positions, heads: HeadLayout, q_norm, k_norm, rotary_emb, k_cache, v_cache,
                    slot_mapping, keep_kv):
        norms = None
        if q_norm is not None:
            assert q_norm.eps == k_norm.eps
            norms = (q_norm.weight, k_norm.weight, q_norm.eps)
        return prepare_qkv(qkv, positions, heads, norms, rotary_emb.cos_sin_cache, k_cache, v_cache, slot_mapping,
                           keep_kv)

    def forward(self, q, k, v, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        if context.is_prefill:
            return self._prefill(q, k, v, k_cache, v_cache, context, scale)
        return decode_attention(q, k_cache, v_cache, context.context_lens, context.block_tables, scale)

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
