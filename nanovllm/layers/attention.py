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
    """Causal self-attention over the paged KV cache of layer `layer_index`."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, layer_index: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # A tensor on the host, not an int: a compiled layer takes it as an input, so one graph serves every layer.
        self.register_buffer("layer_index", torch.tensor(layer_index, device="cpu"), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.nanovllm.attention(q, k, v, self.layer_index, self.scale)


@torch.library.custom_op("nanovllm::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Store the step's K/V in the layer's cache, then attend. An opaque op to torch.compile: the step's
    metadata (the Context) and the caches it writes never enter a compiled graph, so one graph serves
    every step, and nothing is reordered around the write."""
    context = get_context()
    k_cache = v_cache = EMPTY
    if context.kv_caches is not None:
        k_cache, v_cache = context.kv_caches[int(layer_index)]
        context.backend.store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
    return context.backend.forward(q, k, v, k_cache, v_cache, context, scale)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


EMPTY = torch.tensor([])
