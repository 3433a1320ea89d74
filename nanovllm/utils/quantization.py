"""FP8 checkpoints, read by their config.json alone, and `quantization="fp8"` on an unquantized one (vLLM's names).

- Qwen's block FP8 (`quant_method: "fp8"`, `fmt: "e4m3"`, `weight_block_size: [128, 128]`): each linear's `weight`
  in float8_e4m3fn and a float32 `weight_scale_inv` per 128x128 block; without a block size, one `weight_scale`
  per tensor (vLLM's older fp8 format).
- compressed-tensors FP8 (`format: "float-quantized"`): `weight` in float8_e4m3fn with a `weight_scale` per output
  channel or per tensor; activations dynamic per token, or static (an `input_scale`).
- `quantization="fp8"` on an unquantized checkpoint: each linear's weight rounded to e4m3 per output channel.

Here each format becomes weights in the model's dtype as they are read (the reference path, activations
unquantized): W = float(weight) * scale, block by block or channel by channel. Everything else is refused by
name before any work.
"""
import torch

from nanovllm.utils import fp8_weights
from nanovllm.utils.fp8_weights import FP8

BLOCK = [fp8_weights.BLOCK] * 2
METHODS = ("fp8", "compressed-tensors")
SUPPORTED = ("Qwen's block FP8 (quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128] or none), "
             "compressed-tensors FP8 (format 'float-quantized', 8-bit float weights per channel or tensor), "
             "and quantization='fp8' on an unquantized checkpoint")
# Linear weights that online FP8 rounds (the embedding, the head, norms and the MoE router stay as they are).
LINEAR_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                  "up_proj.weight", "down_proj.weight")
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
# Static activation scales (the reference path computes in the model's dtype), the KV-cache scales of "-FP8-KV"
# checkpoints (the cache stays unquantized, as vLLM ignores them with kv_cache_dtype="auto") and the all-zero
# zero points older symmetric compressed-tensors files store.
ZERO_POINTS = ("weight_zero_point", "input_zero_point")  # integers: the loader's float check lets them through
DROPPED_SUFFIXES = ("input_scale", "k_scale", "v_scale", "kv_scale", "output_scale", *ZERO_POINTS)


def quantization_method(quantization_config: dict | None, requested: str | None) -> str | None:
    """The checkpoint's method (checked), or "fp8" for online quantization; ValueError naming what is not served."""
    if not quantization_config:
        if requested not in (None, "fp8"):
            raise ValueError(f"quantization={requested!r} needs a checkpoint quantized that way; served: {SUPPORTED}")
        return requested
    method = quantization_config.get("quant_method")
    if method not in METHODS:
        raise ValueError(f"the checkpoint's quantization {method!r} is not supported; served: {SUPPORTED}")
    if requested is not None and requested != method:
        raise ValueError(f"quantization={requested!r} does not match the checkpoint's quant_method {method!r}: "
                         f"leave quantization out, or give {method!r}")
    (check_fp8_config if method == "fp8" else check_compressed_tensors_config)(quantization_config)
    return method


def check_fp8_config(config: dict):
    if config.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint of fmt {config['fmt']!r}: only e4m3 is served")
    block = config.get("weight_block_size")
    if block is not None and list(block) != BLOCK:
        raise ValueError(f"FP8 checkpoint with weight_block_size {block}: only {BLOCK} (or none) is served")
    if block is not None and config.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"block FP8 with activation_scheme {config['activation_scheme']!r}: only dynamic "
                         f"activations go with block scales (vLLM refuses it too)")


def check_compressed_tensors_config(config: dict):
    if config.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {config.get('format')!r} is not served; {SUPPORTED}")
    if config.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme is not served: the KV cache is kept unquantized")
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if (weights.get("num_bits"), weights.get("type"), weights.get("symmetric", True)) != (8, "float", True) or \
                weights.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors group {name!r} quantizes weights as {weights.get('num_bits')}-bit "
                             f"{weights.get('type')} per {weights.get('strategy')}"
                             f"{'' if weights.get('symmetric', True) else ', asymmetric'}: only symmetric 8-bit "
                             f"float per channel or tensor is served")
        if group.get("output_activations"):
            raise ValueError(f"compressed-tensors group {name!r} quantizes output activations: not served")


def dequantized_tensors(tensors, online_fp8_weights: bool, source: str, keep_fp8: bool = False):
    """The (name, tensor) stream of a checkpoint with every FP8 weight dequantized by its scale, scales and input
    scales consumed; with `online_fp8_weights` (quantization="fp8" on an unquantized checkpoint), each linear
    weight rounded to e4m3 per output channel. With `keep_fp8` (a model whose layers keep FP8 weights), each FP8
    weight as it is, followed by its scale, and unquantized weights as they are (the layers quantize them).
    ValueError names a weight without its scale or a scale of the wrong shape."""
    weights, scales = {}, {}  # FP8 weights waiting for their scale, and scales waiting for their weight
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix in DROPPED_SUFFIXES:
            continue
        if suffix in SCALE_SUFFIXES:
            scales[prefix] = (name, tensor)
        elif tensor.dtype == FP8:
            weights[prefix] = (name, tensor)
        else:
            rounds = online_fp8_weights and not keep_fp8 and name.endswith(LINEAR_WEIGHTS)
            yield name, online_fp8(tensor) if rounds else tensor
            continue
        if prefix in weights and prefix in scales:
            (weight_name, weight), (scale_name, scale) = weights.pop(prefix), scales.pop(prefix)
            if keep_fp8:
                yield weight_name, weight
                yield scale_name, scale
                continue
            per_block = scale_name.endswith("weight_scale_inv")  # Qwen's; weight_scale is per tensor or channel
            yield weight_name, dequantize(weight, scale, per_block, f"{source}: {scale_name!r}")
    for name, _ in weights.values():
        raise ValueError(f"checkpoint {source!r}: FP8 weight {name!r} has no scale (weight_scale_inv or "
                         f"weight_scale) beside it")
    for name, _ in scales.values():
        raise ValueError(f"checkpoint {source!r}: scale {name!r} has no FP8 weight beside it")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, per_block: bool, what: str) -> torch.Tensor:
    """float32 weight * scale: a scale per [128, 128] block of a 2-D weight (block FP8), else per output channel
    ([out, 1] or [out]) or per tensor (one value)."""
    weight, scale = weight.float(), scale.float()
    if scale.numel() == 1 and not per_block:
        return weight * scale.reshape(())
    out = weight.shape[0]
    if per_block:
        blocks = tuple(-(-size // b) for size, b in zip(weight.shape[-2:], BLOCK))
        if tuple(scale.shape[-2:]) != blocks:
            raise ValueError(f"{what} of shape {tuple(scale.shape)} does not give one scale per {BLOCK} block of a "
                             f"weight of shape {tuple(weight.shape)} (expected {blocks})")
        full = scale.repeat_interleave(BLOCK[0], -2).repeat_interleave(BLOCK[1], -1)
        return weight * full[..., :weight.shape[-2], :weight.shape[-1]]
    if scale.numel() != out:
        raise ValueError(f"{what} of shape {tuple(scale.shape)} is neither per tensor, per output channel ({out}) nor "
                         f"per block of a weight of shape {tuple(weight.shape)}")
    return weight * scale.reshape(out, *[1] * (weight.dim() - 1))


def online_fp8(weight: torch.Tensor) -> torch.Tensor:
    """The weight as `quantization="fp8"` stores it (e4m3, a scale per output channel), dequantized to float32."""
    return fp8_weights.dequantize(*fp8_weights.quantize(weight, "channel"))
