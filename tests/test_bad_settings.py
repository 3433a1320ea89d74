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
