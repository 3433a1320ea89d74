"""A step's SamplingInputs from its sequences: their sampling slots, the sequences joining slots, and the
bias entries that change in this step. A step of sequences already in their slots costs one scan."""
from functools import reduce
from operator import or_

import numpy as np

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_io import SamplingInputs
from nanovllm.layers.sampler import CANDIDATES, FILTER_CANDIDATES, FULL_SORT, NO_FILTER
from nanovllm.layers.sampling_state import (
    HAS_BAD_WORDS,
    HAS_BIAS,
    HAS_PENALTIES,
    IN_PROMPT,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    SlotJoins,
)

# A sequence's `sampling_needs`: what its rows ask of a step, as bits.
NEEDS_CANDIDATES, NEEDS_FULL_SORT, NEEDS_LOGPROBS, HOLDS_STOP_TOKENS, NEEDS_MASK = 1, 2, 4, 8, 16


def make_sampling_inputs(sampled: list[Sequence], joined: list[Sequence], eos_token_ids) -> SamplingInputs:
    """`sampled`: the sequences that sample, in row order; `joined`: those that took a slot in this step."""
    inputs = SamplingInputs(np.fromiter((seq.sampling_slot for seq in sampled), np.int64, len(sampled)))
    if joined:
        inputs.joins = slot_joins(joined, eos_token_ids)
    needs = reduce(or_, {seq.sampling_needs for seq in sampled}, 0)  # over the few distinct values
    inputs.filter = FULL_SORT if needs & NEEDS_FULL_SORT else CANDIDATES if needs & NEEDS_CANDIDATES else NO_FILTER
    if needs & NEEDS_LOGPROBS:
        inputs.num_logprobs = max(seq.sampling_params.logprobs for seq in sampled
                                  if seq.sampling_params.logprobs is not None)
    if needs & HOLDS_STOP_TOKENS:
        inputs.bias_updates = _released_stop_tokens(sampled, eos_token_ids)
    inputs.awaits_masks = bool(needs & NEEDS_MASK)
    return inputs


def sampling_needs(seq: Sequence) -> int:
    params = seq.sampling_params
    needs = _filter_needs(params) if params.temperature > 0 else 0  # greedy: the argmax, whatever the filters
    if params.logprobs is not None:
        needs |= NEEDS_LOGPROBS
    if params.structured_outputs is not None:
        needs |= NEEDS_MASK
    if _holds_stop_tokens(seq, seq.num_known_completion_tokens):  # its first token may still be pending
        needs |= HOLDS_STOP_TOKENS
    return needs


def _filter_needs(params) -> int:
    """The candidates hold every kept token under a top_k of at most FILTER_CANDIDATES, or min_p alone."""
    if params.top_p < 1 and not 0 < params.top_k <= FILTER_CANDIDATES or params.top_k > FILTER_CANDIDATES:
        return NEEDS_FULL_SORT
    return NEEDS_CANDIDATES if params.top_k > 0 or params.min_p > 0 else 0


def _holds_stop_tokens(seq: Sequence, num_generated: int) -> bool:
    """Whether the completion's next token, after num_generated, may not be a stop token (min_tokens)."""
    return not seq.sampling_params.may_stop(num_generated + 1)


def stop_tokens(seq: Sequence, eos_token_ids) -> set[int]:
    params = seq.sampling_params
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def _released_stop_tokens(sampled: list[Sequence], eos_token_ids):
    """The stop tokens of completions whose token of this step is the first that may stop them, back at
    their bias."""
    slots, token_ids, bias = [], [], []
    for seq in sampled:
        # The token being sampled is counted as pending: num_completion_tokens - 1 came before it.
        if seq.sampling_needs & HOLDS_STOP_TOKENS and not _holds_stop_tokens(seq, seq.num_completion_tokens - 1):
            seq.sampling_needs &= ~HOLDS_STOP_TOKENS
            base = base_bias(seq)
            for token in stop_tokens(seq, eos_token_ids):
                slots.append(seq.sampling_slot)
                token_ids.append(token)
                bias.append(base.get(token, unnamed_bias(seq.sampling_params)))
    if not slots:
        return None
    return np.array(slots, np.int64), np.array(token_ids, np.int64), np.array(bias, np.float32)


def unnamed_bias(params) -> float:
    """The bias of a token no entry of base_bias names: -inf where allowed_token_ids restricts the row."""
    return -np.inf if params.allowed_token_ids is not None else 0.0


