"""How much GPU memory the KV cache takes, worked by hand with the CUDA memory queries faked."""
import pytest
import torch

from nanovllm.config import Config
from nanovllm.engine import kv_cache

GIB = 2**30


class FakeGpu:
    """A GPU of `total` bytes: what other engines use, and this engine's allocator (reserved, allocated)."""

    def __init__(self, total: int, used_by_others: int):
        self.total, self.used_by_others, self.reserved, self.allocated = total, used_by_others, 0, 0

    def mem_get_info(self, device=None):
        return self.total - self.used_by_others - self.reserved, self.total


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu(total=100 * GIB, used_by_others=0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: fake.reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: fake.allocated)
    return fake


def available(config, gpu, weights: int, unused_reserve: int) -> int:
    """Start an engine on the fake GPU: it loads `weights`, its allocator keeps `unused_reserve` more."""
    free_at_start = kv_cache.free_gpu_bytes(torch.device("cuda"))
    gpu.allocated += weights
    gpu.reserved += weights + unused_reserve
    return kv_cache.available_gpu_bytes(config, torch.device("cuda"), free_at_start)


def test_alone_the_engine_takes_its_share_of_the_gpu_less_its_weights(gpu, tiny_gqa):
    config = Config(tiny_gqa, device="cpu", gpu_memory_utilization=0.9)
    # 90 GiB of the 100, less 2 GiB of weights; the 3 GiB its allocator holds unused count as its own.
    assert available(config, gpu, weights=2 * GIB, unused_reserve=3 * GIB) == 88 * GIB


def test_beside_another_engine_it_sizes_from_what_is_left(gpu, tiny_gqa):
    config = Config(tiny_gqa, device="cpu", gpu_memory_utilization=0.9)
    gpu.used_by_others = 90 * GIB  # the first engine of the notebook, still alive
    assert available(config, gpu, weights=2 * GIB, unused_reserve=0) == int(0.9 * 10 * GIB) - 2 * GIB


def test_a_pooling_engine_holds_what_its_steps_can_fill(tiny_gqa):
    """One max_model_len prompt (1024 tokens: 64 blocks of 16) and two steps in flight of max_num_batched_tokens (64:
    4 blocks) with a part-filled block for each of up to max_num_seqs=8 prompts: 64 + 2 * (4 + 8); a generating
    engine holds CPU_KVCACHE_BYTES."""
    from nanovllm import LLM
    sizes = dict(max_model_len=1024, max_num_batched_tokens=64, kvcache_block_size=16, max_num_seqs=8, device="cpu")
    with LLM(tiny_gqa, runner="pooling", **sizes) as llm:
        assert llm.executor.num_kvcache_blocks == 88
    with LLM(tiny_gqa, **sizes) as llm:
        assert llm.executor.num_kvcache_blocks == kv_cache.CPU_KVCACHE_BYTES // kv_cache.block_bytes(llm.config)
