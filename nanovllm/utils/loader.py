import re
from functools import partial

import torch
from torch import nn

from nanovllm.utils.folder_checkpoint import folder_tensors
from nanovllm.utils.fp8_weights import FP8, FP8_MAX
from nanovllm.utils.gguf_checkpoint import gguf_tensors, is_gguf_file
from nanovllm.utils.quantization import dequantized_tensors

# Checkpoint tensors that a rank loads a share of, along a dimension whose size the config gives: (name, dimension,
# the config's field). A config that gives less than the tensor holds would load a part of it without a word.
SIZES_THE_CONFIG_GIVES = [
    (re.compile(r"(embed_tokens|lm_head)\.weight$"), 0, "vocab_size"),
    (re.compile(r"experts\.\d+\.(gate_proj|up_proj)\.weight$"), 0, "moe_intermediate_size"),
    (re.compile(r"experts\.\d+\.down_proj\.weight$"), 1, "moe_intermediate_size"),
]


# Buffers some checkpoints store (older Llama conversions) that the model computes itself: skipped, as vLLM does.
COMPUTED_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def copy_weight(target: torch.Tensor, source: torch.Tensor):
    """Copy a checkpoint tensor into a parameter or a piece of one, of exactly its shape: copy_ alone would
    broadcast a (1, n) or 0-d tensor over the whole of it."""
    if target.shape != source.shape:
        raise RuntimeError(f"a tensor of shape {tuple(source.shape)} into one of {tuple(target.shape)}")
    target.copy_(source)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor):
    copy_weight(param.data, loaded_weight)


def load_model(model: nn.Module, path: str, config=None, quantization: str | None = None):
    """Copy a checkpoint (a folder of safetensors, or a GGUF file, whose Llama q/k rows need `config`'s head
    counts) into `model`, each tensor through its parameter's `weight_loader`; `packed_modules_mapping`
    routes checkpoint tensors into fused parameters, and the model's `route_weight` (where it has one) others,
    such as an expert's into stacked ones. FP8 weights go as they are into the parameters that keep them (built
    under `fp8_weights`, FP8), else are dequantized as they are read (`quantization.py`)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed_modules_mapping = getattr(model, "packed_modules_mapping", {})
    parameter_of = partial(_parameter_of, params, getattr(model, "route_weight", lambda name: None),
                           packed_modules_mapping)
    loaded, seen = set(), set()  # (parameter, shard) pairs loaded; checkpoint names read
    tensors = gguf_tensors(path, config) if is_gguf_file(path) else folder_tensors(path)
    online_fp8 = quantization == "fp8" and not getattr(config, "quantization_config", None)
    kept_in_fp8 = {name for name, param in params.items() if param.dtype == FP8}
    tensors = dequantized_tensors(tensors, online_fp8, path, lambda name: parameter_of(name)[0] in kept_in_fp8)
    score_source = model.score_source() if hasattr(model, "score_source") else ()
    for weight_name, tensor in tensors:
        if weight_name.endswith(COMPUTED_BUFFERS):
            continue
        if weight_name in seen:  # a later file would overwrite it: two checkpoints in one folder?
            raise ValueError(f"checkpoint {path!r} holds tensor {weight_name!r} twice (in two of its files)")
        seen.add(weight_name)
        _check_size_the_config_gives(weight_name, tensor, config, path)
        if weight_name in score_source:  # a classifier made of LM-head rows (hf_overrides' classifier_from_token)
            model.load_score_from_head(tensor)
            loaded.add(("score.weight", None))
        param_name, shard_id = parameter_of(weight_name)
        if param_name.startswith("lm_head.") and param_name not in params:
            continue  # a pooling engine's decoder holds no LM head
        if param_name not in params:
            raise ValueError(f"checkpoint {path!r}: tensor {weight_name!r} matches no parameter of the model")
        param = params[param_name]
        if param.dtype == FP8 and tensor.dtype != FP8 and not online_fp8:  # the layer would round it to e4m3
            raise ValueError(f"checkpoint {path!r}: tensor {weight_name!r} is {tensor.dtype}, not FP8, and the "
                             f"quantization_config's unquantized modules (ignored_layers, modules_to_not_convert "
                             f"or ignore) do not name its module (the engine's {param_name.rpartition('.')[0]!r})")
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        args = () if shard_id is None else (shard_id,)
        try:
            weight_loader(param, tensor, *args)
        except ValueError as error:  # a split that cuts a block of FP8 scales
            raise ValueError(f"checkpoint {path!r}: tensor {weight_name!r}: {error}") from error
        except RuntimeError as error:  # a size mismatch, from copy_ or a shard's narrow
            raise ValueError(f"checkpoint {path!r}: tensor {weight_name!r} of shape {tuple(tensor.shape)} does not "
                             f"fit the model's {param_name!r} of shape {tuple(param.shape)} (does config.json "
                             f"match the weights?)") from error
        loaded.add((param_name, shard_id))
    _check_all_loaded(model, params, loaded, path, packed_modules_mapping)


def load_weights(model: nn.Module, config):
    """The checkpoint's weights into `model`, or random ones where config.load_format is "dummy"."""
    if config.load_format == "dummy":
        initialize_dummy_weights(model)
    else:
        load_model(model, config.model, config.hf_config, config.quantization)


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234):
    """load_format='dummy': every parameter uniform in [low, high), as vLLM's dummy weights, from a generator of
    its own (the caller's random state is left alone): for benchmarks of a checkpoint's config alone. FP8 weights
    take the same values, as e4m3 uniform over its range times scales of high / 448."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None or generator.device != param.device:
            generator = torch.Generator(param.device).manual_seed(seed)
        if name.endswith("scale"):
            param.data.fill_(max(abs(low), abs(high)) / FP8_MAX)
        elif param.dtype == FP8:
            rows = param.data.flatten(0, -2)
            for piece in rows.split(max(1, (1 << 24) // rows.size(1))):  # 64 MB of float32 at a time
                values = torch.empty(piece.shape, device=piece.device).uniform_(-FP8_MAX, FP8_MAX, generator=generator)
                piece.copy_(values.to(FP8))
        else:
            param.data.uniform_(low, high, generator=generator)


def weight_bytes(model: nn.Module) -> int:
    """The bytes the model's parameters take (a tied one once)."""
    return sum(param.numel() * param.element_size() for param in model.parameters())


