"""Engine arguments as vLLM takes them: its dtype names, and max_model_len against the model's limit."""
import re

import pytest
import torch

from nanovllm.config import Config
from nanovllm.utils.checkpoint import write_random_checkpoint

# --- dtype ---

@pytest.mark.parametrize("dtype, torch_dtype", [
    ("half", torch.float16), ("float16", torch.float16), ("float", torch.float32), ("float32", torch.float32),
    ("bfloat16", torch.bfloat16), ("auto", torch.float32),  # the tiny checkpoint is float32
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
])
def test_dtype_names(tiny_gqa, dtype, torch_dtype):
    assert Config(tiny_gqa, device="cpu", dtype=dtype).torch_dtype == torch_dtype


@pytest.mark.parametrize("dtype", ["fp16", "int8", torch.int8])
def test_bad_dtype(tiny_gqa, dtype):
    with pytest.raises(ValueError, match=re.escape(f"dtype must be 'auto', one of ['bfloat16', 'float', 'float16', "
                                                   f"'float32', 'half'] or a torch dtype of those, got {dtype!r}")):
        Config(tiny_gqa, device="cpu", dtype=dtype)


# --- max_model_len ---

def test_max_model_len_default_is_capped_by_the_model(tiny_gqa):
    assert Config(tiny_gqa, device="cpu").max_model_len == 1024  # the tiny model's max_position_embeddings


def test_max_model_len_default_is_4096(tmp_path):
    path = write_random_checkpoint(str(tmp_path), max_position_embeddings=8192)
    assert Config(path, device="cpu").max_model_len == 4096


@pytest.mark.parametrize("max_model_len", [1, 512, 1024])
def test_max_model_len_up_to_the_model_limit(tiny_gqa, max_model_len):
    assert Config(tiny_gqa, device="cpu", max_model_len=max_model_len).max_model_len == max_model_len


def test_max_model_len_above_the_model_limit_is_refused(tiny_gqa):
    message = ("User-specified max_model_len (1025) is greater than the derived max_model_len "
               "(max_position_embeddings=1024 in the model's config.json)")
    with pytest.raises(ValueError, match=re.escape(message)):
        Config(tiny_gqa, device="cpu", max_model_len=1025)
