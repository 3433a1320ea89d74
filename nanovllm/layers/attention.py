import torch
from torch import nn

from nanovllm.layers.attention_backend import AttentionBackend, HeadLayout
from nanovllm.layers.attention_torch import TorchAttentionBackend
from nanovllm.layers.kernel_choice import choose_kernel
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """Causal self-attention over one layer's paged KV cache: plain PyTorch, or on CUDA a Triton kernel
    that prepares q/k/v and stores K/V, then flash-attn and a Triton decode kernel. The runner binds the
    layer's caches (`k_cache`, `v_cache`) once they exist; the step's metadata comes from the Context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.heads = HeadLayout(num_heads, num_kv_heads, head_dim)
        self.scale = scale
        self.backend: AttentionBackend = choose_kernel(TorchAttentionBackend, "attention_flash:FlashAttentionBackend")()
        self.k_cache = self.v_cache = EMPTY

    def prepare_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
                    rotary_emb: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Split the fused projection into heads, normalise q and k per head with q_norm and k_norm (both or
        neither), rotate them to their positions with rotary_emb, and store k and v in this layer's cache
        (one kernel on CUDA). Returns q, and k and v where attention reads them rather than the cache."""
        context = get_context()
        keep_kv = context.is_prefill and not context.has_cached_prefix
        return self.backend.prepare_qkv(qkv, positions, self.heads, q_norm, k_norm, rotary_emb, self.k_cache,
                                        self.v_cache, context.slot_mapping, keep_kv)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """[num_tokens, num_heads, head_dim]"""
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, get_context(), self.scale)


EMPTY = torch.tensor([])
