"""A checkpoint folder as Hugging Face writes it: config.json, generation_config.json, the tokenizer's files and
*.safetensors weights, read as the engine needs them. Whatever goes wrong in reading one (a missing or
truncated file, text that is not JSON, a value of the wrong type or range, weights that are not floating
point) is a ValueError naming the file, as `gguf_checkpoint.py` gives for a GGUF file, in whichever process
reads it.
"""
import json
import os
from glob import glob

import torch
from safetensors import SafetensorError, safe_open

from nanovllm.utils.lean_imports import import_config_class, without_generation
from nanovllm.utils.quantization import ZERO_POINTS
from nanovllm.utils.rope_config import is_positive_number, rope_parameters

# Any of these makes a folder a tokenizer's; without them AutoTokenizer builds an empty one from config.json alone.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# config.json's sizes that the engine builds the model from: positive integers, where present.
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                  "max_position_embeddings")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts_per_tok",
                  "decoder_sparse_step")


def read_json(path: str) -> dict:
    """A JSON object from `path`."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path!r} cannot be read as JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path!r} holds a JSON {type(value).__name__}, not an object")
    return value


def folder_config(folder: str, trust_remote_code: bool = False):
    """The folder's config.json, as transformers reads it, its values checked."""
    from transformers import AutoConfig
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model folder {folder!r} has no config.json")
    values = read_json(path)
    try:
        with without_generation():
            import_config_class(values)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers' many ways of failing: OSError, strict-dataclass errors, ...
        raise ValueError(f"{path!r} cannot be read as a model config: {error}") from error
    check_config_values(config, path)
    return config


def check_config_values(config, source: str):
    """The values the model is built from have the types and ranges it needs and agree with each other;
    the ValueError names `source`, the file they were read from."""
    problem = _architectures_problem(config) or _sizes_problem(config) or _agreement_problem(config) or \
        _eps_problem(config) or _rope_problem(config)
    if problem is not None:
        raise ValueError(f"{source!r}: {problem}")


def _architectures_problem(config) -> str | None:
    names = getattr(config, "architectures", None)
    if names is not None and not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        return f"architectures must be a list of names, got {names!r}"
    return None


def _sizes_problem(config) -> str | None:
    for name in REQUIRED_SIZES + OPTIONAL_SIZES:
        value = getattr(config, name, None)
        if (value is not None or name in REQUIRED_SIZES) and not is_positive_int(value):
            return f"{name} must be a positive integer, got {value!r}"
    return None


def _agreement_problem(config) -> str | None:
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or 1
    if heads % kv_heads:
        return f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
    if getattr(config, "head_dim", None) is None and config.hidden_size % heads:
        return f"hidden_size={config.hidden_size} is not a multiple of num_attention_heads={heads} (and no head_dim)"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and len(layer_types) != config.num_hidden_layers:
        return f"num_hidden_layers={config.num_hidden_layers} but layer_types names {len(layer_types)} layers"
    experts, per_token = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", None)
    if experts and per_token and per_token > experts:
        return f"num_experts_per_tok={per_token} exceeds num_experts={experts}"
    return None


def _eps_problem(config) -> str | None:
    eps = getattr(config, "rms_norm_eps", 1e-6)
    if not is_positive_number(eps):
        return f"rms_norm_eps must be a positive number, got {eps!r}"
    return None


def _rope_problem(config) -> str | None:
    try:
        rope_parameters(config)
    except ValueError as error:
        return str(error)
    return None


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_tokenizer_files(folder: str):
    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"tokenizer folder {folder!r} has none of the tokenizer's files "
                         f"({', '.join(TOKENIZER_FILES)}): give tokenizer= a folder or repo id that has them")


def folder_tokenizer(folder: str, **kwargs):
    """The folder's tokenizer, as AutoTokenizer loads it; one without a vocabulary is refused."""
    check_tokenizer_files(folder)
    try:
        with without_generation():
            from transformers import AutoTokenizer
            import_config_class(_config_values(folder))
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as error:  # a file that is not JSON, a class transformers lacks, a missing vocabulary file
        for name in TOKENIZER_JSON_FILES:  # the file at fault, where it is one of these
            if os.path.isfile(os.path.join(folder, name)):
                read_json(os.path.join(folder, name))
        raise ValueError(f"tokenizer folder {folder!r} cannot be loaded: {error}") from error
    if len(tokenizer) <= 1:
        raise ValueError(f"tokenizer folder {folder!r} loads as an empty tokenizer ({len(tokenizer)} token): "
                         f"give tokenizer= a folder or repo id with the tokenizer's files")
    return tokenizer


def _config_values(folder: str) -> dict:
    """The folder's config.json, which AutoTokenizer reads too; {} where it has none AutoTokenizer could read."""
    try:
        return read_json(os.path.join(folder, "config.json"))
    except ValueError:
        return {}


def folder_tensors(folder: str):
    """(name, tensor) for every weight of the folder's *.safetensors files; one that is not floating point is
    refused, since copying it into a parameter would make numbers of its integers."""
    for file in sorted(glob(os.path.join(folder, "*.safetensors"))):
        try:
            with safe_open(file, "pt", "cpu") as f:
                for name in list(f.keys()):
                    yield name, checked_tensor(file, name, f.get_tensor(name))
        except (OSError, SafetensorError) as error:
            raise ValueError(f"checkpoint file {file!r} is truncated or corrupt: {error}") from error


def checked_tensor(file: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point() and not name.endswith(ZERO_POINTS):
        raise ValueError(f"checkpoint file {file!r}: tensor {name!r} holds {tensor.dtype}, not floating-point "
                         f"weights (a quantized checkpoint?): this engine loads unquantized weights only")
    return tensor
