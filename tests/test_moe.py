"""Qwen3-MoE (`Qwen3MoeForCausalLM`) on a CPU, beyond what tests/test_architectures.py checks of every
architecture (greedy tokens against transformers through prefix hits, chunked prefill, preemption and two
ranks): its layers as the config says, random weights from its config alone (load_format="dummy"), and
its per-expert tensors routed, and missing ones named."""
import shutil

import pytest
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.layers.moe import expert_route
from nanovllm.utils.checkpoint import write_random_checkpoint

from conftest import TINY_MOE

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=512, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny_moe")), initializer_range=0.1, seed=6, **TINY_MOE)


def test_layers_follow_the_config(tiny_moe):
    with LLM(tiny_moe, **ENGINE_ARGS) as llm:
        layers = llm.executor.model_runner.model.model.layers
        kinds = [type(layer.mlp).__name__ for layer in layers]
    assert kinds == ["SparseMoeBlock", "DecoderMLP", "SparseMoeBlock"]  # mlp_only_layers=[1]


def test_dummy_weights_need_no_weight_files(tiny_moe, tmp_path):
    config_only = shutil.copytree(tiny_moe, tmp_path / "config_only", ignore=shutil.ignore_patterns("*.safetensors"))
    with LLM(str(config_only), load_format="dummy", **ENGINE_ARGS) as llm:
        assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == GREEDY.max_tokens


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
