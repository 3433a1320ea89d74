"""What the host writes into the decode graphs' input buffer (CPU: the layout is numpy): hand-worked rows,
padding and pending tokens."""
import numpy as np

from nanovllm.engine.cuda_graphs import InputLayout
from nanovllm.engine.input_builder import build_step_input
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_io import DecodeInputs, longest_first
from nanovllm.sampling_params import SamplingParams


def decodes() -> DecodeInputs:
    """Three decoding sequences; the second's and third's tokens are still on the device, in rows 4 and 0
    of the previous step's samples."""
    return DecodeInputs(
        token_ids=np.array([11, 0, 0]), pending_rows=np.array([-1, 4, 0]), positions=np.array([5, 9, 3]),
        slot_mapping=np.array([21, 42, 63], dtype=np.int32), context_lens=np.array([6, 10, 4], dtype=np.int32),
        seq_order=np.array([1, 0, 2], dtype=np.int32),
        block_tables=np.array([[1, -1], [2, 3], [4, -1]], dtype=np.int32))


def filled(sampling_slots, bs: int = 4, max_bs: int = 8, max_num_blocks: int = 5) -> dict:
    layout = InputLayout(max_bs, max_num_blocks, scratch_slot=99)
    buffer = np.full(layout.num_bytes, 0xAB, dtype=np.uint8)  # garbage: every row up to bs must be written
    views = layout.views(buffer)
    layout.fill(views, decodes(), sampling_slots, bs)
    assert (views["sampling_slots"][bs:] == 99).all() and (views["pending_rows"][bs:] == -1).all()  # copied too
    return {name: view[:bs].tolist() for name, view in views.items()}


def test_rows_then_padding_up_to_the_bucket():
    rows = filled(np.array([7, 0, 3]))
    assert rows["token_ids"] == [11, 0, 0, 0]
    assert rows["positions"] == [5, 9, 3, 0]
    assert rows["pending_rows"] == [-1, 4, 0, -1]
    assert rows["sampling_slots"] == [7, 0, 3, 99]
    assert rows["slot_mapping"] == [21, 42, 63, -1]
    assert rows["context_lens"] == [6, 10, 4, 0]
    assert rows["seq_order"] == [1, 0, 2, 3]  # the padding row after the decodes, as the host ordered them
    assert rows["block_tables"] == [[1, -1, -1, -1, -1], [2, 3, -1, -1, -1], [4, -1, -1, -1, -1], [-1] * 5]


def test_a_step_sampled_outside_the_graph_loads_the_scratch_slot():
    assert filled(None)["sampling_slots"] == [99] * 4


def test_attention_takes_the_longest_sequences_first():
    assert longest_first(np.array([6, 10, 4], dtype=np.int32)).tolist() == [1, 0, 2]
    assert longest_first(np.array([3, 7, 3, 9, 7], dtype=np.int32)).tolist() == [3, 1, 4, 0, 2]  # ties in row order


def test_a_decode_step_gives_its_rows_longest_first():
    """Three decodes of 6, 10 and 4 keys once this step's are stored, as the host builds them."""
    seqs = []
    for seq_id, num_tokens in enumerate([6, 10, 4]):
        seq = Sequence(list(range(num_tokens)), SamplingParams(), seq_id=seq_id)
        seq.block_table = [seq_id]
        seqs.append(seq)
    out = SchedulerOutput(seqs=seqs, num_computed=[5, 9, 3], num_scheduled=[1, 1, 1], pending_rows=[-1, -1, -1],
                          row_samples=[True] * 3, sampled=seqs, num_decode=3)
    decode = build_step_input(out, 16, eos_token_ids=frozenset())[0].decode
    assert decode.context_lens.tolist() == [6, 10, 4]
    assert decode.seq_order.tolist() == [1, 0, 2] and decode.seq_order.dtype == np.int32
