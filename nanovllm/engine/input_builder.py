"""The one place a step's inputs are made: the scheduler's output in, the runner's StepInput out."""
from dataclasses import replace
from itertools import chain

import numpy as np

from nanovllm.config import Config
from nanovllm.engine.sampling_inputs import make_sampling_inputs
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_io import DecodeInputs, PrefillInputs, StepInput, longest_first

CUDA_PROMPT_TOKENS_MULTIPLE = 32  # what a generating engine on CUDA pads a prompt step's tokens to


def prompt_tokens_multiple(config: Config) -> int:
    """`padded_to_multiple`'s multiple for an engine: on CUDA, where cuBLAS chooses kernels by row count, unless
    it pools (a pooling step pools every sequence of its chunks) or a padded step could pass the token budget
    that the warm-up measured memory at."""
    pads = (config.device == "cuda" and config.runner == "generate"
            and config.max_num_batched_tokens % CUDA_PROMPT_TOKENS_MULTIPLE == 0)
    return CUDA_PROMPT_TOKENS_MULTIPLE if pads else 1

# (row of the scheduler's output, first position, count): the prompt positions whose logits score the
# prompt's next token, for a sequence that asked for prompt_logprobs.
ScoredPrompt = tuple[int, int, int]


def build_step_input(out: SchedulerOutput, block_size: int, eos_token_ids,
                     prompt_tokens_multiple: int = 1) -> tuple[StepInput, list[ScoredPrompt]]:
    """The step's decodes, its prompt chunks and the sampling of the sequences that sample; and the prompt
    positions it scores, which the step's prompt log-probabilities come back for, in this order. The chunks'
    tokens are padded to a multiple of prompt_tokens_multiple (`padded_to_multiple`)."""
    scored = _scored_prompts(out)
    n = out.num_decode
    decode = _decode_inputs(out, block_size) if n else None
    prefill = _prefill_inputs(out, scored, block_size) if len(out.seqs) > n else None
    if prefill is not None and prompt_tokens_multiple > 1:
        prefill = padded_to_multiple(prefill, prompt_tokens_multiple)
    return StepInput(decode, prefill, make_sampling_inputs(out.sampled, out.joined, eos_token_ids)), scored


def padded_to_multiple(prefill: PrefillInputs, multiple: int) -> PrefillInputs:
    """The chunks with one more sequence of zeros after them, which stores nothing (slot -1), attends to its own
    keys and samples nothing, so that their tokens are a multiple of `multiple`: the eager forward pass of a
    prompt step then meets few distinct row counts, and cuBLAS chooses its matmuls' kernels for each once (a
    new count costs that choice inside a run). Left as they are when every chunk continues a cached prefix: a
    sequence attending to its own keys would add an attention call a layer."""
    num_tokens = len(prefill.token_ids)
    pad = -num_tokens % multiple
    if pad == 0 or prefill.num_paged_seqs == len(prefill.cu_seqlens_q) - 1:
        return prefill
    tokens = num_tokens + pad
    return replace(prefill, token_ids=np.pad(prefill.token_ids, (0, pad)),
                   positions=np.pad(prefill.positions, (0, pad)),
                   slot_mapping=np.pad(prefill.slot_mapping, (0, pad), constant_values=-1),
                   cu_seqlens_q=np.append(prefill.cu_seqlens_q, np.int32(tokens)),
                   cu_seqlens_k=np.append(prefill.cu_seqlens_k, prefill.cu_seqlens_k[-1] + np.int32(pad)),
                   max_seqlen_q=max(prefill.max_seqlen_q, pad), max_seqlen_k=max(prefill.max_seqlen_k, pad),
                   block_tables=np.pad(prefill.block_tables, ((0, 1), (0, 0)), constant_values=-1))


def _scored_prompts(out: SchedulerOutput) -> list[ScoredPrompt]:
    rows = []
    for i in range(out.num_decode, len(out.seqs)):
        seq, start = out.seqs[i], out.num_computed[i]
        if seq.sampling_params.prompt_logprobs is not None:
            end = min(start + out.num_scheduled[i], seq.num_prompt_tokens - 1)
            if end > start:
                rows.append((i, start, end - start))
    return rows


