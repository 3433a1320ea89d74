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
import re
from collections.abc import Callable

import torch

from nanovllm.utils import fp8_weights
from nanovllm.utils.fp8_weights import FP8

BLOCK = [fp8_weights.BLOCK] * 2
METHODS = ("fp8", "compressed-tensors")
SUPPORTED = ("Qwen's block FP8 (quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128] or none), "
             "compressed-tensors FP8 (format 'float-quantized' or 'naive-quantized', 8-bit float weights per "
             "channel or tensor), "
             "and quantization='fp8' on an unquantized checkpoint")
# Linear weights that online FP8 rounds (the embedding, the head, norms and the MoE router stay as they are).
LINEAR_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                  "up_proj.weight", "down_proj.weight")
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
# Static activation scales (the reference path computes in the model's dtype), the KV-cache scales of "-FP8-KV"
# checkpoints (the cache stays unquantized, as vLLM ignores them with kv_cache_dtype="auto") and the all-zero
# zero points older symmetric compressed-tensors files store.
ZERO_POINTS = ("weight_zero_point", "input_zero_point")  # integers: the loader's float check lets them through
OTHER_FP8 = (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)  # 8-bit floats not served
DROPPED_SUFFIXES = ("input_scale", "k_scale", "v_scale", "kv_scale", "output_scale", *ZERO_POINTS)


def quantization_method(quantization_config: dict | None, requested: str | None) -> str | None:
    """The checkpoint's method (checked), or "fp8" for online quantization; ValueError naming what is not served."""
    if not quantization_config:
        if requested not in (None, "fp8"):
            raise ValueError(f"quantization={requested!r} needs a checkpoint quantized that way; served: {SUPPORTED}")
        return requested
    if not isinstance(quantization_config, dict):
        raise ValueError(f"the checkpoint's quantization_config is {shown(quantization_config)}, not a JSON object; "
                         f"served: {SUPPORTED}")
    method = quantization_config.get("quant_method")
    if method not in METHODS:
        raise ValueError(f"the checkpoint's quantization {method!r} is not supported; served: {SUPPORTED}")
    if requested is not None and requested != method:
        raise ValueError(f"quantization={requested!r} does not match the checkpoint's quant_method {method!r}: "
                         f"leave quantization out, or give {method!r}")
    try:
        (check_fp8_config if method == "fp8" else check_compressed_tensors_config)(quantization_config)
    except ValueError as error:
        raise ValueError(f"{error}; served: {SUPPORTED}") from None
    return method


def check_block_splits(sizes: dict[str, int], tp_size: int):
    """Block FP8 kept in e4m3 (on CUDA): a rank's share of each of `sizes` (`registry.split_sizes`) must be whole
    128x128 blocks of scales, as q, k and v, and gate and up, are held side by side in one weight. ValueError
    naming the size that is not, before any process starts (the loader would refuse it later,
    `fp8_weights.scale_region`)."""
    for name, size in sizes.items():
        if size % (tp_size * fp8_weights.BLOCK):
            fitting = [str(t) for t in (1, 2, 4, 8) if all(s % (t * fp8_weights.BLOCK) == 0 for s in sizes.values())]
            advice = (f"tensor_parallel_size={' or '.join(fitting)} splits every size so" if fitting else
                      "no tensor_parallel_size does; on a CPU the weights are dequantized and any size is served")
            raise ValueError(f"block FP8 at tensor_parallel_size={tp_size}: {name} = {size} gives a rank "
                             f"{size // tp_size} rows, not whole 128x128 blocks of FP8 scales; {advice}")


def unquantized_modules(quantization_config: dict | None) -> list[str]:
    """The modules a checkpoint leaves in its unquantized dtype, as `fp8_weights.fp8_weights` takes them: an "fp8"
    config's `ignored_layers` or `modules_to_not_convert` (vLLM's and transformers' names, each a module and those
    under it); compressed-tensors' `ignore`, whose names are whole module names, its "re:" patterns as they are."""
    config = quantization_config or {}
    if config.get("quant_method") == "compressed-tensors":
        return [name if name.startswith("re:") else f"re:{re.escape(name)}$" for name in module_names(config, "ignore")]
    return module_names(config, "ignored_layers") or module_names(config, "modules_to_not_convert")


