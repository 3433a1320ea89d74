"""The FP8 KV cache's format (`kv_cache_dtype="fp8"`): each token's key and value of each KV head stored as e4m3,
with a float32 scale of its own, computed as the K/V is written: the head's largest magnitude over 448, e4m3's
largest value, so that no value saturates and each keeps e4m3's 3 mantissa bits relative to its head's range. A
head takes head_dim bytes and 4 for its scale where bfloat16 takes 2 x head_dim: 132 of 256 bytes at 128 dims.

A block's layout: keys [slot, kv head, dim], as a bf16 cache's; values [kv head, dim, slot] and scales [kv head,
slot], slots contiguous. The kernels' P.V product takes a tile of values with the keys along its reduction, and the
GPU's matrix loads (ldmatrix) have no transposing form for 8-bit types: values laid out by slot were read from
shared memory a byte at a time. The cache starts zeroed: a tile's slots past a sequence's keys are read unmasked
and weighed by zero, which needs them finite (e4m3 has NaNs)."""
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


def value_cache(values: torch.Tensor) -> torch.Tensor:
    """A layer's values, allocated as [num_blocks, block_size, num_kv_heads, head_dim], viewed as they are laid out:
    [num_blocks, num_kv_heads, head_dim, block_size]."""
    num_blocks, block_size, num_kv_heads, head_dim = values.shape
    return values.view(num_blocks, num_kv_heads, head_dim, block_size)


def by_slot(cache: torch.Tensor) -> torch.Tensor:
    """Values [num_blocks, num_kv_heads, head_dim, block_size] or scales [num_blocks, num_kv_heads, block_size]
    viewed slot first, as keys are: [num_blocks, block_size, num_kv_heads(, head_dim)]."""
    return cache.movedim(-1, 1)


def quantize_cache(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                      tuple[torch.Tensor, torch.Tensor]]:
    """Caches of [num_blocks, block_size, num_kv_heads, head_dim] as an FP8 cache lays them out (by_slot undone):
    keys, values and their scales."""
    (k, k_scales), (v, v_scales) = quantize_kv(keys), quantize_kv(values)
    return k, v.movedim(1, -1).contiguous(), tuple(s.movedim(1, -1).contiguous() for s in (k_scales, v_scales))