def base_bias(seq: Sequence) -> dict[int, float]:
    """Token -> bias from logit_bias, allowed_token_ids and the one-token bad words (-inf: forbidden)."""
    params = seq.sampling_params
    bias = {token: float(value) for token, value in (params.logit_bias or {}).items()}
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        bias = {token: value for token, value in bias.items() if token in allowed}
        bias.update({token: 0.0 for token in allowed if token not in bias})
    bias.update({word[0]: -np.inf for word in seq.bad_words_token_ids if len(word) == 1})
    return bias


def slot_joins(seqs: list[Sequence], eos_token_ids) -> SlotJoins:
    """Everything the sampler keeps of these sequences, for the slots they take; each sequence's
    `sampling_needs` is set here."""
    params = [seq.sampling_params for seq in seqs]
    bias_entries, count_entries = ([], [], []), ([], [], [])
    flags = np.zeros(len(seqs), np.int32)
    words = np.stack([_bad_word_table(seq) for seq in seqs]) if seqs else None
    for i, seq in enumerate(seqs):
        seq.sampling_needs = sampling_needs(seq)
        bias = base_bias(seq)
        if seq.sampling_needs & HOLDS_STOP_TOKENS:
            bias.update({token: -np.inf for token in stop_tokens(seq, eos_token_ids)})
        _extend(bias_entries, i, bias.keys(), bias.values())
        if params[i].uses_penalties:
            counts = _token_counts(seq)
            _extend(count_entries, i, counts.keys(), counts.values())
        flags[i] = ((HAS_BIAS if bias or params[i].allowed_token_ids is not None else 0)
                    | (HAS_PENALTIES if params[i].uses_penalties else 0)
                    | (HAS_BAD_WORDS if any(len(word) > 1 for word in seq.bad_words_token_ids) else 0))
    return SlotJoins(
        slots=np.array([seq.sampling_slot for seq in seqs], np.int64),
        temperature=np.array([p.temperature for p in params], np.float32),
        top_k=np.array([max(p.top_k, 0) for p in params], np.int32),
        top_p=np.array([p.top_p for p in params], np.float32),
        min_p=np.array([p.min_p for p in params], np.float32),
        seed=np.array([seq.seed or 0 for seq in seqs], np.int64),
        seeded=np.array([seq.seed is not None for seq in seqs], np.int32),
        presence_penalty=np.array([p.presence_penalty for p in params], np.float32),
        frequency_penalty=np.array([p.frequency_penalty for p in params], np.float32),
        repetition_penalty=np.array([p.repetition_penalty for p in params], np.float32),
        flags=flags,
        generated=np.array([seq.num_known_completion_tokens for seq in seqs], np.int32),
        bias_fill=np.array([unnamed_bias(p) for p in params], np.float32),
        bias_entries=_arrays(bias_entries, np.float32),
        count_entries=_arrays(count_entries, np.int32),
        bad_prefixes=words[:, :, :-1].astype(np.int32),
        bad_last=words[:, :, -1].astype(np.int32),
        recent=np.stack([_recent_tokens(seq) for seq in seqs]))


def _extend(entries: tuple[list, list, list], join: int, token_ids, values):
    token_ids, values = list(token_ids), list(values)
    entries[0].extend([join] * len(token_ids))
    entries[1].extend(token_ids)
    entries[2].extend(values)


def _arrays(entries: tuple[list, list, list], dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    joins, token_ids, values = entries
    return np.array(joins, np.int64), np.array(token_ids, np.int64), np.array(values, dtype)


def _token_counts(seq: Sequence) -> dict[int, int]:
    """Each token's count in the completion so far, with IN_PROMPT added for the prompt's tokens (the
    repetition penalty's)."""
    counts: dict[int, int] = {}
    for token in seq.completion_token_ids:
        counts[token] = counts.get(token, 0) + 1
    if seq.sampling_params.repetition_penalty != 1:
        for token in set(seq.token_ids[:seq.num_prompt_tokens]):
            counts[token] = counts.get(token, 0) + IN_PROMPT
    return counts


def _bad_word_table(seq: Sequence) -> np.ndarray:
    """[MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS]: the bad words of two or more tokens, right-aligned, -2 before
    a word (matches anything); a row of -2 and a last token of -1 is no word."""
    table = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -2, np.int64)
    table[:, -1] = -1
    for row, word in enumerate(word for word in seq.bad_words_token_ids if len(word) > 1):
        table[row, -len(word):] = word
    return table


def _recent_tokens(seq: Sequence) -> np.ndarray:
    recent = np.full(MAX_BAD_WORD_TOKENS - 1, -1, np.int64)
    tail = seq.completion_token_ids[-(MAX_BAD_WORD_TOKENS - 1):]
    if tail:
        recent[-len(tail):] = tail
    return recent
