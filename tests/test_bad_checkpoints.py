"""A checkpoint folder whose files are broken or lie about each other is refused with a ValueError that names
the file and the problem, before any request is served: config.json, the tokenizer's files,
generation_config.json and the weights."""
import json
import os
import re
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import write_random_checkpoint

from conftest import TINY_MOE

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, device="cpu")


@pytest.fixture
def folder(tiny_gqa, tmp_path) -> str:
    """A copy of the tiny checkpoint, to break."""
    return shutil.copytree(tiny_gqa, tmp_path / "checkpoint", dirs_exist_ok=True).as_posix()


def edit_config(folder: str, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **changes}, f)


def refused(folder: str, message: str):
    """LLM(folder) raises a ValueError whose text matches `message` (a regular expression)."""
    with pytest.raises(ValueError, match=message) as caught:
        LLM(folder, **ENGINE_ARGS)
    return str(caught.value)


# (config.json's changes, what the error says after naming config.json)
BAD_CONFIGS = [
    (dict(hidden_size="64"), "hidden_size"),  # a string where a number goes
    (dict(num_attention_heads=4.0), "num_attention_heads"),
    (dict(vocab_size=None), "vocab_size"),
    (dict(num_hidden_layers=3), "layer_types"),  # two layer_types for three layers
    (dict(num_attention_heads=-4), "num_attention_heads must be a positive integer, got -4"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be a positive integer, got 0"),
    (dict(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a positive number, got nan"),
    (dict(architectures="Qwen3ForCausalLM"), "architectures must be a list of names"),
    (dict(dtype="int8"), "gives dtype torch.int8, not one this engine runs: pass dtype="),
    (dict(dtype="no_such_type"), "no_such_type"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}), "the rope's rope_theta must be a positive"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), "rope_theta must be a positive number, got"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}), "rope_theta must be a positive number"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope type 'yarn' is not supp"),
]


@pytest.mark.parametrize("changes, message", BAD_CONFIGS)
def test_a_config_json_that_cannot_describe_the_model_is_refused_by_name(folder, changes, message):
    edit_config(folder, **changes)
    refused(folder, "(?s)" + re.escape(os.path.join(folder, "config.json")) + ".*" + re.escape(message))


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]"])
def test_a_config_json_that_is_not_a_json_object_is_refused_by_name(folder, text):
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(text)
    refused(folder, re.escape(os.path.join(folder, "config.json")))


def test_a_folder_without_tokenizer_files_is_refused_naming_them(folder, tiny_gqa):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(folder, name))
    refused(folder, re.escape(f"tokenizer folder {folder!r} has none of the tokenizer's files (tokenizer.json, "
                              f"tokenizer_config.json"))
    with LLM(folder, tokenizer=tiny_gqa, **ENGINE_ARGS) as llm:  # a tokenizer named elsewhere serves it
        assert len(llm.tokenizer) == 512


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_a_json_file_that_is_not_json_is_refused_by_name(folder, name):
    with open(os.path.join(folder, name), "w") as f:
        f.write("{not json")
    refused(folder, re.escape(repr(os.path.join(folder, name))) + " cannot be read as JSON")


@pytest.mark.parametrize("values, message", [
    ({"temperature": "hot"}, "gives a default sampling value that is refused: temperature must be a number"),
    ({"top_p": 5}, "gives a default sampling value that is refused: top_p must be in (0, 1]"),
    ({"eos_token_id": "<|im_end|>"}, "eos_token_id must be a token id or a list of them"),
    ({"eos_token_id": [2, -1]}, "eos_token_id must be a token id or a list of them"),
])
def test_a_generation_config_with_values_the_engine_cannot_take_is_refused_by_name(folder, values, message):
    """Every request would take these defaults (or stop at these ids): refused when the engine starts."""
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(values, f)
    refused(folder, re.escape(repr(os.path.join(folder, "generation_config.json"))) + ".*" + re.escape(message))


@pytest.mark.parametrize("name, values, source", [
    ("generation_config.json", {"eos_token_id": [2, 600]}, "generation_config.json"),
    ("generation_config.json", {"eos_token_id": 2**70}, "generation_config.json"),
    ("config.json", {"eos_token_id": 99999}, "the model's config"),
    ("tokenizer_config.json", {"eos_token": "<no such token>"}, "the tokenizer's eos_token '<no such token>'"),
])
def test_an_end_of_sequence_id_outside_the_vocabulary_is_refused_naming_its_file(folder, name, values, source):
    """The model cannot sample it; a request with min_tokens failed on it, with the other requests of its step."""
    path = os.path.join(folder, name)
    with open(path) as f:
        content = json.load(f)
    with open(path, "w") as f:
        json.dump({**content, **values}, f)
    refused(folder, re.escape(source) + ".* gives the end-of-sequence token id .*, outside the model's vocabulary")


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_weights_that_are_not_floating_point_are_refused_naming_the_tensor(folder, dtype):
    from safetensors.torch import load_file, save_file
    weights = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    refused(folder, re.escape(f"checkpoint file {weights!r}: tensor 'model.norm.weight' holds {dtype}, not "
                              f"floating-point weights"))


