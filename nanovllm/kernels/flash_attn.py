"""Attention on CUDA (`layers/attention.py`): prompt chunks through `prefill_attention` (Triton), or flash-attn's
causal varlen kernel (the same contract) where `flash_attn_serves`; decodes through the Triton `decode_attention`.

flash-attn is called through its kernel module rather than its Python wrapper: the wrapper is a torch custom op,
and the first call of any custom op in a process imports torch._dynamo, sympy and torch._inductor, a second of a
new process's start (docs/benchmarks.md).
"""
import functools

import torch

from nanovllm.kernels.decode_attention import decode_attention
from nanovllm.kernels.prefill_attention import prefill_attention

try:
    import flash_attn_2_cuda
except ImportError:  # an optional extra: the Triton kernel serves prompts without it
    flash_attn_2_cuda = None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                     block_table: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each query attends causally to its sequence's keys: k and v by token ([num_keys, num_kv_heads, head_dim])
    or, with a block table, the paged caches. flash_attn_varlen_func's forward without dropout, windows or
    softcap, into `out` where given (else a new tensor); q, k and v need a contiguous last dimension, which the
    kernel checks. [num_tokens, num_heads, head_dim]"""
    out, *_ = flash_attn_2_cuda.varlen_fwd(
        q, k, v, out,
        cu_seqlens_q, cu_seqlens_k,
        None, None,  # seqused_k, leftpad_k
        block_table,
        None,  # alibi_slopes
        max_seqlen_q, max_seqlen_k,
        0.0, scale,  # dropout_p, softmax_scale
        False, True,  # zero_tensors, causal
        -1, -1, 0.0,  # window_size_left, window_size_right, softcap
        False, None)  # return_softmax, generator
    return out


def cuda_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, context, scale: float,
                   kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`attention_torch.torch_attention` on CUDA: decodes through the Triton decode kernel; a prompt chunk through
    the varlen kernel, the sequences with keys in the cache (a prefix-cache hit, earlier chunks: the step's first
    context.num_paged_seqs) over the cache through the block table, which holds this step's K/V by then, and the
    others over the step's own k and v, which is faster. An FP8 cache (kv_scales) is read by the Triton kernels."""
    if not context.is_prefill:
        return decode_attention(q, k_cache, v_cache, context.context_lens, context.block_tables, scale,
                                kv_scales=kv_scales, seq_order=context.seq_order)
    n, split, fresh = context.num_paged_seqs, context.num_paged_tokens, context.cu_seqlens_fresh
    max_q, max_k = context.max_seqlen_q, context.max_seqlen_k
    if n == 0:
        return prompt_attention(q, k, v, context.cu_seqlens_q, context.cu_seqlens_k, max_q, max_k, scale)
    assert k_cache.numel(), "a cached prefix needs the KV cache"
    if fresh is None:
        return prompt_attention(q, k_cache, v_cache, context.cu_seqlens_q, context.cu_seqlens_k, max_q, max_k, scale,
                                context.block_tables, kv_scales=kv_scales)
    out = torch.empty_like(q)
    paged_q = context.max_paged_seqlen_q or max_q
    paged = prompt_attention(q[:split], k_cache, v_cache, context.cu_seqlens_q[:n + 1], context.cu_seqlens_k[:n + 1],
                             paged_q, max_k, scale, context.block_tables[:n], out=out[:split] if paged_q > 1 else None,
                             kv_scales=kv_scales)
    own = prompt_attention(q[split:], k[split:], v[split:], fresh, fresh, max_q, max_q, scale,
                           out=out[split:] if max_q > 1 else None)
    # flash-attn lays one-token queries out anew, and does not write them into `out`
    if paged_q == 1:
        out[:split] = paged
    if max_q == 1:
        out[split:] = own
    return out


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                     block_table: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The Triton kernel, or flash-attn's varlen kernel where `flash_attn_serves`."""
    if flash_attn_serves(q, k, block_table, kv_scales):
        return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, block_table,
                                out=out)
    return prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, block_table,
                             out=out, kv_scales=kv_scales if block_table is not None else None)


def flash_attn_serves(q: torch.Tensor, k: torch.Tensor, block_table: torch.Tensor | None,
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """flash-attn where it is installed, on GPUs before Hopper, for bfloat16 or float16 and a paged cache in the
    model's dtype of blocks of a multiple of 256. On an H200 the Triton kernel is the faster in every case
    measured (docs/benchmarks.md); on older GPUs flash-attn is kept where installed, as it was tuned for them."""
    if flash_attn_2_cuda is None or q.dtype == torch.float32 or not before_hopper(q.device):
        return False
    return block_table is None or (k.size(1) % 256 == 0 and kv_scales is None)


@functools.cache
def before_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] < 9


def compile_paged_prompt_attention(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                                   dtype: torch.dtype, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    """One query over one cached key through a one-block table, output dropped: the paged prompt kernel compiles
    at start-up rather than at the first prefix hit or chunk."""
    q = torch.zeros(1, num_heads, k_cache.size(-1), dtype=dtype, device=k_cache.device)
    one_key = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
    prompt_attention(q, k_cache, v_cache, one_key, one_key, 1, 1, scale, table, kv_scales=kv_scales)
