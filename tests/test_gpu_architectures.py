"""The registry's other architectures on CUDA, on random checkpoints of real dimensions (Llama-3.2-1B's and
Qwen2.5-1.5B's): greedy tokens near transformers' float32 maximum, graphs against eager.

Written in the session that added the architectures, after its device time was spent: not yet run on a
GPU (issue 21's closing note).
"""
import pytest
import torch

from nanovllm import LLM

from gpu_helpers import BASE, GREEDY, PROMPTS, TOLERANCE, Reference, assert_same_greedy, generate

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flash_attn")

pytestmark = pytest.mark.gpu

LLAMA_3_2_1B = dict(architecture="LlamaForCausalLM", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                    tie_word_embeddings=True, max_position_embeddings=131072,
                    rope_scaling=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192))
QWEN2_5_1_5B = dict(architecture="Qwen2ForCausalLM", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, head_dim=128, intermediate_size=8960, vocab_size=151936,
                    tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0)


@pytest.fixture(scope="module", params=["llama_3_2_1b", "qwen2_5_1_5b"])
def checkpoint(request, tmp_path_factory) -> str:
    from nanovllm.utils.checkpoint import write_random_checkpoint
    dims = {"llama_3_2_1b": LLAMA_3_2_1B, "qwen2_5_1_5b": QWEN2_5_1_5B}[request.param]
    return write_random_checkpoint(str(tmp_path_factory.mktemp(request.param)), torch.bfloat16, **dims)


def test_greedy_near_reference_and_graphs_match_eager(checkpoint):
    with LLM(checkpoint, **BASE) as llm:
        graph_tokens, _ = generate(llm, PROMPTS, GREEDY)
    with LLM(checkpoint, enforce_eager=True, num_kvcache_blocks=64, **BASE) as llm:
        eager_tokens, _ = generate(llm, PROMPTS, GREEDY)
    reference = Reference(checkpoint)
    for prompt, completion in zip(PROMPTS, graph_tokens):
        assert reference.max_deficit(prompt, completion) < TOLERANCE
    assert_same_greedy(reference, PROMPTS, graph_tokens, eager_tokens, "graphs against eager")
