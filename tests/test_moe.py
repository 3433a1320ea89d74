"""Qwen3-MoE (`Qwen3MoeForCausalLM`) on a CPU: a tiny random checkpoint transformers writes (8 experts, 2 a
token, a dense layer among the sparse ones) against transformers' float32 forward on the same weights,
through prefix hits, chunked prefill, preemption and two ranks; random weights from its config alone
(load_format="dummy"); and its per-expert tensors routed, and missing ones named."""
import shutil

import pytest
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.layers.moe import expert_route
from nanovllm.utils.checkpoint import write_random_checkpoint

from conftest import assert_greedy_matches_transformers, mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=512, dtype="float32", device="cpu")
TINY_MOE = dict(architecture="Qwen3MoeForCausalLM", num_hidden_layers=3, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny_moe")), initializer_range=0.1, seed=6, **TINY_MOE)


def greedy(path: str, prompts, **engine_args) -> list[list[int]]:
    with LLM(path, **{**ENGINE_ARGS, **engine_args}) as llm:
        return [out["token_ids"] for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_greedy_matches_transformers(tiny_moe, hf_model_cache):
    prompts = mixed_prompts()
    completions = greedy(tiny_moe, prompts)
    assert_greedy_matches_transformers(hf_model_cache, tiny_moe, prompts, completions)
    assert greedy(tiny_moe, prompts, max_num_batched_tokens=40, num_kvcache_blocks=40) == completions


def test_two_ranks_give_one_ranks_tokens(tiny_moe):
    """Each rank holds half of every expert's intermediate size."""
    prompts = mixed_prompts()[:6]
    assert greedy(tiny_moe, prompts, tensor_parallel_size=2) == greedy(tiny_moe, prompts)


def test_layers_follow_the_config(tiny_moe):
    with LLM(tiny_moe, **ENGINE_ARGS) as llm:
        layers = llm.executor.model_runner.model.model.layers
        kinds = [type(layer.mlp).__name__ for layer in layers]
    assert kinds == ["SparseMoeBlock", "DecoderMLP", "SparseMoeBlock"]  # mlp_only_layers=[1]


def test_dummy_weights_need_no_weight_files(tiny_moe, tmp_path):
    config_only = shutil.copytree(tiny_moe, tmp_path / "config_only", ignore=shutil.ignore_patterns("*.safetensors"))
    assert len(greedy(str(config_only), [[1, 2, 3]], load_format="dummy")[0]) == GREEDY.max_tokens


def test_expert_tensors_are_routed_to_the_stacked_parameters():
    assert expert_route("model.layers.3.mlp.experts.17.up_proj.weight") == ("model.layers.3.mlp.experts.w13",
                                                                            (17, "up_proj"))
    assert expert_route("model.layers.3.mlp.experts.0.down_proj.weight") == ("model.layers.3.mlp.experts.w2",
                                                                             (0, "down_proj"))
    assert expert_route("model.layers.3.mlp.gate.weight") is None
    assert expert_route("model.layers.1.mlp.up_proj.weight") is None  # a dense layer's


def test_a_missing_expert_tensor_is_named(tiny_moe, tmp_path):
    broken = shutil.copytree(tiny_moe, tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.2\.mlp\.experts\.5\.up_proj"):
        LLM(str(broken), **ENGINE_ARGS)
