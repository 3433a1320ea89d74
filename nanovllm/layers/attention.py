from typing import Protocol

import torch
from torch import nn

from nanovllm.utils.context import Context, get_context


class AttentionBackend(Protocol):
    """Writes a step's K/V into the paged cache and attends over it.

    Caches are [num_blocks, block_size, num_kv_heads, head_dim]; q, k, v are
    [num_tokens, num_heads (or num_kv_heads), head_dim].
    """

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, context: Context, scale: float) -> torch.Tensor: ...


def make_attention_backend(device: torch.device) -> AttentionBackend:
    """The backend for `device`; GPU kernels are imported only when asked for."""
    if device.type == "cuda":
        from nanovllm.layers.attention_flash import FlashAttentionBackend
        return FlashAttentionBackend()
    from nanovllm.layers.attention_torch import TorchAttentionBackend
    return TorchAttentionBackend()


class Attention(nn.Module):
    """Causal self-attention over the paged KV cache; the ModelRunner sets `backend` and the caches."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend: AttentionBackend | None = None
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_context()
        if self.k_cache.numel():
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, context, self.scale)
