import re

import torch
from torch import nn

from nanovllm.utils.folder_checkpoint import folder_tensors
from nanovllm.utils.gguf_checkpoint import gguf_tensors, is_gguf_file

# Checkpoint tensors that a rank loads a share of, along a dimension whose size the config gives: (name, dimension,
# the config's field). A config that gives less than the tensor holds would load a part of it without a word.
SIZES_THE_CONFIG_GIVES = [
    (re.compile(r"(embed_tokens|lm_head)\.weight$"), 0, "vocab_size"),
    (re.compile(r"experts\.\d+\.(gate_proj|up_proj)\.weight$"), 0, "moe_intermediate_size"),
    (re.compile(r"experts\.\d+\.down_proj\.weight$"), 1, "moe_intermediate_size"),
]


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor):
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str, config=None):
    """Copy a checkpoint (a folder of safetensors, or a GGUF file, whose Llama q/k rows need `config`'s head
    counts) into `model`, each tensor through its parameter's `weight_loader`; `packed_modules_mapping`
    routes checkpoint tensors into fused parameters, and the model's `route_weight` (where it has one) others,
    such as an expert's into stacked ones."""
    packed_modules_mapping = getattr(model, "packed_modules_mapping", {})
    route_weight = getattr(model, "route_weight", lambda name: None)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    tensors = gguf_tensors(path, config) if is_gguf_file(path) else folder_tensors(path)
    for weight_name, tensor in tensors:
        _check_size_the_config_gives(weight_name, tensor, config, path)
        param_name, shard_id = route_weight(weight_name) or _route(weight_name, packed_modules_mapping)
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {weight_name!r} matches no parameter of the model")
        param = params[param_name]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        args = () if shard_id is None else (shard_id,)
        try:
            weight_loader(param, tensor, *args)
        except RuntimeError as error:  # a size mismatch, from copy_ or a shard's narrow
            raise ValueError(f"checkpoint {path!r}: tensor {weight_name!r} of shape {tuple(tensor.shape)} does not "
                             f"fit the model's {param_name!r} of shape {tuple(param.shape)} (does config.json "
                             f"match the weights?)") from error
        loaded.add(param_name)
    _check_all_loaded(model, params, loaded, path)


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


def _check_all_loaded(model: nn.Module, params: dict, loaded: set, path: str):
    # A tied parameter is loaded under either of its names.
    loaded_ids = {id(params[name]) for name in loaded}
    missing = [name for name, param in model.named_parameters() if id(param) not in loaded_ids]
    missing += [f"{name}.{piece}" for name, module in model.named_modules() if hasattr(module, "missing_tensors")
                for piece in module.missing_tensors()]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(missing[:5])}")
