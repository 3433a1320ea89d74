"""What an attention backend does, for the layer and the backends that implement it (`attention_torch`,
and on CUDA `attention_flash`): turn a layer's fused q/k/v projection into attention's inputs, store K/V
into the layer's paged cache, and attend over it.

qkv is [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: query heads, key heads, value heads.
A layer's caches are [num_blocks, block_size, num_kv_heads, head_dim] each (empty before the cache
exists); q, k, v are [num_tokens, num_heads (or num_kv_heads), head_dim].
"""
from dataclasses import dataclass
from typing import Protocol

import torch

from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import Context


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """A layer's attention heads on this rank."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of a fused projection, as views by head."""
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        return q.unflatten(-1, (self.num_heads, d)), k.unflatten(-1, (self.num_kv_heads, d)), \
            v.unflatten(-1, (self.num_kv_heads, d))


class AttentionBackend(Protocol):

    def prepare_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, heads: HeadLayout, q_norm: RMSNorm,
                    k_norm: RMSNorm, rotary_emb: RotaryEmbedding, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor | None,
                    keep_kv: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q and k normalised per head (q_norm, k_norm) and rotated to their positions (rotary_emb); k and
        v stored at slot_mapping (slot -1, or no cache, stores nothing). Returns q, and k and v where
        keep_kv asks for them (attention reads them rather than the cache)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, context: Context, scale: float) -> torch.Tensor:
        """Each query attends causally to its sequence's keys. [num_tokens, num_heads, head_dim]"""
        ...
