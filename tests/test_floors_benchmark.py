"""benchmarks/floors.py's byte count of a decode step against the parameter counts Qwen publishes on its model
cards: Qwen3-30B-A3B 29.9B and Qwen3-8B 6.95B parameters outside the embeddings (both untied: the LM head is
the other 0.3B or 0.6B), which a step reads whole once a batch touches every expert."""
from types import SimpleNamespace

import pytest

from benchmarks.floors import Shapes, kv_token_bytes
from nanovllm.engine.config_builder import build_config
from nanovllm.utils.checkpoint import REAL_DIMENSIONS, write_random_checkpoint


@pytest.mark.parametrize("dims, non_embedding", [("qwen3-30b-a3b", 29.9e9), ("qwen3-8b", 6.95e9)])
def test_a_step_reads_the_published_parameters(dims, non_embedding):
    shapes = Shapes(SimpleNamespace(**REAL_DIMENSIONS[dims]))
    bf16 = shapes.decode_bytes(batch=4096, context=0)  # every expert touched, no KV cache
    assert bf16 == pytest.approx(2 * (non_embedding + shapes.vocab), rel=5e-3)
    # FP8 checkpoints keep the LM head (and the MoE router, 0.04% of the rest) in bf16
    fp8 = shapes.decode_bytes(batch=4096, context=0, weight_bytes=1)
    assert fp8 == pytest.approx(non_embedding + 2 * shapes.vocab, rel=5e-3)


def test_an_fp8_cache_counts_its_scales(tmp_path):
    dims = REAL_DIMENSIONS["qwen3-0.6b"]
    shapes = Shapes(SimpleNamespace(**dims))
    kv_values = 256 * 1000 * 28 * 2 * 8 * 128  # sequences, keys, layers, K and V, KV heads, head_dim
    weights = shapes.decode_bytes(256, 0)
    assert shapes.decode_bytes(256, 1000) - weights == pytest.approx(2 * kv_values)
    path = write_random_checkpoint(str(tmp_path), weights=False, **dims)
    config = build_config(path, device="cpu", kv_cache_dtype="fp8", load_format="dummy")
    fp8_cache = shapes.decode_bytes(256, 1000, kv_token_bytes=kv_token_bytes(config)) - weights
    assert fp8_cache == pytest.approx(kv_values * (128 + 4) / 128)
