"""Each architecture of the model registry, on a tiny random checkpoint transformers writes: greedy tokens
against transformers' float32 forward on the same weights, through prefix hits, chunked prefill,
preemption and tensor_parallel_size=2 (gloo); and the architectures and configs the engine refuses."""
import json
import os

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import write_random_checkpoint

from conftest import TINY_MOE, assert_greedy_matches_transformers, mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=512, dtype="float32", device="cpu")
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)

CHECKPOINTS = {  # what each exercises beyond Qwen3's tiny_gqa
    "qwen2": dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=False),  # q/k/v biases, no q/k norm
    "llama3": dict(architecture="LlamaForCausalLM", rope_scaling=LLAMA3_ROPE, attention_bias=True, mlp_bias=True),
    "llama_mha": dict(architecture="LlamaForCausalLM", num_key_value_heads=4),  # SmolLM2/TinyLlama's shape
    "mistral": dict(architecture="MistralForCausalLM", sliding_window=None),
    "qwen3_moe": TINY_MOE,  # a mixture of experts in two of its three layers
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp(request.param)), initializer_range=0.1, seed=3,
                                   **CHECKPOINTS[request.param])


def greedy(path: str, prompts, **engine_args) -> list[list[int]]:
    with LLM(path, **{**ENGINE_ARGS, **engine_args}) as llm:
        return [out["token_ids"] for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_greedy_matches_transformers(checkpoint, hf_model_cache):
    """Through prefix hits (the mixed prompts share blocks), then chunked prefill and preemption."""
    prompts = mixed_prompts()
    completions = greedy(checkpoint, prompts)
    assert_greedy_matches_transformers(hf_model_cache, checkpoint, prompts, completions)
    assert greedy(checkpoint, prompts, max_num_batched_tokens=40, num_kvcache_blocks=40) == completions


def test_two_ranks_give_one_ranks_tokens(checkpoint):
    prompts = mixed_prompts()[:6]
    assert greedy(checkpoint, prompts, tensor_parallel_size=2) == greedy(checkpoint, prompts)


def test_llama3_rotary_is_transformers(tmp_path):
    """The scaled frequencies against transformers' own llama3 rope initialisation."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanovllm.layers.rotary_embedding import rotary_embedding
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                         rope_scaling=LLAMA3_ROPE)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    positions = torch.arange(256, dtype=torch.float)
    want = torch.outer(positions, inv_freq)
    cos, sin = rotary_embedding(config, 16).cos_sin_cache.squeeze(1).chunk(2, dim=-1)
    torch.testing.assert_close(cos, want.cos())
    torch.testing.assert_close(sin, want.sin())
    assert not torch.allclose(inv_freq, 1.0 / 500000.0 ** (torch.arange(0, 16, 2) / 16))  # it is scaled


def rewrite_config(path: str, **changes) -> str:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["GPT2LMHeadModel"]),
     "architecture GPT2LMHeadModel is not supported; supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
     "Qwen2ForCausalLM, LlamaForCausalLM"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
    (dict(sliding_window=128), "sliding_window=128 is below max_model_len=512"),
])
def test_unsupported_checkpoints_are_refused_before_any_work(tmp_path, changes, message):
    path = write_random_checkpoint(str(tmp_path), architecture="MistralForCausalLM", sliding_window=None)
    with pytest.raises(ValueError, match=message):
        LLM(rewrite_config(path, **changes), **ENGINE_ARGS)
