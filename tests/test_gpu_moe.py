"""Qwen3-MoE on CUDA: the fused MoE kernels against a float32 per-expert loop at Qwen3-30B-A3B's layer shape
(128 experts of 768, 8 a token, hidden 2048) for 1 to 1,024 tokens; and a small random Qwen3-MoE checkpoint
in bf16 near transformers' float32 maximum, graphs (with the MoE layers inside) against eager.

Written after the session's device time was spent: not yet run on a GPU (issue 22's note says so).
"""
import pytest
import torch

from nanovllm import LLM

from gpu_helpers import BASE, GREEDY, PROMPTS, TOLERANCE, Reference, assert_same_greedy, generate

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flash_attn")

pytestmark = pytest.mark.gpu

SMALL_MOE = dict(architecture="Qwen3MoeForCausalLM", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, intermediate_size=1024, moe_intermediate_size=256,
                 num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[0], vocab_size=151936, max_position_embeddings=4096)


def float32_experts(x, w13, w2, weights, expert_ids) -> torch.Tensor:
    """The experts one after another in float32, from the same bf16 weights."""
    from nanovllm.layers.moe import experts_loop
    return experts_loop(x.float(), w13.float(), w2.float(), weights, expert_ids)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 1024])
def test_fused_moe_at_qwen3_30b_a3b_shapes(num_tokens):
    from nanovllm.layers.fused_moe import fused_experts
    from nanovllm.layers.moe import route
    torch.manual_seed(num_tokens)
    num_experts, hidden, intermediate, top_k = 128, 2048, 768, 8
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device="cuda") / hidden**0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, intermediate, device="cuda") / intermediate**0.5).bfloat16()
    weights, expert_ids = route(torch.randn(num_tokens, num_experts, device="cuda"), top_k, renormalise=True)
    got = fused_experts(x, w13, w2, weights, expert_ids).float()
    want = float32_experts(x, w13, w2, weights, expert_ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory) -> str:
    from nanovllm.utils.checkpoint import write_random_checkpoint
    return write_random_checkpoint(str(tmp_path_factory.mktemp("small_moe")), torch.bfloat16, **SMALL_MOE)


def test_moe_greedy_near_reference_and_graphs_match_eager(small_moe):
    with LLM(small_moe, **BASE) as llm:
        graph_tokens, _ = generate(llm, PROMPTS, GREEDY)
    with LLM(small_moe, enforce_eager=True, num_kvcache_blocks=64, **BASE) as llm:
        eager_tokens, _ = generate(llm, PROMPTS, GREEDY)
    reference = Reference(small_moe)
    for prompt, completion in zip(PROMPTS, graph_tokens):
        assert reference.max_deficit(prompt, completion) < TOLERANCE
    assert_same_greedy(reference, PROMPTS, graph_tokens, eager_tokens, "MoE graphs against eager")
