"""The FP8 KV cache's format (`kv_cache_dtype="fp8"`): each token's key and value of each KV head stored as e4m3,
with a float32 scale of its own, computed as the K/V is written: the head's largest magnitude over 448, e4m3's
largest value, so that no value saturates and each keeps e4m3's 3 mantissa bits relative to its head's range. A
head takes head_dim bytes and 4 for its scale where bfloat16 takes 2 x head_dim: 132 of 256 bytes at 128 dims."""
import torch

FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = 448.0
MIN_SCALE = 1e-12  # a head of zeros: any scale stores zeros


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] as e4m3 and its scales [...] (float32): x ~= e4m3 * scale."""
    scales = (x.abs().amax(-1).float() / FP8_KV_MAX).clamp_min(MIN_SCALE)
    quantized = (x.float() / scales[..., None]).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV)
    return quantized, scales


def dequantize_kv(quantized: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (quantized.float() * scales[..., None]).to(dtype)
