"""llama.cpp's GGUF files as checkpoints, as vLLM takes them (`LLM("path/model.gguf")`): the config and the
tokenizer from the file's metadata, as transformers reads them, and the weights dequantized at load with
the `gguf` package's reader, under the engine's parameter names.

llama.cpp stores a Llama-family model's query and key projections with the rows of each head's two
rotary halves interleaved; `unpermute` undoes that exactly.
"""
import os
import re

import numpy as np
import torch

from nanovllm.utils.folder_checkpoint import check_config_values, folder_tokenizer

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "mistral": "MistralForCausalLM"}
# Weight types the loader takes (by GGMLQuantizationType name); others are refused by name.
WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's tensor names -> the engine's (checkpoint) names: whole, or within layer N (blk.N. -> model.layers.N.).
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
IN_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def is_gguf_file(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(os.path.expanduser(path))


def gguf_config(path: str):
    """The file's model config, as transformers reads it, with `architectures` set from its general.architecture."""
    from transformers import AutoConfig
    folder, name = os.path.split(os.path.abspath(path))
    architecture = gguf_architecture(path)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as error:  # transformers' many ways of failing on a bad file
        raise ValueError(f"GGUF file {path!r} cannot be read as a model config: {error}") from error
    config.architectures = [GGUF_ARCHITECTURES[architecture]]
    key_length = _field(path, f"{architecture}.attention.key_length")
    if key_length is not None:  # the head size, where transformers does not read it (Qwen3's default is 128)
        config.head_dim = key_length
    check_config_values(config, path)
    return config


def _field(path: str, key: str):
    """A scalar metadata value of the file (None where absent)."""
    field = _reader(path).fields.get(key)
    return None if field is None else field.parts[field.data[0]].tolist()[0]


def load_tokenizer(path: str, **kwargs):
    """The tokenizer of a folder, or of a GGUF file's metadata."""
    if not is_gguf_file(path):
        return folder_tokenizer(path, **kwargs)
    from transformers import AutoTokenizer
    folder, name = os.path.split(os.path.abspath(path))
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name, **kwargs)
    except Exception as error:  # transformers' many ways of failing on a bad file
        raise ValueError(f"GGUF file {path!r} holds no tokenizer transformers can read: {error}") from error


def gguf_architecture(path: str) -> str:
    field = _reader(path).fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r} holds architecture {architecture!r}; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    return architecture


def gguf_tensors(path: str, config):
    """(name, float32 tensor) for every weight of the file, dequantized, under the engine's names."""
    from gguf.quants import dequantize
    permuted = gguf_architecture(path) in ("llama", "mistral")
    tensors = _reader(path).tensors
    _readers.clear()  # the model is what needs the weights from now on: the file's map goes with the loop
    for tensor in tensors:
        name = checkpoint_name(tensor.name, path)
        if tensor.tensor_type.name not in WEIGHT_TYPES:
            raise ValueError(f"GGUF file {path!r}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                             f"not one of {', '.join(WEIGHT_TYPES)}")
        shape = [int(n) for n in reversed(tensor.shape)]
        weight = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)  # a copy
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            weight = unpermute(weight, heads)
        yield name, torch.from_numpy(weight)


def checkpoint_name(gguf_name: str, path: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base in TOP_LEVEL:
        return f"{TOP_LEVEL[base]}.{kind}"
    match = LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in IN_LAYER:
        raise ValueError(f"GGUF file {path!r}: tensor {gguf_name!r} matches no parameter of the model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{IN_LAYER[part]}.{kind}"


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of llama.cpp's permute: each head's rows back from (pair, half) to (half, pair) order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# The reader of the file last opened: parsing a file's metadata takes seconds for a large vocabulary, and the
# config, the architecture and the weights all read it.
_readers: dict[str, object] = {}


def _reader(path: str):
    from gguf import GGUFReader
    path = os.path.abspath(os.path.expanduser(path))
    if path not in _readers:
        try:
            _readers.clear()  # one file's memory map at a time
            reader = GGUFReader(path)
        except Exception as error:
            raise ValueError(f"GGUF file {path!r} is truncated or corrupt: {error}") from error
        _check_tensor_sizes(path, reader)
        _readers[path] = reader
    return _readers[path]


def _check_tensor_sizes(path: str, reader):
    """Each tensor's data, as its type and shape size it, fills the space up to the next one (or the file's end)
    but for the alignment's padding: a table that says F16 for F32 data, say, would read half of it."""
    tensors = sorted(reader.tensors, key=lambda tensor: tensor.data_offset)
    ends = [tensor.data_offset for tensor in tensors[1:]] + [len(reader.data)]
    for tensor, end in zip(tensors, ends):
        room = end - tensor.data_offset
        if not 0 <= room - tensor.n_bytes < reader.alignment:
            raise ValueError(f"GGUF file {path!r}: tensor {tensor.name!r} ({tensor.tensor_type.name}, shape "
                             f"{[int(n) for n in reversed(tensor.shape)]}) takes {tensor.n_bytes} bytes, but its data "
                             f"spans {room}: the file's tensor table does not match its data")
