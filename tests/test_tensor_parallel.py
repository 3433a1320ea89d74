"""tensor_parallel_size=2 on a CPU (gloo, two processes) against one process; clean shutdown."""
import multiprocessing
import os

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence

from conftest import mixed_prompts

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=48, max_model_len=512, dtype="float32", device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy_tokens(path, tensor_parallel_size, **kwargs):
    with LLM(path, tensor_parallel_size=tensor_parallel_size, **{**ENGINE_ARGS, **kwargs}) as llm:
        return [out["token_ids"] for out in llm.generate(mixed_prompts(), GREEDY, use_tqdm=False)]


def test_two_ranks_match_one(tiny_gqa):
    # 48 blocks of 16 force preemption; shared prefixes give cache hits on both ranks.
    assert greedy_tokens(tiny_gqa, 2) == greedy_tokens(tiny_gqa, 1)


def test_two_ranks_match_one_untied_chunked(tiny_mha):
    args = dict(max_num_batched_tokens=100, num_kvcache_blocks=256)
    assert greedy_tokens(tiny_mha, 2, **args) == greedy_tokens(tiny_mha, 1, **args)


def listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    if state == "0A":  # LISTEN
                        ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def nanovllm_shared_memory() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith("nanovllm")]


def test_engines_one_after_another_leave_nothing_behind(tiny_gqa):
    shm_before = nanovllm_shared_memory()
    for _ in range(2):
        with LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS) as llm:
            assert nanovllm_shared_memory() != shm_before
            assert len(multiprocessing.active_children()) == 1
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
            port = llm.executor.port
        assert not multiprocessing.active_children()
        assert nanovllm_shared_memory() == shm_before
        assert port not in listening_ports()
    llm = LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS)
    llm.exit()
    llm.exit()  # a second exit is harmless
    assert not multiprocessing.active_children()


class SequenceThatFailsInWorkers(Sequence):
    """Rank 0 uses it as it is; a worker fails while unpickling its step."""

    def __setstate__(self, state):
        raise RuntimeError("injected fault in a worker")


def test_worker_error_reaches_the_caller_and_leaves_nothing_behind(tiny_gqa):
    shm_before = nanovllm_shared_memory()
    llm = LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS)
    port = llm.executor.port
    llm.scheduler.add(SequenceThatFailsInWorkers([1, 2, 3], GREEDY))
    with pytest.raises(RuntimeError, match="(?s)tensor-parallel rank 1 failed.*injected fault in a worker"):
        llm.step()
    assert not multiprocessing.active_children()
    assert nanovllm_shared_memory() == shm_before
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    llm.exit()
    assert port not in listening_ports()
    with LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS) as fresh:
        assert len(fresh.generate([[1, 2]], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens
