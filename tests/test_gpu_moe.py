"""Qwen3-MoE's fused kernels on CUDA against a float32 per-expert loop at Qwen3-30B-A3B's layer shape (128
experts of 768, 8 a token, hidden 2048) for 1 to 1,024 tokens. (A small Qwen3-MoE model against transformers,
graphs against eager, is among tests/test_gpu_architectures.py's checkpoints.)
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu


def float32_experts(x, w13, w2, weights, expert_ids) -> torch.Tensor:
    """The experts one after another in float32, from the same bf16 weights."""
    from nanovllm.layers.moe import experts_loop
    return experts_loop(x.float(), w13.float(), w2.float(), weights, expert_ids)


def layer_inputs(num_tokens: int):
    """x, w13, w2, weights and expert_ids of Qwen3-30B-A3B's layer (128 experts of 768, top 8, hidden 2048), in bf16."""
    from nanovllm.layers.moe import route
    torch.manual_seed(num_tokens)
    num_experts, hidden, intermediate, top_k = 128, 2048, 768, 8
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device="cuda") / hidden**0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, intermediate, device="cuda") / intermediate**0.5).bfloat16()
    weights, expert_ids = route(torch.randn(num_tokens, num_experts, device="cuda"), top_k, renormalise=True)
    return x, w13, w2, weights, expert_ids


def every_tiles():
    from nanovllm.kernels.fused_moe import TILES_BY_PAIRS_PER_EXPERT
    return [None] + [tiles for _, tiles in TILES_BY_PAIRS_PER_EXPERT]


def tiles_id(tiles) -> str:
    return "chosen" if tiles is None else "x".join(map(str, tiles))


@pytest.mark.parametrize("tiles", every_tiles(), ids=tiles_id)
@pytest.mark.parametrize("num_tokens", [1, 4, 7, 64, 256, 1024])  # up to 4: fused_moe_few's kernels chosen
def test_fused_moe_at_qwen3_30b_a3b_shapes(num_tokens, tiles):
    """Every tile configuration the kernels may choose, at every token count (the chosen ones first)."""
    from nanovllm.kernels.fused_moe import fused_experts
    x, w13, w2, weights, expert_ids = layer_inputs(num_tokens)
    got = fused_experts(x, w13, w2, weights, expert_ids, tiles).float()
    want = float32_experts(x, w13, w2, weights, expert_ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_route_kernel_against_softmax_and_topk():
    from nanovllm.kernels import moe_route
    from nanovllm.layers import moe
    torch.manual_seed(0)
    logits = torch.randn(1024, 128, device="cuda") * 2
    weights, expert_ids = moe_route.route(logits, 8, renormalise=True)
    want_weights, want_ids = moe.route(logits, 8, renormalise=True)
    assert torch.equal(expert_ids, want_ids)
    torch.testing.assert_close(weights, want_weights)


@pytest.mark.parametrize("num_tokens", [1, 256])  # the one-row kernel, cuBLAS's matmul
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])  # as loaded, or a float32 copy
def test_router_logits_in_float32(num_tokens, weight_dtype):
    """The logits (bf16 input, float32 output) against float64: a bf16 weight's products are exact in float32."""
    from nanovllm.kernels.moe_route import router_logits
    torch.manual_seed(0)
    x = torch.randn(num_tokens, 2048, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(128, 2048, device="cuda") / 2048**0.5).to(weight_dtype)
    got = router_logits(x, weight)
    want = x.double() @ weight.double().T
    assert got.dtype == torch.float32 and ((got - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_few_token_path_rounds_as_the_aligned_path(num_tokens):
    """In bf16 the two paths round at the same points, so they differ only where a float32 sum's order tips
    a rounding: in few elements (a rounding step left out of either path would change most of them), by two
    units in the last place, or where the tipped rounding is of a term of the sum over the experts, by a
    small part of the row's size (where the terms cancel, more than a unit of the sum)."""
    from nanovllm.kernels.fused_moe import choose_tiles, fused_experts
    from nanovllm.kernels.fused_moe_few import few_token_experts
    x, w13, w2, weights, expert_ids = layer_inputs(num_tokens)
    few = few_token_experts(x, w13, w2, weights, expert_ids).float()
    aligned = fused_experts(x, w13, w2, weights, expert_ids, choose_tiles(expert_ids.numel(), w13.size(0))).float()
    assert (few != aligned).float().mean().item() < 0.05
    row_size = aligned.abs().mean(dim=1, keepdim=True)
    excess = (few - aligned).abs() - (aligned.abs() * 2**-6 + row_size * 2**-6)
    assert excess.max().item() <= 0, f"off by {excess.max().item()} beyond the bound"
