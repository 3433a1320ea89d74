from dataclasses import dataclass
from itertools import chain

import numpy as np

from nanovllm.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepInput:
    """A step's model inputs as host arrays, built once from the scheduler's output and shipped to every rank.

    Tokens lie sequence after sequence, decoding sequences first (`num_decode` of them, one token
    each), then prompt chunks. A token sampled by the previous step may still be on the device: its
    id here is 0, and the runner copies it from that step's samples (`pending_*`).
    """

    token_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int32: the cache slot each token's K/V goes to
    cu_seqlens_q: np.ndarray  # [num_seqs + 1] int32: where each sequence's tokens start
    seq_lens: np.ndarray  # [num_seqs] int32: keys per sequence once this step has run
    block_tables: np.ndarray  # [num_seqs, max_num_blocks] int32, -1 padded
    sample_indices: np.ndarray  # [num_sampled] int64: the tokens whose logits are sampled
    pending_indices: np.ndarray  # [num_pending] int64: tokens whose ids the previous step sampled
    pending_rows: np.ndarray  # [num_pending] int64: their rows among that step's samples
    num_decode: int
    has_cached_prefix: bool  # a prompt chunk attends to keys already in the cache
    prompt_logprob_indices: np.ndarray  # [num_scored] int64: prompt tokens whose logits score the next one
    prompt_logprob_token_ids: np.ndarray  # [num_scored] int64: those next prompt tokens
    num_prompt_logprobs: int  # the most top log-probabilities a scored prompt asked for

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def build_step_input(out: SchedulerOutput, block_size: int) -> StepInput:
    num_seqs, num_decode = len(out.seqs), out.num_decode
    num_computed = np.array(out.num_computed, dtype=np.int64)
    num_scheduled = np.array(out.num_scheduled, dtype=np.int64)
    cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), num_scheduled)
    positions = np.arange(num_tokens) - cu_seqlens_q[seq_of_token] + num_computed[seq_of_token]
    block_tables, table_starts, flat_tables = _block_tables(out)
    block_ids = flat_tables[table_starts[seq_of_token] + positions // block_size]
    prev_rows = np.array(out.prev_rows, dtype=np.int64)
    pending = np.flatnonzero(prev_rows >= 0)
    return StepInput(
        token_ids=_token_ids(out, num_tokens),
        positions=positions,
        slot_mapping=(block_ids * block_size + positions % block_size).astype(np.int32),
        cu_seqlens_q=cu_seqlens_q.astype(np.int32),
        seq_lens=(num_computed + num_scheduled).astype(np.int32),
        block_tables=block_tables,
        sample_indices=cu_seqlens_q[1:][np.array(out.row_samples, dtype=bool)] - 1,
        pending_indices=cu_seqlens_q[pending],
        pending_rows=prev_rows[pending],
        num_decode=num_decode,
        has_cached_prefix=bool((num_computed[num_decode:] > 0).any()),
        **_prompt_logprob_inputs(out, cu_seqlens_q),
    )


def prompt_logprob_rows(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    """(row, first position, count) of the prompt positions whose logits score the prompt's next token,
    for the sequences that asked for prompt_logprobs; in row order."""
    rows = []
    for i in range(out.num_decode, len(out.seqs)):
        seq, start = out.seqs[i], out.num_computed[i]
        if seq.sampling_params.prompt_logprobs is not None:
            end = min(start + out.num_scheduled[i], seq.num_prompt_tokens - 1)
            if end > start:
                rows.append((i, start, end - start))
    return rows


def _prompt_logprob_inputs(out: SchedulerOutput, cu_seqlens_q: np.ndarray) -> dict:
    rows = prompt_logprob_rows(out)
    indices = [cu_seqlens_q[i] + j for i, _, count in rows for j in range(count)]
    targets = [out.seqs[i].token_ids[start + j + 1] for i, start, count in rows for j in range(count)]
    k = max((out.seqs[i].sampling_params.prompt_logprobs for i, _, _ in rows), default=0)
    return dict(prompt_logprob_indices=np.array(indices, dtype=np.int64),
                prompt_logprob_token_ids=np.array(targets, dtype=np.int64), num_prompt_logprobs=k)


def _token_ids(out: SchedulerOutput, num_tokens: int) -> np.ndarray:
    """Decoding sequences give one token each (0 while still on the device), then the prompt chunks."""
    n = out.num_decode
    decode = (seq.token_ids[start] if row < 0 else 0
              for seq, start, row in zip(out.seqs[:n], out.num_computed[:n], out.prev_rows[:n]))
    chunks = (seq.token_ids[start:start + count]
              for seq, start, count in zip(out.seqs[n:], out.num_computed[n:], out.num_scheduled[n:]))
    return np.fromiter(chain(decode, chain.from_iterable(chunks)), dtype=np.int64, count=num_tokens)


def _block_tables(out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The padded block tables, and each table's start in the concatenation of all of them."""
    tables = [seq.block_table for seq in out.seqs]
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(lengths.sum()))
    starts = np.zeros_like(lengths)
    np.cumsum(lengths[:-1], out=starts[1:])
    padded = np.full((len(tables), int(lengths.max(initial=0))), -1, dtype=np.int32)
    padded[np.arange(padded.shape[1]) < lengths[:, None]] = flat
    return padded, starts, flat


def warmup_step_input(num_seqs: int, seq_len: int) -> StepInput:
    """A prefill of num_seqs sequences of seq_len zeros with no cache to write to (slot -1), each sampling."""
    num_tokens = num_seqs * seq_len
    cu_seqlens_q = np.arange(0, num_tokens + 1, seq_len, dtype=np.int32)
    empty = np.zeros(0, dtype=np.int64)
    return StepInput(
        token_ids=np.zeros(num_tokens, dtype=np.int64),
        positions=np.tile(np.arange(seq_len, dtype=np.int64), num_seqs),
        slot_mapping=np.full(num_tokens, -1, dtype=np.int32),
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=np.full(num_seqs, seq_len, dtype=np.int32),
        block_tables=np.zeros((num_seqs, 0), dtype=np.int32),
        sample_indices=cu_seqlens_q[1:].astype(np.int64) - 1,
        pending_indices=empty,
        pending_rows=empty,
        num_decode=0,
        has_cached_prefix=False,
        prompt_logprob_indices=empty,
        prompt_logprob_token_ids=empty,
        num_prompt_logprobs=0,
    )
