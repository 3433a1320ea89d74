"""Causal self-attention over one layer's paged KV cache. The model hands it each step's q, k and v by head, and the
K/V to store; the runner binds the layer's caches (`k_cache`, `v_cache`) once they exist; the step's metadata comes
from the Context. Plain PyTorch on a CPU (`attention_torch`); on CUDA, Triton kernels for prompts and decodes, or
flash-attn's varlen kernel for prompts where it serves (`kernels/flash_attn.py`).
"""
import torch
from torch import nn

from nanovllm.kernels import on_cuda
from nanovllm.layers.attention_torch import store_kvcache, torch_attention
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import get_context


class Attention(nn.Module):

    def __init__(self, num_heads: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.scale = num_heads, num_kv_heads, scale
        self.k_cache = self.v_cache = EMPTY
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # an FP8 cache's (`fp8_kv.py`)
        self.attend, self.prepare_qkv_kernel = torch_attention, None
        if on_cuda():
            from nanovllm.kernels.flash_attn import cuda_attention
            from nanovllm.kernels.prepare_qkv import prepare_qkv
            self.attend, self.prepare_qkv_kernel = cuda_attention, prepare_qkv

    def store_kv(self, k: torch.Tensor, v: torch.Tensor):
        """k and v [num_tokens, num_kv_heads, head_dim] into the cache at the step's slots (slot -1 stores nothing)."""
        slot_mapping = get_context().slot_mapping
        if self.k_cache.numel() and slot_mapping is not None:
            store_kvcache(k, v, self.k_cache, self.v_cache, slot_mapping, self.kv_scales)

    def compile_paged_prompts(self, dtype: torch.dtype):
        """On CUDA, the prompt kernel that reads this cache through a block table for queries of `dtype`, compiled
        now rather than at the first prefix hit or chunk."""
        from nanovllm.kernels.flash_attn import compile_paged_prompt_attention
        compile_paged_prompt_attention(self.num_heads, self.k_cache, self.v_cache, self.scale, dtype, self.kv_scales)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """Each query attends to its sequence's keys up to its own: the step's k and v, or, where they are None or
        earlier keys are cached, the cache's. [num_tokens, num_heads, head_dim]"""
        return self.attend(q, k, v, self.k_cache, self.v_cache, get_context(), self.scale, self.kv_scales)

    def prepare_qkv_fused(self, qkv: torch.Tensor, positions: torch.Tensor, q_norm: RMSNorm | None,
                          k_norm: RMSNorm | None, rotary_emb: RotaryEmbedding):
        """On CUDA, one kernel (`kernels/prepare_qkv.py`) for `DecoderAttention`'s steps from the fused projection
        to the cache write: the split into heads, q_norm and k_norm (both or neither), rotary_emb, store_kv.
        Returns q, and k and v where this step's attention reads them rather than the cache."""
        context = get_context()
        keep_kv = context.attends_own_keys
        norms = None
        if q_norm is not None:
            assert q_norm.eps == k_norm.eps
            norms = (q_norm.weight, k_norm.weight, q_norm.eps)
        return self.prepare_qkv_kernel(qkv, positions, self.num_heads, self.num_kv_heads, norms,
                                       rotary_emb.cos_sin_cache, self.k_cache, self.v_cache, context.slot_mapping,
                                       keep_kv, self.kv_scales)


EMPTY = torch.tensor([])
