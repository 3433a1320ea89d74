from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from nanovllm.layers.layernorm import rms_norm
from nanovllm.layers.rotary_embedding import rotate_query_key
from nanovllm.utils.context import Context, get_context


class AttentionBackend(Protocol):
    """Turns a step's fused q/k/v projection into attention inputs, writes K/V into the paged cache, and
    attends over it.

    qkv is [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: query heads, key heads, value heads.
    Caches are [num_blocks, block_size, num_kv_heads, head_dim]; q, k, v are [num_tokens, num_heads
    (or num_kv_heads), head_dim].
    """

    def prepare_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, heads: "HeadNorms", k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor | None,
                    keep_kv: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q and k RMS-normalised per head and rotated to their positions; k and v stored at slot_mapping
        (slot -1, or no cache, stores nothing). Returns q, and k and v where keep_kv asks for them."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, context: Context, scale: float) -> torch.Tensor: ...


@dataclass(frozen=True)
class HeadNorms:
    """What turns projected query and key heads into attention inputs: their RMSNorm weights ([head_dim]
    each) and one epsilon for both (Qwen3's), and the rotary embedding's cos/sin table ([max_position, 1,
    head_dim], float32: rotary spans the whole head)."""

    num_heads: int
    num_kv_heads: int
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    cos_sin_cache: torch.Tensor

    @property
    def head_dim(self) -> int:
        return self.q_weight.numel()


def prepare_qkv_reference(qkv: torch.Tensor, positions: torch.Tensor,
                          heads: HeadNorms) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (normalised and rotated) and v from qkv in plain PyTorch, rounding as the model's layers do."""
    d = heads.head_dim
    q, k, v = qkv.split([heads.num_heads * d, heads.num_kv_heads * d, heads.num_kv_heads * d], dim=-1)
    q = rms_norm(q.reshape(-1, heads.num_heads, d), heads.q_weight, heads.eps)
    k = rms_norm(k.reshape(-1, heads.num_kv_heads, d), heads.k_weight, heads.eps)
    q, k = rotate_query_key(heads.cos_sin_cache, positions, q, k)
    return q, k, v.reshape(-1, heads.num_kv_heads, d)


def make_attention_backend(device: torch.device) -> AttentionBackend:
    """The backend for `device`; GPU kernels are imported only when asked for."""
    if device.type == "cuda":
        from nanovllm.layers.attention_flash import FlashAttentionBackend
        return FlashAttentionBackend()
    from nanovllm.layers.attention_torch import TorchAttentionBackend
    return TorchAttentionBackend()


class Attention(nn.Module):
    """Causal self-attention of layer `layer_index` over its paged KV cache, from the layer's fused q/k/v
    projection: query and key heads are RMS-normalised and rotated, K/V stored, then attended."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, layer_index: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_index = layer_index

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module,
                rotary_emb: nn.Module) -> torch.Tensor:
        """Prepare q/k/v, store K/V in this layer's cache (where the step has one), then attend.
        [num_tokens, num_heads, head_dim]"""
        context = get_context()
        k_cache = v_cache = EMPTY
        if context.kv_caches is not None:
            k_cache, v_cache = context.kv_caches[self.layer_index]
        heads = HeadNorms(self.num_heads, self.num_kv_heads, q_norm.weight, k_norm.weight, q_norm.eps,
                          rotary_emb.cos_sin_cache)
        q, k, v = context.backend.prepare_qkv(qkv, positions, heads, k_cache, v_cache, context.slot_mapping,
                                              keep_kv=context.is_prefill and not context.has_cached_prefix)
        return context.backend.forward(q, k, v, k_cache, v_cache, context, self.scale)


EMPTY = torch.tensor([])
