import math

import torch
from torch import nn

from nanovllm.utils.rope_config import rope_parameters


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads to their positions (rotary over the whole head, halves paired)."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if scaling is not None:
            inv_freq = llama3_frequencies(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze(1)  # [max_position, 1, head_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query [num_tokens, num_heads, head_dim] and key [num_tokens, num_kv_heads, head_dim], rotated."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [num_tokens, 1, head_dim // 2] each
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)


def rotary_embedding(config, head_dim: int) -> RotaryEmbedding:
    parameters = rope_parameters(config)
    scaling = parameters if parameters["rope_type"] == "llama3" else None
    return RotaryEmbedding(head_dim, config.max_position_embeddings, parameters["rope_theta"], scaling)


def llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's long-context rotary: wavelengths past the original context's / low_freq_factor are
    stretched by `factor`, those under its / high_freq_factor kept, and those between blended."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, blended, scaled)
