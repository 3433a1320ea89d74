from dataclasses import dataclass

import torch

from nanovllm.engine.sequence import Sequence


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the model's device.

    A feature no row uses stays None, so a batch of plain temperature sampling pays for nothing
    else. Which features are on is decided here, on the host, from the requests: the sampler never
    reads a device value to choose a path.
    """

    temperatures: torch.Tensor  # [num_rows] float32, 0 = greedy
    top_k: torch.Tensor | None = None  # [num_rows] int64, vocab_size where off
    top_p: torch.Tensor | None = None  # [num_rows] float32, 1 where off
    min_p: torch.Tensor | None = None  # [num_rows] float32, 0 where off
    seeded_rows: torch.Tensor | None = None  # [num_seeded] int64
    seeds: torch.Tensor | None = None  # [num_seeded] int64
    seed_steps: torch.Tensor | None = None  # [num_seeded] int64: tokens generated so far
    presence_penalties: torch.Tensor | None = None  # [num_rows] float32
    frequency_penalties: torch.Tensor | None = None  # [num_rows] float32
    repetition_penalties: torch.Tensor | None = None  # [num_rows] float32
    output_token_ids: torch.Tensor | None = None  # [num_rows, max_len] int64, vocab_size padded
    prompt_token_ids: torch.Tensor | None = None  # [num_rows, max_len] int64, vocab_size padded
    suppressed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) to forbid
    num_logprobs: int | None = None  # the most top log-probabilities any row asked for

    @property
    def uses_filters(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None


def make_sampling_batch(seqs: list[Sequence], vocab_size: int, eos_token_ids, to_device) -> SamplingBatch:
    """Build the batch for the sequences that sample this step; `to_device(values, dtype)` makes a tensor."""
    params = [seq.sampling_params for seq in seqs]
    batch = SamplingBatch(temperatures=to_device([p.temperature for p in params], torch.float32))
    if any(p.top_k > 0 for p in params):
        batch.top_k = to_device([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64)
    if any(p.top_p < 1 for p in params):
        batch.top_p = to_device([p.top_p for p in params], torch.float32)
    if any(p.min_p > 0 for p in params):
        batch.min_p = to_device([p.min_p for p in params], torch.float32)
    seeded = [i for i, seq in enumerate(seqs) if seq.seed is not None]
    if seeded:
        batch.seeded_rows = to_device(seeded, torch.int64)
        batch.seeds = to_device([seqs[i].seed for i in seeded], torch.int64)
        batch.seed_steps = to_device([seqs[i].num_completion_tokens for i in seeded], torch.int64)
    if any(p.uses_penalties for p in params):
        _add_penalties(batch, seqs, vocab_size, to_device)
    _add_suppressed(batch, seqs, eos_token_ids, to_device)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    batch.num_logprobs = max(asked) if asked else None
    return batch


def _padded(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max(1, max(map(len, rows)))
    return [row + [pad] * (width - len(row)) for row in rows]


def _add_penalties(batch: SamplingBatch, seqs: list[Sequence], vocab_size: int, to_device):
    params = [seq.sampling_params for seq in seqs]
    batch.presence_penalties = to_device([p.presence_penalty for p in params], torch.float32)
    batch.frequency_penalties = to_device([p.frequency_penalty for p in params], torch.float32)
    batch.repetition_penalties = to_device([p.repetition_penalty for p in params], torch.float32)
    outputs = [seq.completion_token_ids if seq.sampling_params.uses_penalties else [] for seq in seqs]
    batch.output_token_ids = to_device(_padded(outputs, vocab_size), torch.int64)
    if any(p.repetition_penalty != 1 for p in params):
        prompts = [seq.token_ids[:seq.num_prompt_tokens] if p.repetition_penalty != 1 else []
                   for seq, p in zip(seqs, params)]
        batch.prompt_token_ids = to_device(_padded(prompts, vocab_size), torch.int64)


def _add_suppressed(batch: SamplingBatch, seqs: list[Sequence], eos_token_ids, to_device):
    """Below min_tokens, end-of-sequence and stop token ids may not be sampled."""
    rows, token_ids = [], []
    for i, seq in enumerate(seqs):
        params = seq.sampling_params
        if seq.num_completion_tokens < params.min_tokens:
            forbidden = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            rows.extend([i] * len(forbidden))
            token_ids.extend(forbidden)
    if rows:
        batch.suppressed = (to_device(rows, torch.int64), to_device(token_ids, torch.int64))
