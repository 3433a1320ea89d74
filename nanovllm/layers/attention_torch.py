import torch
import torch.nn.functional as F

from nanovllm.layers.attention_backend import HeadLayout
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import Context


def prepare_qkv_reference(qkv: torch.Tensor, positions: torch.Tensor, heads: HeadLayout, q_norm: RMSNorm | None,
                          k_norm: RMSNorm | None, rotary_emb: RotaryEmbedding) -> tuple[torch.Tensor, ...]:
    """q, k and v by head from a fused projection: q and k normalised per head (where the model has the
    norms), then rotated."""
    q, k, v = heads.split(qkv)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = rotary_emb(positions, q, k)
    return q, k, v


class TorchAttentionBackend:
    """Plain PyTorch attention, for machines without flash-attn.

    Every sequence reads its keys and values back through its block table, so prefix-cache hits,
    chunked prefill and decode all go through the paged cache, as the GPU kernels do.
    Without a cache (the warm-up pass), a prefill attends over the step's own k and v.
    """

    def prepare_qkv(self, qkv, positions, heads: HeadLayout, q_norm, k_norm, rotary_emb, k_cache, v_cache,
                    slot_mapping, keep_kv):
        q, k, v = prepare_qkv_reference(qkv, positions, heads, q_norm, k_norm, rotary_emb)
        if k_cache.numel() and slot_mapping is not None:
            self.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
        return q, k, v

    @staticmethod
    def store_kvcache(k, v, k_cache, v_cache, slot_mapping):
        written = slot_mapping >= 0
        slots = slot_mapping[written]
        k_cache.view(-1, *k.shape[1:])[slots] = k[written]
        v_cache.view(-1, *v.shape[1:])[slots] = v[written]

    def forward(self, q, k, v, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        q_lens, k_lens = self._lengths(context, q.size(0))
        out = torch.empty_like(q)
        q_start = 0
        for i, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
            rows = slice(q_start, q_start + q_len)
            if k_cache.numel():
                keys, values = (self._gather(cache, context.block_tables[i], k_len) for cache in (k_cache, v_cache))
            else:
                keys, values = k[rows], v[rows]
            out[rows] = self._attend(q[rows], keys, values, scale)
            q_start += q_len
        return out

    @staticmethod
    def _lengths(context: Context, num_tokens: int) -> tuple[list[int], list[int]]:
        if context.is_prefill:
            return context.cu_seqlens_q.diff().tolist(), context.cu_seqlens_k.diff().tolist()
        return [1] * num_tokens, context.context_lens.tolist()

    @staticmethod
    def _gather(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
        block_size = cache.size(1)
        blocks = block_table[:(num_tokens + block_size - 1) // block_size]
        return cache[blocks].flatten(0, 1)[:num_tokens]  # [num_tokens, num_kv_heads, head_dim]

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # The queries are the last q_len of k_len positions: query i sees keys up to k_len - q_len + i.
        q_len, k_len = q.size(0), k.size(0)
        query_pos = torch.arange(k_len - q_len, k_len, device=q.device)
        mask = torch.arange(k_len, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)
