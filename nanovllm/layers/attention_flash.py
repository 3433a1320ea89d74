"""Attention on CUDA: a Triton kernel prepares q/k/v and stores K/V (`prepare_qkv`), flash-attn attends.

Chosen by `Attention` only where the model is built on CUDA (`kernel_choice`), so `import nanovllm` needs
neither flash-attn nor Triton.
"""
import torch

# isort: split
# flash-attn's kernels, called without its Python wrappers: those are torch custom ops, and the first call of any
# custom op in a process imports torch._dynamo with sympy, 1 s of a new process's start on the H200 machine (5.5 s
# there as it comes, with torch's bytecode not cached).
import flash_attn_2_cuda

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
        return varlen_forward(q, k, v, context, scale, block_table)


def varlen_forward(q, k, v, context: Context, scale: float, block_table: torch.Tensor | None) -> torch.Tensor:
    """flash-attn's causal varlen forward (flash_attn_varlen_func's, without dropout, windows or softcap); q, k
    and v need a contiguous last dimension, which the kernel checks (the wrapper copied them where not)."""
    out, *_ = flash_attn_2_cuda.varlen_fwd(
        q, k, v, None,  # out: allocated by the kernel
        context.cu_seqlens_q, context.cu_seqlens_k,
        None, None,  # seqused_k, leftpad_k
        block_table,
        None,  # alibi_slopes
        context.max_seqlen_q, context.max_seqlen_k,
        0.0, scale,  # dropout_p, softmax_scale
        False, True,  # zero_tensors, causal
        -1, -1, 0.0,  # window_size_left, window_size_right, softcap
        False, None)  # return_softmax, generator
    return out