def module_names(config: dict, key: str) -> list[str]:
    """The config's list of module names under `key` (none where it has none); ValueError where it is not a list of
    strings (a lone string would be read as a list of letters)."""
    names = config.get(key) or []
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"the quantization_config's {key} is {shown(names)}: a list of module names is served")
    return names


def json_object(config: dict, key: str, what: str) -> dict:
    """The config's JSON object under `key` ({} where it has none); ValueError naming `what` where it is another
    kind of value."""
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{what}: {key} is {shown(value)}, not a JSON object")
    return value


def shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_fp8_config(config: dict):
    for key in ("ignored_layers", "modules_to_not_convert"):
        module_names(config, key)
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
        raise ValueError(f"compressed-tensors format {config.get('format')!r} is not served")
    if config.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme is not served: remove it from config.json, and the "
                         "cache is the model's dtype, or e4m3 with kv_cache_dtype='fp8' and scales of this engine's")
    module_names(config, "ignore")
    sparsity = json_object(config, "sparsity_config", "compressed-tensors").get("format", "dense")
    if sparsity != "dense":
        raise ValueError(f"compressed-tensors sparsity_config of format {sparsity!r} is not served (dense only)")
    groups = json_object(config, "config_groups", "compressed-tensors")
    for name in groups:
        group = json_object(groups, name, "compressed-tensors config_groups")
        if group.get("targets", ["Linear"]) != ["Linear"]:
            raise ValueError(f"compressed-tensors group {name!r} targets {group['targets']}: only ['Linear'] "
                             f"(every linear but those in ignore) is served")
        weights = json_object(group, "weights", f"compressed-tensors group {name!r}")
        if (weights.get("num_bits"), weights.get("type"), weights.get("symmetric", True)) != (8, "float", True) or \
                weights.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors group {name!r} quantizes weights as {weights.get('num_bits')}-bit "
                             f"{weights.get('type')} per {weights.get('strategy')}"
                             f"{'' if weights.get('symmetric', True) else ', asymmetric'}: only symmetric 8-bit "
                             f"float per channel or tensor is served")
        inputs = json_object(group, "input_activations", f"compressed-tensors group {name!r}")
        if inputs and (inputs.get("num_bits"), inputs.get("type")) != (8, "float"):
            raise ValueError(f"compressed-tensors group {name!r} quantizes input activations as "
                             f"{inputs.get('num_bits')}-bit {inputs.get('type')}: only 8-bit float is served")
        if json_object(group, "output_activations", f"compressed-tensors group {name!r}"):
            raise ValueError(f"compressed-tensors group {name!r} quantizes output activations: not served")


def dequantized_tensors(tensors, online_fp8_weights: bool, source: str,
                        keep_fp8: Callable[[str], bool] = lambda name: False):
    """The (name, tensor) stream of a checkpoint with every FP8 weight dequantized by its scale, scales and input
    scales consumed; with `online_fp8_weights` (quantization="fp8" on an unquantized checkpoint), each linear
    weight rounded to e4m3 per output channel. The weights `keep_fp8` names (those a layer keeps in FP8) come as
    they are, an FP8 one followed by its scale, an unquantized one for the layer to quantize.
    ValueError names a weight without its scale, a scale of the wrong shape or an 8-bit float other than e4m3."""
    weights, scales = {}, {}  # FP8 weights waiting for their scale, and scales waiting for their weight
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix in DROPPED_SUFFIXES:
            continue
        if tensor.dtype in OTHER_FP8:
            raise ValueError(f"checkpoint {source!r}: tensor {name!r} is {tensor.dtype}: of 8-bit floats only e4m3 "
                             f"(torch.float8_e4m3fn) is served")
        if suffix in SCALE_SUFFIXES:
            scales[prefix] = (name, tensor)
        elif tensor.dtype == FP8:
            weights[prefix] = (name, tensor)
        else:
            rounds = online_fp8_weights and not keep_fp8(name) and name.endswith(LINEAR_WEIGHTS)
            yield name, online_fp8(tensor) if rounds else tensor
            continue
        if prefix in weights and prefix in scales:
            (weight_name, weight), (scale_name, scale) = weights.pop(prefix), scales.pop(prefix)
            if keep_fp8(weight_name):
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
