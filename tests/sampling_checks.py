"""References for the sampler, shared by the CPU tests and the GPU tests: vLLM's filters by a full sort in
float64, Pearson's test, and the logits processors of transformers on the same logits."""
import dataclasses
import math
from collections import Counter

import torch

from nanovllm.engine.device_inputs import DeviceInputs
from nanovllm.engine.sampling_inputs import slot_joins
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

EOS = 2

# One request for each of SamplingParams' features, seeded where it samples: what two ranks must give as one.
EVERY_FEATURE = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=2),
    SamplingParams(temperature=1.0, min_p=0.05, seed=3),
    SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=4),
    SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, seed=5),
    SamplingParams(temperature=0.9, logit_bias={7: 4.0, 11: -100.0}, seed=6),
    SamplingParams(temperature=0.9, allowed_token_ids=list(range(50, 90)), seed=7),
    SamplingParams(temperature=0.9, bad_words=["the model", "cache"], seed=8),
    SamplingParams(temperature=1.0, min_tokens=12, stop_token_ids=[9, 10, 11, 12], seed=9),
    SamplingParams(temperature=0.8, logprobs=3, prompt_logprobs=2, seed=10),
    SamplingParams(temperature=0),
]


def with_length(params: SamplingParams, max_tokens: int) -> SamplingParams:
    """params, to generate max_tokens tokens (past any end of sequence, unless it stops on its own ids)."""
    return dataclasses.replace(params, max_tokens=max_tokens, ignore_eos=not params.stop_token_ids)


def reference_distribution(logits: torch.Tensor, temperature, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """vLLM's order in float64: softmax(logits / T), then min_p, top_k, and top_p on what is left."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if min_p:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    sorted_probs, order = probs.sort(descending=True)
    ranks = torch.arange(len(probs), device=probs.device)
    keep = sorted_probs > 0
    if top_k > 0:
        keep &= ranks < top_k
    sorted_probs = torch.where(keep, sorted_probs, 0.0)
    mass_above = sorted_probs.cumsum(0) - sorted_probs
    keep &= mass_above < top_p * sorted_probs.sum()
    kept = torch.zeros_like(keep).scatter_(0, order, keep)
    probs = torch.where(kept, probs, 0.0)
    return probs / probs.sum()


def chi_square_p_value(counts: Counter, probs: torch.Tensor, num_draws: int) -> float:
    """Pearson's test; tokens expected fewer than 5 times are pooled. Wilson-Hilferty for the tail."""
    probs = probs.cpu()
    expected = probs * num_draws
    big = (expected >= 5).nonzero().flatten().tolist()
    cells = [(counts[t], expected[t].item()) for t in big]
    rest_expected = num_draws - sum(e for _, e in cells)
    if rest_expected > 1e-9:
        cells.append((num_draws - sum(o for o, _ in cells), rest_expected))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    assert dof > 0, "one cell: nothing to test"
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def running_sequences(requests: list[tuple[list[int], list[int], SamplingParams, list[list[int]]]]) -> list[Sequence]:
    """(prompt, completion so far, params, bad words' token ids) -> sequences in slots 0, 1, ..."""
    seqs = []
    for slot, (prompt, completion, params, bad_words) in enumerate(requests):
        seq = Sequence(prompt, params, bad_words_token_ids=bad_words, seq_id=slot)
        seq.token_ids += completion
        seq.num_tokens += len(completion)
        seq.sampling_slot = slot
        seqs.append(seq)
    return seqs


def join(state, seqs: list[Sequence], device: torch.device):
    """The sequences' slots written as the engine writes them: joins built on the host, uploaded, joined."""
    joins, = DeviceInputs(device).upload(slot_joins(seqs, {EOS}))
    state.join(joins)


def transformers_processed(logits: torch.Tensor, prompt: list[int], completion: list[int], params: SamplingParams,
                           bad_words: list[list[int]]) -> torch.Tensor:
    """One row's logits [vocab_size] as vLLM processes them, through transformers' logits processors where it
    has them (bias, bad words, min new tokens, repetition) and by hand in float64 otherwise (allowed ids,
    presence and frequency penalties, temperature)."""
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )
    ids = torch.tensor([prompt + completion], device=logits.device)
    scores = logits.double().unsqueeze(0).clone()
    if params.allowed_token_ids is not None:
        allowed = torch.zeros_like(scores, dtype=torch.bool)
        allowed[0, params.allowed_token_ids] = True
        scores = scores.masked_fill(~allowed, -torch.inf)
    if bad_words:
        scores = NoBadWordsLogitsProcessor(bad_words)(ids, scores)
    if params.min_tokens:
        stops = sorted(set(params.stop_token_ids) | ({EOS} if not params.ignore_eos else set()))
        min_new_tokens = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stops, device=logits.device)
        scores = min_new_tokens(ids, scores)
    if params.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in params.logit_bias.items()])(ids, scores)
    if params.repetition_penalty != 1:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    counts = torch.zeros_like(scores)
    for token, count in Counter(completion).items():
        counts[0, token] = count
    scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if params.temperature > 0:
        scores = scores / params.temperature
    return scores[0]


PROCESSED_REQUESTS = [  # (prompt, completion so far, params, bad words)
    ([5, 6, 7], [8, 8, 9], SamplingParams(temperature=0.7, repetition_penalty=1.3), []),
    ([5, 6], [6, 10, 10, 10], SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3), []),
    ([1], [3, 4], SamplingParams(temperature=0.5, logit_bias={3: 2.5, 100: -1.5, 7: 1.0}), [[4, 11], [4, 12, 13]]),
    ([1, 2], [], SamplingParams(temperature=0, allowed_token_ids=[3, 4, 100, 200], logit_bias={4: 0.5}), []),
    ([9], [3], SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[17]), [[3, 21], [22], [9, 23]]),
    ([9], [3], SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[17], ignore_eos=True), []),
    ([4, 4], [5, 6, 7], SamplingParams(temperature=0.8, repetition_penalty=0.8, presence_penalty=-0.5,
                                       frequency_penalty=1.0, logit_bias={5: 3.0}), [[6, 7, 30]]),
]


def check_processed_logits_match_transformers(process, state, vocab_size: int, device: torch.device):
    """`process` on every row of PROCESSED_REQUESTS, through the slots the host joined, against
    transformers_processed."""
    seqs = running_sequences(PROCESSED_REQUESTS)
    join(state, seqs, device)
    torch.manual_seed(0)
    logits = torch.randn(len(seqs), vocab_size, device=device) * 3
    slots = torch.arange(len(seqs), device=device)
    got = process(logits, slots, state)
    for row, (prompt, completion, params, bad_words) in enumerate(PROCESSED_REQUESTS):
        want = transformers_processed(logits[row], prompt, completion, params, bad_words)
        assert torch.equal(got[row].isinf(), want.isinf()), f"row {row}: forbidden tokens differ"
        finite = want.isfinite()
        error = (got[row][finite].double() - want[finite]).abs().max().item()
        assert error < 1e-4, f"row {row}: {error}"