def _decode_inputs(out: SchedulerOutput, block_size: int) -> DecodeInputs:
    """A token still on the device (pending_row >= 0) is 0 here: only decodes can have one, since a
    sequence with a pending token is neither admitted nor left with more than that token to compute."""
    n = out.num_decode
    seqs, num_computed, pending_rows = out.seqs[:n], out.num_computed[:n], out.pending_rows[:n]
    token_ids = [seq.token_ids[start] if row < 0 else 0 for seq, start, row in zip(seqs, num_computed, pending_rows)]
    positions = np.array(num_computed, dtype=np.int64)
    block_tables = _block_tables(seqs)
    context_lens = (positions + 1).astype(np.int32)
    return DecodeInputs(token_ids=np.array(token_ids, dtype=np.int64), pending_rows=np.array(pending_rows, np.int64),
                        positions=positions, slot_mapping=_slots(block_tables, np.arange(n), positions, block_size),
                        context_lens=context_lens, seq_order=longest_first(context_lens), block_tables=block_tables)


def _prefill_inputs(out: SchedulerOutput, scored: list[ScoredPrompt], block_size: int) -> PrefillInputs:
    """The chunks of the sequences with keys in the cache come first (their attention reads the cache, the
    others' the step's own keys); the sampled and scored positions follow the scheduler's rows."""
    n = out.num_decode
    order = np.argsort(np.array(out.num_computed[n:]) == 0, kind="stable")
    seqs = [out.seqs[n + i] for i in order]
    num_computed = np.array(out.num_computed[n:], dtype=np.int64)[order]
    num_scheduled = np.array(out.num_scheduled[n:], dtype=np.int64)[order]
    cu_seqlens_q = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=cu_seqlens_q[1:])
    first_token = np.empty(len(seqs), dtype=np.int64)  # of each scheduler row
    first_token[order] = cu_seqlens_q[:-1]
    last_token = first_token + np.array(out.num_scheduled[n:], dtype=np.int64) - 1
    seq_of_token = np.repeat(np.arange(len(seqs)), num_scheduled)
    positions = np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[seq_of_token] + num_computed[seq_of_token]
    block_tables = _block_tables(seqs)
    seq_lens = num_computed + num_scheduled
    cu_seqlens_k = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(seq_lens, out=cu_seqlens_k[1:])
    num_paged_seqs = int(np.count_nonzero(num_computed))
    chunks = (seq.token_ids[start:start + count] for seq, start, count in zip(seqs, num_computed, num_scheduled))
    return PrefillInputs(
        token_ids=np.fromiter(chain.from_iterable(chunks), dtype=np.int64, count=len(positions)),
        positions=positions, slot_mapping=_slots(block_tables, seq_of_token, positions, block_size),
        cu_seqlens_q=cu_seqlens_q.astype(np.int32), cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=int(num_scheduled.max()), max_seqlen_k=int(seq_lens.max()), block_tables=block_tables,
        num_paged_seqs=num_paged_seqs, num_paged_tokens=int(cu_seqlens_q[num_paged_seqs]),
        max_paged_seqlen_q=int(num_scheduled[:num_paged_seqs].max(initial=0)),
        sample_indices=last_token[np.array(out.row_samples[n:], dtype=bool)],
        **_prompt_logprob_inputs(out, scored, first_token))


def _prompt_logprob_inputs(out: SchedulerOutput, scored: list[ScoredPrompt], first_token: np.ndarray) -> dict:
    n = out.num_decode
    indices = [first_token[i - n] + j for i, _, count in scored for j in range(count)]
    targets = [out.seqs[i].token_ids[start + j + 1] for i, start, count in scored for j in range(count)]
    k = max((out.seqs[i].sampling_params.prompt_logprobs for i, _, _ in scored), default=0)
    return dict(prompt_logprob_indices=np.array(indices, dtype=np.int64),
                prompt_logprob_token_ids=np.array(targets, dtype=np.int64), num_prompt_logprobs=k)


def _block_tables(seqs: list[Sequence]) -> np.ndarray:
    """The sequences' block tables, -1 padded. [num_seqs, max_num_blocks] int32"""
    tables = [seq.block_table for seq in seqs]
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    padded = np.full((len(tables), int(lengths.max(initial=0))), -1, dtype=np.int32)
    padded[np.arange(padded.shape[1]) < lengths[:, None]] = np.fromiter(chain.from_iterable(tables), dtype=np.int32,
                                                                        count=int(lengths.sum()))
    return padded


def _slots(block_tables: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot each token's K/V go to. [num_tokens] int32"""
    block_ids = block_tables[seq_of_token, positions // block_size].astype(np.int64)
    return (block_ids * block_size + positions % block_size).astype(np.int32)
