"""The FP8 KV cache's format (`kv_cache_dtype="fp8"`): each token's key and value of each KV head stored as e4m3,
with a float32 scale of its own, computed as the K/V is written: the head's largest magnitude over 448, e4m3's
largest value, so that no value saturates and each keeps e4m3's 3 mantissa bits relative to its head's range. A
head takes head_dim bytes and 4 for its scale where bfloat16 takes 2 x head_dim: 132 of 256 bytes at 128 dims.

A block's layout: keys [slot, kv head, dim], as a bf16 cache's; scales [kv head, slot]; values [kv head, slot group,
dim, slot in group], groups of 64 slots (of 32 or 16 in blocks whose size 64 does not divide). The kernels' P.V
product takes a tile of values with the keys along its reduction, and the GPU's matrix loads (ldmatrix) have no
transposing form for 8-bit types: values laid out as keys were read from shared memory a byte at a time. With slots
contiguous, a decode step writes one byte into each dim's run of slots: runs of a whole block (256 slots) put a
head's dims 256 bytes apart, a cache line each, and storing a step's keys and values took 8x a bf16 cache's time;
runs of 64 put two dims in a line, for 4x (runs of 32, four dims a line, 3x, but decode read their tiles 10%
slower: docs/benchmarks.md). The cache starts zeroed: a tile's slots past a sequence's keys are read unmasked and
weighed by zero, which needs them finite (e4m3 has NaNs)."""
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


def value_group_slots(block_size: int) -> int:
    """Slots in a group of the values' layout (the same rule as `kernels/fp8_kv_tile.value_offsets`)."""
    return 64 if block_size % 64 == 0 else 32 if block_size % 32 == 0 else 16


def value_cache(values: torch.Tensor) -> torch.Tensor:
    """A layer's values, allocated as [num_blocks, block_size, num_kv_heads, head_dim], viewed as they are laid out:
    [num_blocks, num_kv_heads, slot groups, head_dim, slots in a group]."""
    num_blocks, block_size, num_kv_heads, head_dim = values.shape
    group = value_group_slots(block_size)
    return values.view(num_blocks, num_kv_heads, block_size // group, head_dim, group)


def values_by_slot(cache: torch.Tensor) -> torch.Tensor:
    """value_cache's view as [num_blocks, slot groups, slots in a group, num_kv_heads, head_dim]: indexed by
    (blocks, slots // group, slots % group), as keys are by (blocks, slots)."""
    return cache.permute(0, 2, 4, 1, 3)


def scales_by_slot(scales: torch.Tensor) -> torch.Tensor:
    """Scales [num_blocks, num_kv_heads, block_size] viewed slot first: [num_blocks, block_size, num_kv_heads]."""
    return scales.movedim(-1, 1)


def quantize_cache(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                      tuple[torch.Tensor, torch.Tensor]]:
    """Caches of [num_blocks, block_size, num_kv_heads, head_dim] as an FP8 cache lays them out: keys, values (as
    value_cache views them) and their scales."""
    (k, k_scales), (v, v_scales) = quantize_kv(keys), quantize_kv(values)
    laid_out = torch.empty_like(v)
    values_by_slot(value_cache(laid_out)).copy_(v.unflatten(1, (-1, value_group_slots(v.size(1)))))
    return k, value_cache(laid_out), tuple(s.movedim(1, -1).contiguous() for s in (k_scales, v_scales))
