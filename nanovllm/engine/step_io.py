"""A step as the model runner sees it: one StepInput in, one StepOutput back (the runner's whole contract).

The engine builds the StepInput (`input_builder`) from the scheduler's output and ships it to every
rank; rank 0 returns the StepOutput. Both hold host values only (numpy arrays, lists), and this module
imports neither the scheduler nor the runner: a rank's process needs nothing of the scheduler.
"""
from dataclasses import dataclass

import numpy as np

from nanovllm.layers.sampled_logprobs import SampledLogprobs
from nanovllm.layers.sampler import FULL_SORT, NO_FILTER
from nanovllm.layers.sampling_state import SlotJoins


@dataclass(slots=True)
class SamplingInputs:
    """How a step samples its rows: each row's sampling slot, where its request's parameters and token
    counts stay on the device between steps; the sequences joining slots; and bias entries that change
    (a completion reaching min_tokens may stop from now on). Host arrays; the sampling rank uploads them."""

    slots: np.ndarray  # [num_sampled] int64
    filter: int = NO_FILTER
    num_logprobs: int | None = None  # the most top log-probabilities any row asked for
    joins: SlotJoins | None = None
    bias_updates: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (slot, token, float32 bias)
    awaits_masks: bool = False  # rows are constrained: the runner samples once their GrammarMasks come


@dataclass(slots=True)
class GrammarMasks:
    """The tokens a step's constrained rows may sample (structured outputs): bit j of word w of a row's
    bitmask allows token 32 * w + j. The other rows sample freely."""

    rows: np.ndarray  # [num_constrained] int64
    bitmask: np.ndarray  # [num_constrained, ceil(vocab_size / 32)] int32


@dataclass(slots=True)
class DecodeInputs:
    """The sequences that decode: one token each, all of whose earlier keys are in the cache. A token the
    previous step sampled may still be on the device: its id here is 0, and the runner takes it from that
    step's samples, at the row `pending_rows` gives."""

    token_ids: np.ndarray  # [num_seqs] int64
    pending_rows: np.ndarray  # [num_seqs] int64: -1 where the token is known here
    positions: np.ndarray  # [num_seqs] int64
    slot_mapping: np.ndarray  # [num_seqs] int32: the cache slot the token's K/V go to
    context_lens: np.ndarray  # [num_seqs] int32: keys once this token's are stored
    seq_order: np.ndarray  # [num_seqs] int32: `longest_first(context_lens)`, the order decode attention starts rows in
    block_tables: np.ndarray  # [num_seqs, max_num_blocks] int32, -1 padded

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class PrefillInputs:
    """Prompt chunks: a run of tokens for each sequence, after the keys of its earlier tokens (in the cache)."""

    token_ids: np.ndarray  # [num_tokens] int64, sequence after sequence
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int32: -1 stores nothing
    cu_seqlens_q: np.ndarray  # [num_seqs + 1] int32: where each sequence's tokens start
    cu_seqlens_k: np.ndarray  # [num_seqs + 1] int32: the same over each sequence's keys once the step has run
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: np.ndarray  # [num_seqs, max_num_blocks] int32, -1 padded
    num_paged_seqs: int  # the leading sequences, whose chunks attend to keys already in the cache
    num_paged_tokens: int  # their tokens
    max_paged_seqlen_q: int  # the longest of their chunks
    sample_indices: np.ndarray  # [num_sampled] int64: the tokens whose logits sample (a prompt's last)
    prompt_logprob_indices: np.ndarray  # [num_scored] int64: tokens whose logits score the next prompt token
    prompt_logprob_token_ids: np.ndarray  # [num_scored] int64: those next prompt tokens
    num_prompt_logprobs: int  # the most top log-probabilities a scored prompt asked for


@dataclass(slots=True)
class StepInput:
    """A step's model inputs: the decodes, computed first, then the prompt chunks (either may be None), and
    how to sample its rows (one for each decode, then one for each chunk that reaches its prompt's end)."""

    decode: DecodeInputs | None
    prefill: PrefillInputs | None
    sampling: SamplingInputs

    @property
    def num_decode(self) -> int:
        return self.decode.num_seqs if self.decode is not None else 0

    @property
    def num_sampled(self) -> int:
        return len(self.sampling.slots)


@dataclass(slots=True)
class StepOutput:
    """Rank 0's result of a step, on the host: a token for each sampled row, and the log-probabilities
    asked for (as lists), of those tokens and of the scored prompt tokens; of a pooling engine's step, the
    pooled vector of each row in place of a token."""

    token_ids: list[int]
    logprobs: SampledLogprobs | None = None
    prompt_logprobs: SampledLogprobs | None = None
    pooled: np.ndarray | None = None  # [num_rows, width] float32


def longest_first(context_lens: np.ndarray) -> np.ndarray:
    """The rows by context length, longest first (ties in row order): a long sequence's attention programs
    started last would hold up the end of the launch."""
    return np.argsort(-context_lens, kind="stable").astype(np.int32)


def warmup_step_input(num_seqs: int, seq_len: int, sampling: SamplingInputs) -> StepInput:
    """A prefill of num_seqs sequences of seq_len zeros with no cache to write to (slot -1), each sampling."""
    num_tokens = num_seqs * seq_len
    cu_seqlens = np.arange(0, num_tokens + 1, seq_len, dtype=np.int32)
    empty = np.zeros(0, dtype=np.int64)
    prefill = PrefillInputs(
        token_ids=np.zeros(num_tokens, dtype=np.int64),
        positions=np.tile(np.arange(seq_len, dtype=np.int64), num_seqs),
        slot_mapping=np.full(num_tokens, -1, dtype=np.int32),
        cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=seq_len, max_seqlen_k=seq_len,
        block_tables=np.zeros((num_seqs, 0), dtype=np.int32),
        num_paged_seqs=0, num_paged_tokens=0, max_paged_seqlen_q=0,
        sample_indices=cu_seqlens[1:].astype(np.int64) - 1,
        prompt_logprob_indices=empty, prompt_logprob_token_ids=empty, num_prompt_logprobs=0)
    return StepInput(None, prefill, sampling)


# The warm-up steps' sampling of n rows, all in the sampler's scratch slot (`scratch`): no filter; with
# log-probabilities; a full sort with 20 log-probabilities (the eager sampler's memory peak).
def plain_sampling(n: int, scratch: int) -> SamplingInputs:
    return SamplingInputs(np.full(n, scratch, np.int64), NO_FILTER)


def logprobs_sampling(n: int, scratch: int) -> SamplingInputs:
    return SamplingInputs(np.full(n, scratch, np.int64), NO_FILTER, num_logprobs=1)


def filtered_sampling(n: int, scratch: int) -> SamplingInputs:
    return SamplingInputs(np.full(n, scratch, np.int64), FULL_SORT, num_logprobs=20)
