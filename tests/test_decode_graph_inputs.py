"""What the host writes into the decode graphs' input buffer (CPU: the layout is numpy), and which steps
a graph samples: hand-worked rows, padding and pending tokens."""
import numpy as np

from nanovllm.engine.cuda_graphs import InputLayout
from nanovllm.engine.sampling_batch import make_sampling_batch
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_io import DecodeInputs
from nanovllm.sampling_params import SamplingParams


def decodes() -> DecodeInputs:
    """Three decoding sequences; the second's and third's tokens are still on the device, in rows 4 and 0
    of the previous step's samples."""
    return DecodeInputs(
        token_ids=np.array([11, 0, 0]), pending_rows=np.array([-1, 4, 0]), positions=np.array([5, 9, 3]),
        slot_mapping=np.array([21, 42, 63], dtype=np.int32), context_lens=np.array([6, 10, 4], dtype=np.int32),
        block_tables=np.array([[1, -1], [2, 3], [4, -1]], dtype=np.int32))


def filled(temperatures, bs: int = 4, max_bs: int = 8, max_num_blocks: int = 5) -> dict:
    layout = InputLayout(max_bs, max_num_blocks)
    buffer = np.full(layout.num_bytes, 0xAB, dtype=np.uint8)  # garbage: every row up to bs must be written
    views = layout.views(buffer)
    layout.fill(views, decodes(), temperatures, bs)
    return {name: view[:bs].tolist() for name, view in views.items()}


def test_rows_then_padding_up_to_the_bucket():
    rows = filled(np.array([0.5, 0.0, 1.5], dtype=np.float32))
    assert rows["token_ids"] == [11, 0, 0, 0]
    assert rows["positions"] == [5, 9, 3, 0]
    assert rows["pending_rows"] == [-1, 4, 0, -1]
    assert rows["temperatures"] == [0.5, 0.0, 1.5, 1.0]
    assert rows["slot_mapping"] == [21, 42, 63, -1]
    assert rows["context_lens"] == [6, 10, 4, 0]
    assert rows["block_tables"] == [[1, -1, -1, -1, -1], [2, 3, -1, -1, -1], [4, -1, -1, -1, -1], [-1] * 5]


def test_a_step_sampled_outside_the_graph_loads_temperature_one():
    assert filled(None)["temperatures"] == [1.0] * 4


def test_only_temperatures_keep_a_batch_plain():
    def batch(**params):
        seq = Sequence([1, 2], SamplingParams(**params), seq_id=0)
        seq.add_pending_token(0)
        return make_sampling_batch([seq], vocab_size=100, eos_token_ids={0})
    assert batch(temperature=0.7).is_plain and batch(temperature=0.0).is_plain
    for params in (dict(logprobs=2), dict(top_k=5), dict(top_p=0.5), dict(min_p=0.1), dict(seed=3),
                   dict(presence_penalty=0.5), dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[4, 5]),
                   dict(min_tokens=2)):
        assert not batch(temperature=0.7, **params).is_plain, params
