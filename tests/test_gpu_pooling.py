"""The pooling engine on CUDA: embeddings and classes of random checkpoints of Qwen3-0.6B's dimensions against
transformers' float32 on the same weights, within bf16's error, with prompts packed, chunked and from the prefix
cache."""
import pytest
import torch

from nanovllm import LLM
from nanovllm.utils.checkpoint import QWEN3_0_6B, write_random_checkpoint

import conftest

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytestmark = pytest.mark.gpu

PROMPTS = conftest.random_prompts([16, 100, 300, 513, 1000, 2000], seed=3, vocab_size=151000)
ARGS = dict(runner="pooling", max_model_len=4096, max_num_batched_tokens=1024)  # the longest prompts in chunks


@pytest.mark.parametrize("architecture, pooling_type", [("Qwen3ForCausalLM", "LAST"), ("Qwen3ForCausalLM", "MEAN"),
                                                       ("Qwen3ForSequenceClassification", "LAST")])
def test_pooling_on_cuda_against_transformers_in_float32(tmp_path, architecture, pooling_type):
    """MEAN prefills each prompt whole (max_num_batched_tokens raised to max_model_len), without the cache."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    classifier = architecture.endswith("Classification")
    dims = {**QWEN3_0_6B, "num_hidden_layers": 8, **({"num_labels": 4} if classifier else {})}
    path = write_random_checkpoint(str(tmp_path), torch.bfloat16, architecture=architecture, **dims)
    with LLM(path, **ARGS, pooler_config={"pooling_type": pooling_type}) as llm:
        method = llm.classify if classifier else llm.embed
        got = [method(PROMPTS, use_tqdm=False), method(PROMPTS[::-1], use_tqdm=False)[::-1]]  # the second cached
    model_class = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    reference = model_class.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for i, prompt in enumerate(PROMPTS):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device="cuda")
            want = reference(ids).logits[0].softmax(-1) if classifier else \
                torch.nn.functional.normalize(pooled(reference.model(ids).last_hidden_state[0], pooling_type), dim=0)
        for outputs in got:
            values = torch.tensor(outputs[i].outputs.probs if classifier else outputs[i].outputs.embedding,
                                  device="cuda")
            if classifier:
                assert (values - want).abs().max() < 2e-2
            else:
                assert torch.dot(values, want).item() > 0.999  # the cosine, both of unit length


def pooled(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return states.mean(0) if pooling_type == "MEAN" else states[-1]