def test_a_vocab_size_below_the_embeddings_rows_is_refused_naming_both(folder):
    edit_config(folder, vocab_size=256)  # the embedding has 512 rows; each token id below 256 would still load
    refused(folder, "tensor 'model.embed_tokens.weight' has 512 rows, but the model's config gives vocab_size=256")


def test_a_moe_intermediate_size_below_the_experts_is_refused_naming_both(tmp_path):
    """Each rank takes its rows of an expert's gate and up projections, its columns of the down projection."""
    folder = write_random_checkpoint(str(tmp_path), **TINY_MOE)  # moe_intermediate_size 32
    edit_config(folder, moe_intermediate_size=16)
    refused(folder, r"tensor 'model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight' has 32 columns, but the model's "
                    r"config gives moe_intermediate_size=16")


@pytest.mark.parametrize("field, value, tensors", [("intermediate_size", 64, "mlp.(gate|up|down)_proj"),
                                                    ("num_key_value_heads", 1, "self_attn.(k|v)_proj")])
def test_a_config_smaller_than_a_projections_weights_is_refused(folder, field, value, tensors):
    """Each rank, and each of q/k/v and gate/up, loads its share of a weight: a config that makes the whole
    smaller than the checkpoint's tensor would load a part of it."""
    edit_config(folder, **{field: value})
    refused(folder, rf"tensor 'model\.layers\.0\.{tensors}\.weight' of shape .* does not fit")


def edit_weights(folder: str, edit) -> str:
    """Rewrite the folder's weights through `edit` (a dict of tensors -> the tensors of each file by name)."""
    from safetensors.torch import load_file, save_file
    weights = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights)
    os.remove(weights)
    for name, file_tensors in edit(tensors).items():
        save_file(file_tensors, os.path.join(folder, name), metadata={"format": "pt"})
    return weights


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight"])
def test_a_missing_piece_of_a_fused_weight_is_refused_naming_it(folder, name):
    """q/k/v and gate/up load into one parameter each: the others' tensors loading must not hide a missing one."""
    edit_weights(folder, lambda tensors: {"model.safetensors": {k: v for k, v in tensors.items() if k != name}})
    refused(folder, re.escape(f"checkpoint {folder!r} lacks weights for: {name}"))


@pytest.mark.parametrize("name, shape", [("model.norm.weight", ()), ("model.norm.weight", (1, 64)),
                                         ("model.layers.0.self_attn.q_proj.weight", (1, 64)),
                                         ("model.layers.0.mlp.down_proj.weight", (64, 1))])
def test_a_tensor_that_would_broadcast_into_its_parameter_is_refused(folder, name, shape):
    """copy_ broadcasts a 0-d or (1, n) tensor over a whole parameter: such a file loaded without a word."""
    edit_weights(folder, lambda tensors: {"model.safetensors": {**tensors, name: torch.ones(shape)}})
    refused(folder, re.escape(f"tensor {name!r} of shape {shape} does not fit the model's"))


def test_a_tensor_in_two_files_is_refused_naming_it(folder):
    """The second file's copy would silently win (a stale consolidated file beside the shards, say)."""
    edit_weights(folder, lambda tensors: {"model-1.safetensors": tensors,
                                          "model-2.safetensors": {"model.norm.weight": tensors["model.norm.weight"]}})
    refused(folder, re.escape(f"checkpoint {folder!r} holds tensor 'model.norm.weight' twice"))


def test_rotary_buffers_some_checkpoints_store_are_skipped(folder, tiny_gqa):
    """Older Llama conversions store rotary_emb.inv_freq (or cos/sin caches); vLLM skips them, as the engine does."""
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.{kind}": torch.ones(8) for i in range(2)
               for kind in ("inv_freq", "cos_cached", "sin_cached")}
    edit_weights(folder, lambda tensors: {"model.safetensors": {**tensors, **buffers}})
    greedy = SamplingParams(temperature=0, max_tokens=8)
    with LLM(folder, **ENGINE_ARGS) as llm:
        got = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        assert got == llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
