import numpy as np

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingBatch


def make_sampling_batch(seqs: list[Sequence], vocab_size: int, eos_token_ids) -> SamplingBatch:
    """The batch for the sequences that sample this step, as host arrays: the engine builds it into the
    StepInput, and the rank that samples uploads it with the step's other inputs (a decode graph that
    samples reads the temperatures from its own buffer). A batch of plain sampling (temperature alone,
    the common case) is one scan over the rows."""
    params = [seq.sampling_params for seq in seqs]
    batch = SamplingBatch(temperatures=np.array([p.temperature for p in params], np.float32))
    if all(seq.plain_sampling for seq in seqs):
        return batch
    if any(p.top_k > 0 for p in params):
        batch.top_k = np.array([p.top_k if p.top_k > 0 else vocab_size for p in params], np.int64)
    if any(p.top_p < 1 for p in params):
        batch.top_p = np.array([p.top_p for p in params], np.float32)
    if any(p.min_p > 0 for p in params):
        batch.min_p = np.array([p.min_p for p in params], np.float32)
    # The token being sampled is already counted as pending: its index is num_completion_tokens - 1.
    seeded = [i for i, seq in enumerate(seqs) if seq.seed is not None]
    if seeded:
        batch.seeded_rows = np.array(seeded, np.int64)
        batch.seeds = np.array([seqs[i].seed for i in seeded], np.int64)
        batch.seed_steps = np.array([seqs[i].num_completion_tokens - 1 for i in seeded], np.int64)
    if any(p.uses_penalties for p in params):
        _add_penalties(batch, seqs, vocab_size)
    _add_suppressed(batch, seqs, eos_token_ids)
    _add_allowed(batch, seqs)
    _add_logit_bias(batch, seqs)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    batch.num_logprobs = max(asked) if asked else None
    return batch


def _padded(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max(1, max(map(len, rows)))
    return [row + [pad] * (width - len(row)) for row in rows]


def _add_penalties(batch: SamplingBatch, seqs: list[Sequence], vocab_size: int):
    params = [seq.sampling_params for seq in seqs]
    batch.presence_penalties = np.array([p.presence_penalty for p in params], np.float32)
    batch.frequency_penalties = np.array([p.frequency_penalty for p in params], np.float32)
    batch.repetition_penalties = np.array([p.repetition_penalty for p in params], np.float32)
    outputs = [seq.completion_token_ids if seq.sampling_params.uses_penalties else [] for seq in seqs]
    batch.output_token_ids = np.array(_padded(outputs, vocab_size), np.int64)
    if any(p.repetition_penalty != 1 for p in params):
        prompts = [seq.token_ids[:seq.num_prompt_tokens] if p.repetition_penalty != 1 else []
                   for seq, p in zip(seqs, params)]
        batch.prompt_token_ids = np.array(_padded(prompts, vocab_size), np.int64)


def _add_suppressed(batch: SamplingBatch, seqs: list[Sequence], eos_token_ids):
    """Below min_tokens, end-of-sequence and stop token ids may not be sampled; nor, ever, a token that
    would complete a bad word."""
    rows, token_ids = [], []
    for i, seq in enumerate(seqs):
        params = seq.sampling_params
        forbidden = banned_by_bad_words(seq)
        if not params.may_stop(seq.num_completion_tokens):  # the token being sampled is counted as pending
            forbidden |= set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        rows.extend([i] * len(forbidden))
        token_ids.extend(forbidden)
    if rows:
        batch.suppressed = (np.array(rows, np.int64), np.array(token_ids, np.int64))


def banned_by_bad_words(seq: Sequence) -> set[int]:
    """The last token of each bad word whose other tokens end the completion so far."""
    completion = seq.completion_token_ids
    return {word[-1] for word in seq.bad_words_token_ids
            if len(word) == 1 or completion[len(completion) - len(word) + 1:] == word[:-1]}


def _add_allowed(batch: SamplingBatch, seqs: list[Sequence]):
    restricted = [i for i, seq in enumerate(seqs) if seq.sampling_params.allowed_token_ids is not None]
    if restricted:
        pairs = [(i, t) for i in restricted for t in seqs[i].sampling_params.allowed_token_ids]
        rows, token_ids = zip(*pairs)
        batch.allowed = (np.array(restricted, np.int64), np.array(rows, np.int64),
                         np.array(token_ids, np.int64))


def _add_logit_bias(batch: SamplingBatch, seqs: list[Sequence]):
    triples = [(i, t, b) for i, seq in enumerate(seqs) for t, b in (seq.sampling_params.logit_bias or {}).items()]
    if triples:
        rows, token_ids, bias = zip(*triples)
        batch.logit_bias = (np.array(rows, np.int64), np.array(token_ids, np.int64),
                            np.array(bias, np.float32))
