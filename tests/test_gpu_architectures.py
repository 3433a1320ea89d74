"""The registry's other architectures on CUDA, on random checkpoints of real dimensions (Llama-3.2-1B's and
Qwen2.5-1.5B's): greedy tokens near transformers' float32 maximum, graphs against eager.

"""
import pytest
import torch

from nanovllm import LLM
from nanovllm.utils.checkpoint import random_checkpoint

import conftest
from gpu_helpers import BASE, GREEDY, GREEDY_PROMPT_LENS, TOLERANCE, Reference, assert_same_greedy, generate

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flash_attn")

pytestmark = pytest.mark.gpu

PROMPTS = conftest.random_prompts(GREEDY_PROMPT_LENS, seed=1, vocab_size=128256)  # within both vocabularies


@pytest.fixture(scope="module", params=["llama-3.2-1b", "qwen2.5-1.5b"])
def checkpoint(request, tmp_path_factory) -> str:
    return random_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)


def test_greedy_near_reference_and_graphs_match_eager(checkpoint):
    with LLM(checkpoint, **BASE) as llm:
        graph_tokens, _ = generate(llm, PROMPTS, GREEDY)
    with LLM(checkpoint, enforce_eager=True, num_kvcache_blocks=64, **BASE) as llm:
        eager_tokens, _ = generate(llm, PROMPTS, GREEDY)
    reference = Reference(checkpoint)
    for prompt, completion in zip(PROMPTS, graph_tokens):
        assert reference.max_deficit(prompt, completion) < TOLERANCE
    assert_same_greedy(reference, PROMPTS, graph_tokens, eager_tokens, "graphs against eager")
