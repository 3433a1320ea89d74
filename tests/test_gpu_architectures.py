"""The registry's other architectures on CUDA, on random checkpoints of real dimensions (Llama-3.2-1B's and
Qwen2.5-1.5B's) and a small Qwen3-MoE (its MoE layers inside the graphs): greedy tokens near transformers'
float32 maximum, graphs against eager; and, where two GPUs are there, two ranks against transformers and
against one rank.
"""
import pytest
import torch

from nanovllm import LLM
from nanovllm.utils.checkpoint import random_checkpoint, write_random_checkpoint

import conftest
from gpu_helpers import BASE, GREEDY, GREEDY_PROMPT_LENS, TOLERANCE, Reference, assert_same_greedy, generate

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu

PROMPTS = conftest.random_prompts(GREEDY_PROMPT_LENS, seed=1, vocab_size=128256)  # within every vocabulary
SMALL_MOE = dict(architecture="Qwen3MoeForCausalLM", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, intermediate_size=1024, moe_intermediate_size=256,
                 num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[0], vocab_size=151936, max_position_embeddings=4096)


@pytest.fixture(scope="module", params=["llama-3.2-1b", "qwen2.5-1.5b", "small-qwen3-moe"])
def checkpoint(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "small-qwen3-moe":
        return write_random_checkpoint(path, torch.bfloat16, **SMALL_MOE)
    return random_checkpoint(path, request.param)


def test_greedy_near_reference_and_graphs_match_eager(checkpoint):
    with LLM(checkpoint, **BASE) as llm:
        graph_tokens, _ = generate(llm, PROMPTS, GREEDY)
    with LLM(checkpoint, enforce_eager=True, num_kvcache_blocks=64, **BASE) as llm:
        eager_tokens, _ = generate(llm, PROMPTS, GREEDY)
    reference = Reference(checkpoint)
    for prompt, completion in zip(PROMPTS, graph_tokens):
        assert reference.max_deficit(prompt, completion) < TOLERANCE
    assert_same_greedy(reference, PROMPTS, graph_tokens, eager_tokens, "graphs against eager")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_ranks_near_reference_and_as_one_rank(checkpoint):
    with LLM(checkpoint, tensor_parallel_size=2, **BASE) as llm:
        two_ranks, _ = generate(llm, PROMPTS, GREEDY)
    with LLM(checkpoint, **BASE) as llm:
        one_rank, _ = generate(llm, PROMPTS, GREEDY)
    reference = Reference(checkpoint)
    for prompt, completion in zip(PROMPTS, two_ranks):
        assert reference.max_deficit(prompt, completion) < TOLERANCE
    assert_same_greedy(reference, PROMPTS, two_ranks, one_rank, "two ranks against one")
