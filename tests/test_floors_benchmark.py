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


def test_a_workload_floor_walks_its_decode_steps(monkeypatch):
    """Two sequences worked by hand: prompts of 10 and 20 tokens, 3 and 1 output tokens. Only the first decodes,
    twice (its first token comes with the prompt), over 11 then 12 keys of Qwen3-0.6B's 28 x 8 x 128 heads."""
    from benchmarks import floors
    from benchmarks.workloads import Workload
    monkeypatch.setattr(floors, "make_workload", lambda name: Workload(name, [[1] * 10, [1] * 20], [3, 1]))
    shapes = Shapes(SimpleNamespace(**REAL_DIMENSIONS["qwen3-0.6b"]))
    weights = shapes.decode_bytes(1, 0)
    kv_token = 28 * 2 * 8 * 128 * 2  # layers, K and V, KV heads, head_dim, bf16's bytes
    decode_s = (2 * weights + (11 + 12) * kv_token) / 4.8e12
    prefill_s = (shapes.prefill_flops(10) * 10 + shapes.prefill_flops(20) * 20) / 989e12
    floor = floors.workload_floor(shapes, "two", weight_bytes=2)
    assert floor["floor_s"] == pytest.approx(decode_s + prefill_s, rel=1e-9)
    assert floor["out_tok_per_s"] == pytest.approx(4 / (decode_s + prefill_s), rel=1e-9)


def test_a_workload_floor_counts_a_cached_prefix_once():
    """Prefix caching: a prompt's leading full blocks of 256 that an earlier prompt holds are not computed again;
    its partial last block always is."""
    from benchmarks.floors import uncached_lens
    shared = list(range(600))
    assert uncached_lens([shared + [1], shared + [2], shared[:300], [9] * 100]) == [601, 89, 44, 100]