def _check_size_the_config_gives(weight_name: str, tensor: torch.Tensor, config, path: str):
    for pattern, dim, field in SIZES_THE_CONFIG_GIVES:
        size = getattr(config, field, None)
        if size is not None and pattern.search(weight_name) and tensor.size(dim) != size:
            raise ValueError(f"checkpoint {path!r}: tensor {weight_name!r} has {tensor.size(dim)} "
                             f"{'rows' if dim == 0 else 'columns'}, but the model's config gives {field}={size}")


def _parameter_of(params: dict, route_weight, packed_modules_mapping: dict, weight_name: str) -> tuple[str, object]:
    """The model's parameter a checkpoint tensor loads into, and its shard id where the parameter is fused."""
    param_name, shard_id = route_weight(weight_name) or _route(weight_name, packed_modules_mapping)
    param_name = param_name.removesuffix("_inv")  # Qwen's weight_scale_inv multiplies, as every weight_scale
    if param_name not in params and f"model.{param_name}" in params:  # a bare decoder's file (embedding models)
        param_name = f"model.{param_name}"
    return param_name, shard_id


def _route(weight_name: str, packed_modules_mapping: dict) -> tuple[str, object]:
    for checkpoint_name, (param_name, shard_id) in packed_modules_mapping.items():
        if checkpoint_name in weight_name:
            return weight_name.replace(checkpoint_name, param_name), shard_id
    return weight_name, None


def _check_all_loaded(model: nn.Module, params: dict, loaded: set, path: str, packed_modules_mapping: dict):
    # A tied parameter is loaded under either of its names.
    loaded_ids = {id(params[name]) for name, _ in loaded}
    # An FP8 weight's scale comes with it: from the checkpoint beside it, or made as the layer quantized it.
    missing = [name for name, param in model.named_parameters() if id(param) not in loaded_ids
               and not name.endswith("scale")]
    # A fused parameter (q/k/v, gate/up) loads a checkpoint tensor a piece: each piece's is needed.
    for name in {name for name, _ in loaded}:
        missing += [name.replace(fused, piece) for piece, (fused, shard) in packed_modules_mapping.items()
                    if f".{fused}." in name and (name, shard) not in loaded]
    missing += [f"{name}.{piece}" for name, module in model.named_modules() if hasattr(module, "missing_tensors")
                for piece in module.missing_tensors()]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(missing[:5])}")
