"""What the GPU tests share: prompts, transformers' float32 reference, and "the same greedy tokens".

Two bf16 runs whose batches differ in shape (another batch size, chunks, a cache hit, graphs, two ranks)
may round differently, and greedy decoding follows such a difference only where two tokens nearly tie.
So "the same greedy tokens" means identical, or first parting at a token where both choices lie within
TOLERANCE of the float32 reference's maximum logit; the count of identical sequences is printed (-s).
"""
import math

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import QWEN3_0_6B

import conftest

TOLERANCE = 0.1  # logits: a greedy token may fall this far below the float32 reference's maximum
BASE = dict(max_model_len=2048, max_num_seqs=24, max_num_batched_tokens=4096)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
# Four of these cross a block boundary while decoding (needed for preemption); four have full blocks to cache.
GREEDY_PROMPT_LENS = [9, 40, 200, 230, 300, 470, 500, 777]


def random_prompts(lens: list[int], seed: int) -> list[list[int]]:
    return conftest.random_prompts(lens, seed, vocab_size=QWEN3_0_6B["vocab_size"])


PROMPTS = random_prompts(GREEDY_PROMPT_LENS, seed=1)


class Reference:
    """transformers' float32 forward on the checkpoint's weights (`gguf_file=` for a GGUF file in `path`)."""

    def __init__(self, path: str, **from_pretrained):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **from_pretrained).cuda().eval()

    def logits(self, token_ids: list[int], last: int = 0) -> torch.Tensor:
        """[num_tokens, vocab], or of the last `last` tokens alone (a long prompt's logits take GBs)."""
        return reference_logits(self.model, token_ids, last, "cuda")

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """The float32 argmax token after token, num_tokens of them (on past any end of sequence, which
        transformers' generate would stop at or, with min_new_tokens, ban)."""
        tokens = list(prompt)
        for _ in range(num_tokens):
            tokens.append(int(self.logits(tokens, last=1)[-1].argmax()))
        return tokens[len(prompt):]

    def max_deficit(self, prompt: list[int], completion: list[int]) -> float:
        """Teacher-forced: how far below the maximum logit the worst chosen token lies."""
        logits = self.logits(prompt + completion[:-1], last=len(completion))
        chosen = logits[torch.arange(len(completion)), torch.tensor(completion, device="cuda")]
        return (logits.max(dim=-1).values - chosen).max().item()


REFERENCE_CHUNK = 4096  # tokens a reference forward takes at once: float32 attention over 32k keys would take 64 GB


@torch.inference_mode()
def reference_logits(model, token_ids: list[int], last: int, device) -> torch.Tensor:
    """A transformers model's float32 logits of token_ids ([num_tokens, vocab], or of the last `last` alone), the
    tokens taken REFERENCE_CHUNK at a time over the model's own KV cache past that length."""
    from transformers import DynamicCache
    ids = torch.tensor([token_ids], device=device)
    if len(token_ids) <= REFERENCE_CHUNK:
        return model(ids, logits_to_keep=last).logits[0].float()
    first_kept = len(token_ids) - (last or len(token_ids))
    cache, parts = DynamicCache(), []
    for start in range(0, len(token_ids), REFERENCE_CHUNK):
        end = min(start + REFERENCE_CHUNK, len(token_ids))
        keep = end - max(start, first_kept)
        logits = model(ids[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=max(keep, 1)).logits
        if keep > 0:
            parts.append(logits[0].float())
    return torch.cat(parts)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> tuple[list[list[int]], int]:
    """The completions, in the prompts' order, and the number of prompt tokens computed."""
    num_prompt_tokens = 0
    schedule = llm.scheduler.schedule

    def counting_schedule():
        nonlocal num_prompt_tokens
        out = schedule()
        num_prompt_tokens += sum(count for seq, computed, count in zip(out.seqs, out.num_computed, out.num_scheduled)
                                 if computed < seq.num_prompt_tokens)
        return out

    llm.scheduler.schedule = counting_schedule
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.scheduler.schedule
    return [out.outputs[0].token_ids for out in outputs], num_prompt_tokens


def bf16_spacing(value: float) -> float:
    """The distance between neighbouring bf16 numbers at |value| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 2.0 ** -126))) - 7)


def assert_same_greedy(reference: Reference, prompts, got, want, what: str, logits_in_bf16: bool = False):
    """`logits_in_bf16`: a trained model's logits (tens, not tenths, as random weights give) are rounded
    to bf16's spacing at their size before the engine picks, so the tie margin widens by two spacings
    at the maximum logit."""
    partings = []
    for prompt, a, b in zip(prompts, got, want):
        assert len(a) == len(b)
        if a == b:
            continue
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        logits = reference.logits(prompt + b[:i], last=1)[-1]
        gap, top = (logits.max() - logits[[a[i], b[i]]].min()).item(), logits.max().item()
        tolerance = TOLERANCE + (2 * bf16_spacing(top) if logits_in_bf16 else 0.0)
        partings.append(f"at {i}, {gap:.4f} below the maximum {top:.2f} (margin {tolerance:.3f})")
        assert gap <= tolerance, f"{what}: tokens part at position {i}, {gap:.3f} below the reference's maximum"
    print(f"\n{what}: {len(prompts) - len(partings)}/{len(prompts)} sequences identical; parting {partings}")
