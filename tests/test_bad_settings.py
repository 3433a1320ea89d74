"""Bad engine settings raise before any work starts and leave nothing running behind."""
import json
import os

import pytest

from nanovllm import LLM

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, device="cpu")


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_model_folder_without_weights(tmp_path, tiny_gqa):
    with open(os.path.join(tiny_gqa, "config.json")) as f:
        (tmp_path / "config.json").write_text(json.dumps(json.load(f)))
    with pytest.raises(ValueError, match="holds no .*safetensors weights"):
        LLM(str(tmp_path))


def test_tensor_parallel_size_must_divide_heads(tiny_gqa):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads=4"):
        LLM(tiny_gqa, tensor_parallel_size=3, device="cpu")


def test_tensor_parallel_size_must_divide_the_vocabulary(tmp_path):
    """Each rank holds an equal share of the embedding's rows."""
    from nanovllm.utils.checkpoint import write_random_checkpoint
    path = write_random_checkpoint(str(tmp_path), vocab_size=513)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's vocab_size=513"):
        LLM(path, tensor_parallel_size=2, device="cpu")


def test_unknown_engine_argument(tiny_gqa):
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_sequences'"):
        LLM(tiny_gqa, max_num_sequences=8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kvcache_block_size=24), "kvcache_block_size must be a positive multiple of 16"),
    (dict(dtype="int8"), "dtype must be"),
    (dict(num_kvcache_blocks=2), "KV cache holds 2 blocks"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
])
def test_bad_engine_settings(tiny_gqa, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_gqa, **{**ENGINE_ARGS, **kwargs})


def test_a_second_engine_after_a_failed_start_works(tiny_gqa):
    with pytest.raises(ValueError):
        LLM(tiny_gqa, **{**ENGINE_ARGS, "num_kvcache_blocks": 2})
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        assert llm.generate([[1, 2]], use_tqdm=False)[0]["token_ids"]


def copied_checkpoint(source: str, folder) -> str:
    import shutil
    shutil.copytree(source, folder, dirs_exist_ok=True)
    return str(folder)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_bad_checkpoints_are_refused_naming_the_file_and_tensor(tmp_path, tiny_gqa, tensor_parallel_size):
    """A truncated safetensors file, a config whose sizes do not fit the tensors, a missing tensor, a vocab_size
    below the embedding's rows; each refused by name, in the engine's process or a worker's, as the same
    ValueError, and a good engine starts after them."""
    from safetensors.torch import load_file, save_file
    args = {**ENGINE_ARGS, "tensor_parallel_size": tensor_parallel_size}
    truncated = copied_checkpoint(tiny_gqa, tmp_path / "truncated")
    weights = os.path.join(truncated, "model.safetensors")
    with open(weights, "rb") as f:
        head = f.read(os.path.getsize(weights) // 2)
    with open(weights, "wb") as f:
        f.write(head)
    with pytest.raises(ValueError, match="model.safetensors' is truncated or corrupt"):
        LLM(truncated, **args)
    misshapen = copied_checkpoint(tiny_gqa, tmp_path / "misshapen")
    with open(os.path.join(misshapen, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] *= 2
    with open(os.path.join(misshapen, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="tensor 'model.layers.0.mlp.* of shape .* does not fit the model's"):
        LLM(misshapen, **args)
    missing = copied_checkpoint(tiny_gqa, tmp_path / "missing")
    tensors = load_file(os.path.join(missing, "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, os.path.join(missing, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights for: model.norm.weight"):
        LLM(missing, **args)
    small_vocabulary = copied_checkpoint(tiny_gqa, tmp_path / "small_vocabulary")
    config["intermediate_size"] //= 2
    with open(os.path.join(small_vocabulary, "config.json"), "w") as f:
        json.dump({**config, "vocab_size": 256}, f)  # the embedding's 512 rows would load in part
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' has 512 rows, .* vocab_size=256"):
        LLM(small_vocabulary, **args)
    with LLM(tiny_gqa, **args) as llm:
        assert llm.generate([[1, 2]], use_tqdm=False)[0]["token_ids"]
