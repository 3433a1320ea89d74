import re

import torch
from torch import nn

from nanovllm.utils.folder_checkpoint import folder_tensors
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
    such as an expert's into stacked ones. FP8 weights are dequantized as they are read (`quantization.py`)."""
    packed_modules_mapping = getattr(model, "packed_modules_mapping", {})
    route_weight = getattr(model, "route_weight", lambda name: None)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded, seen = set(), set()  # (parameter, shard) pairs loaded; checkpoint names read
    tensors = gguf_tensors(path, config) if is_gguf_file(path) else folder_tensors(path)
    online_fp8 = quantization == "fp8" and not getattr(config, "quantization_config", None)
    tensors = dequantized_tensors(tensors, online_fp8, path)
    for weight_name, tensor in tensors:
        if weight_name.endswith(COMPUTED_BUFFERS):
            continue
        if weight_name in seen:  # a later file would overwrite it: two checkpoints in one folder?
            raise ValueError(f"checkpoint {path!r} holds tensor {weight_name!r} twice (in two of its files)")
        seen.add(weight_name)
        _check_size_the_config_gives(weight_name, tensor, config, path)
        param_name, shard_id = route_weight(weight_name) or _route(weight_name, packed_modules_mapping)
        if param_name not in params:
            raise ValueError(f"checkpoint {path!r}: tensor {weight_name!r} matches no parameter of the model")
        param = params[param_name]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        args = () if shard_id is None else (shard_id,)
        try:
            weight_loader(param, tensor, *args)
        except RuntimeError as error:  # a size mismatch, from copy_ or a shard's narrow
            raise ValueError(f"checkpoint {path!r}: tensor {weight_name!r} of shape {tuple(tensor.shape)} does not "
                             f"fit the model's {param_name!r} of shape {tuple(param.shape)} (does config.json "
                             f"match the weights?)") from error
        loaded.add((param_name, shard_id))
    _check_all_loaded(model, params, loaded, path, packed_modules_mapping)


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3, seed: int = 1234):
    """load_format='dummy': every parameter uniform in [low, high), as vLLM's dummy weights, from a generator of
    its own (the caller's random state is left alone): for benchmarks of a checkpoint's config alone."""
    generator = None
    for param in model.parameters():
        if generator is None or generator.device != param.device:
            generator = torch.Generator(param.device).manual_seed(seed)
        param.data.uniform_(low, high, generator=generator)


def _check_size_the_config_gives(weight_name: str, tensor: torch.Tensor, config, path: str):
    for pattern, dim, field in SIZES_THE_CONFIG_GIVES:
        size = getattr(config, field, None)
        if size is not None and pattern.search(weight_name) and tensor.size(dim) != size:
            raise ValueError(f"checkpoint {path!r}: tensor {weight_name!r} has {tensor.size(dim)} "
                             f"{'rows' if dim == 0 else 'columns'}, but the model's config gives {field}={size}")


def _route(weight_name: str, packed_modules_mapping: dict) -> tuple[str, object]:
    for checkpoint_name, (param_name, shard_id) in packed_modules_mapping.items():
        if checkpoint_name in weight_name:
            return weight_name.replace(checkpoint_name, param_name), shard_id
    return weight_name, None


def _check_all_loaded(model: nn.Module, params: dict, loaded: set, path: str, packed_modules_mapping: dict):
    # A tied parameter is loaded under either of its names.
    loaded_ids = {id(params[name]) for name, _ in loaded}
    missing = [name for name, param in model.named_parameters() if id(param) not in loaded_ids]
    # A fused parameter (q/k/v, gate/up) loads a checkpoint tensor a piece: each piece's is needed.
    for name in {name for name, _ in loaded}:
        missing += [name.replace(fused, piece) for piece, (fused, shard) in packed_modules_mapping.items()
                    if f".{fused}." in name and (name, shard) not in loaded]
    missing += [f"{name}.{piece}" for name, module in model.named_modules() if hasattr(module, "missing_tensors")
                for piece in module.missing_tensors()]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(missing[:5])}")
