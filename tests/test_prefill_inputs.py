"""What the host builds for a step's prompt chunks (CPU: numpy), worked by hand: the chunks that continue keys in
the cache come first, and the sampled and scored positions still follow the scheduler's rows."""
import numpy as np

from nanovllm.engine.input_builder import build_step_input
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def sequence(seq_id: int, num_tokens: int, block_table: list[int], **params) -> Sequence:
    seq = Sequence([100 * seq_id + i for i in range(num_tokens)], SamplingParams(**params), seq_id=seq_id)
    seq.block_table = block_table
    return seq


def test_cached_chunks_first_and_rows_in_the_schedulers_order():
    fresh = sequence(1, 5, [7, 8], prompt_logprobs=1)  # its whole prompt: it samples, and scores 4 positions
    cached = sequence(2, 12, [0, 1, 2])  # 8 tokens in the cache, its last 4 now: it samples
    partial = sequence(3, 9, [5, 6, 9])  # its first 3 tokens: it does not sample
    out = SchedulerOutput(seqs=[fresh, cached, partial], num_computed=[0, 8, 0], num_scheduled=[5, 4, 3],
                          pending_rows=[-1, -1, -1], row_samples=[True, True, False], sampled=[fresh, cached])
    prefill = build_step_input(out, BLOCK_SIZE, eos_token_ids=frozenset())[0].prefill
    assert prefill.token_ids.tolist() == [208, 209, 210, 211, 100, 101, 102, 103, 104, 300, 301, 302]
    assert prefill.positions.tolist() == [8, 9, 10, 11, 0, 1, 2, 3, 4, 0, 1, 2]
    assert prefill.slot_mapping.tolist() == [8, 9, 10, 11, 28, 29, 30, 31, 32, 20, 21, 22]
    assert prefill.cu_seqlens_q.tolist() == [0, 4, 9, 12] and prefill.cu_seqlens_k.tolist() == [0, 12, 17, 20]
    assert prefill.block_tables.tolist() == [[0, 1, 2], [7, 8, -1], [5, 6, 9]]
    assert (prefill.num_paged_seqs, prefill.num_paged_tokens, prefill.max_paged_seqlen_q) == (1, 4, 4)
    assert (prefill.max_seqlen_q, prefill.max_seqlen_k) == (5, 12)
    assert prefill.sample_indices.tolist() == [8, 3]  # the fresh prompt's last token, then the cached one's
    assert prefill.prompt_logprob_indices.tolist() == [4, 5, 6, 7]
    assert prefill.prompt_logprob_token_ids.tolist() == [101, 102, 103, 104]


def test_no_cached_chunk_keeps_the_order():
    first, second = sequence(1, 3, [4]), sequence(2, 2, [6])
    out = SchedulerOutput(seqs=[first, second], num_computed=[0, 0], num_scheduled=[3, 2], pending_rows=[-1, -1],
                          row_samples=[True, True], sampled=[first, second])
    prefill = build_step_input(out, BLOCK_SIZE, eos_token_ids=frozenset())[0].prefill
    assert prefill.token_ids.tolist() == [100, 101, 102, 200, 201]
    assert (prefill.num_paged_seqs, prefill.num_paged_tokens) == (0, 0)
    assert prefill.sample_indices.tolist() == [2, 4]
    assert np.array_equal(prefill.cu_seqlens_q, prefill.cu_seqlens_k)


def test_padding_adds_a_sequence_that_stores_and_samples_nothing():
    fresh, cached, partial = sequence(1, 5, [7, 8]), sequence(2, 12, [0, 1, 2]), sequence(3, 9, [5, 6, 9])
    out = SchedulerOutput(seqs=[fresh, cached, partial], num_computed=[0, 8, 0], num_scheduled=[5, 4, 3],
                          pending_rows=[-1, -1, -1], row_samples=[True, True, False], sampled=[fresh, cached])
    prefill = build_step_input(out, BLOCK_SIZE, frozenset(), prompt_tokens_multiple=8)[0].prefill
    assert prefill.token_ids.tolist() == [208, 209, 210, 211, 100, 101, 102, 103, 104, 300, 301, 302, 0, 0, 0, 0]
    assert prefill.positions.tolist()[12:] == [0] * 4 and prefill.slot_mapping.tolist()[12:] == [-1] * 4
    assert prefill.cu_seqlens_q.tolist() == [0, 4, 9, 12, 16] and prefill.cu_seqlens_k.tolist() == [0, 12, 17, 20, 24]
    assert prefill.block_tables.tolist() == [[0, 1, 2], [7, 8, -1], [5, 6, 9], [-1, -1, -1]]
    assert (prefill.num_paged_seqs, prefill.num_paged_tokens, prefill.max_paged_seqlen_q) == (1, 4, 4)
    assert (prefill.max_seqlen_q, prefill.max_seqlen_k) == (5, 12)
    assert prefill.sample_indices.tolist() == [8, 3]


def test_a_step_of_cached_chunks_alone_is_not_padded():
    cached = sequence(2, 12, [0, 1, 2])  # a sequence of zeros would attend to its own keys: a second call a layer
    out = SchedulerOutput(seqs=[cached], num_computed=[8], num_scheduled=[3], pending_rows=[-1], row_samples=[False],
                          sampled=[])
    assert len(build_step_input(out, BLOCK_SIZE, frozenset(), prompt_tokens_multiple=8)[0].prefill.token_ids) == 3


def test_only_a_generating_cuda_engine_pads_and_within_its_token_budget():
    from types import SimpleNamespace

    from nanovllm.engine.input_builder import prompt_tokens_multiple
    engine = dict(device="cuda", runner="generate", max_num_batched_tokens=16384)
    assert prompt_tokens_multiple(SimpleNamespace(**engine)) == 32
    for change in (dict(device="cpu"), dict(runner="pooling"), dict(max_num_batched_tokens=1000)):
        assert prompt_tokens_multiple(SimpleNamespace(**{**engine, **change})) == 1
