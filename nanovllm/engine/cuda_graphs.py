from dataclasses import fields

import numpy as np
import torch

from nanovllm.engine.device_inputs import PinnedStaging, aligned_offsets, view_as
from nanovllm.engine.step_io import DecodeInputs
from nanovllm.layers.sampler import CANDIDATES, NO_FILTER

MAX_CAPTURED_BATCH_SIZE = 1024
GRAPH_FILTERS = (NO_FILTER, CANDIDATES)  # a full sort's memory grows with the batch: it samples outside a graph
GRAPH_LOGPROBS = 20  # the top log-probabilities a logprobs graph computes (vLLM's max_logprobs); more go outside


def decode_batch_buckets(max_bs: int) -> list[int]:
    """Decode batch sizes that get a graph: 1, 2, 4, 8, then multiples of 16 up to 256, of 32 up to 512,
    of 64 beyond (padded rows cost little: they read no keys), and max_bs itself."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32), *range(576, MAX_CAPTURED_BATCH_SIZE + 1, 64)]
    buckets = [bs for bs in sizes if bs <= max_bs]
    return buckets if buckets[-1] == max_bs else [*buckets, max_bs]


class InputLayout:
    """Where each decode input (DecodeInputs' fields, and the rows' sampling slots) lies in one byte buffer,
    on the host and on the device alike. Rows past a batch are padding: no token, no key, no cache slot,
    the sampler's scratch slot, and last in attention's order (`seq_order`). Block tables come last, so a
    batch of b rows needs only the bytes up to block-table row b."""

    def __init__(self, max_bs: int, max_num_blocks: int, scratch_slot: int):
        self.fields = dict(token_ids=(np.int64, (max_bs,), 0), pending_rows=(np.int64, (max_bs,), -1),
                           positions=(np.int64, (max_bs,), 0), slot_mapping=(np.int32, (max_bs,), -1),
                           context_lens=(np.int32, (max_bs,), 0),
                           seq_order=(np.int32, (max_bs,), np.arange(max_bs, dtype=np.int32)),
                           sampling_slots=(np.int64, (max_bs,), scratch_slot),
                           block_tables=(np.int32, (max_bs, max_num_blocks), -1))
        sizes = [np.dtype(dtype).itemsize * int(np.prod(shape)) for dtype, shape, _ in self.fields.values()]
        offsets, self.num_bytes = aligned_offsets(sizes)
        self.offsets = dict(zip(self.fields, offsets))
        self.row_bytes = 4 * max_num_blocks

    def views(self, buffer) -> dict:
        return {name: view_as(buffer, self.offsets[name], dtype, shape)
                for name, (dtype, shape, _) in self.fields.items()}

    def bytes_for(self, bs: int) -> int:
        return self.offsets["block_tables"] + bs * self.row_bytes

    def fill(self, views: dict, decode: DecodeInputs, sampling_slots: np.ndarray | None, bs: int):
        """Rows [0, n) from the decodes, the rest padding: of the per-row fields every row to max_bs (they are
        copied whole), of the block tables rows [n, bs); the scratch slot where no slots are given."""
        n, width = decode.num_seqs, decode.block_tables.shape[1]
        rows = {field.name: getattr(decode, field.name) for field in fields(decode) if field.name != "block_tables"}
        rows["sampling_slots"] = sampling_slots if sampling_slots is not None else self.fields["sampling_slots"][2]
        for name, values in rows.items():
            views[name][:n] = values
            padding = self.fields[name][2]
            views[name][n:] = padding[n:] if isinstance(padding, np.ndarray) else padding
        views["block_tables"][:n, :width] = decode.block_tables
        views["block_tables"][:n, width:] = -1
        views["block_tables"][n:bs] = -1


class DecodeGraphs:
    """Decode steps captured as CUDA graphs, per batch-size bucket: `run_model(inputs, logits)`, the model
    from a bucket's DecodeInputs (views of one device buffer) to its logits (rows of this object's
    `logits`, [max_bs, logits_width]; width 0 on ranks that hold none); `sample(logits, slots, filter)`,
    the sampler on those logits for each of GRAPH_FILTERS, which keeps the step's tokens; and, where
    `logprobs` is given (the sampling rank), `logprobs(logits, bs)`, the top GRAPH_LOGPROBS
    log-probabilities of the rows and of their tokens. A step sampled otherwise replays the first graph
    and samples its logits outside.

    Graphs are captured largest first, so the smaller ones fit in what the largest leave of their one
    shared memory pool. A batch replays the graphs of the next bucket up. The inputs arrive in one copy,
    laid out as the host fills them; the buffer is sized for the largest batch and a sequence of
    max_model_len + 1 tokens.
    """

    @torch.inference_mode()
    def __init__(self, run_model, sample, logprobs, max_bs: int, max_num_blocks: int, scratch_slot: int,
                 logits_width: int, dtype: torch.dtype, device: torch.device):
        self.buckets = decode_batch_buckets(max_bs)
        self.layout = InputLayout(max_bs, max_num_blocks, scratch_slot)
        self.inputs = torch.zeros(self.layout.num_bytes, dtype=torch.uint8, device=device)
        self.buffers = self.layout.views(self.inputs)
        for name, (_, _, padding) in self.layout.fields.items():
            self.buffers[name].copy_(torch.as_tensor(padding))
        self.logits = torch.zeros(max_bs, logits_width, dtype=dtype, device=device)
        self.staging = PinnedStaging()
        self.decode_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sample_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logprobs_graphs: dict[int, tuple[torch.cuda.CUDAGraph, object]] = {}
        pool = None
        for bs in reversed(self.buckets):
            logits, slots = self.logits[:bs], self.buffers["sampling_slots"][:bs]
            self.decode_graphs[bs], pool, _ = capture(pool, run_model, self.decode_inputs(bs), logits)
            for filter in GRAPH_FILTERS:
                self.sample_graphs[bs, filter], pool, _ = capture(pool, sample, logits, slots, filter)
            if logprobs is not None:
                graph, pool, out = capture(pool, logprobs, logits, bs)
                self.logprobs_graphs[bs] = graph, out

    def decode_inputs(self, bs: int) -> DecodeInputs:
        """The first bs rows of the device buffer."""
        return DecodeInputs(**{field.name: self.buffers[field.name][:bs] for field in fields(DecodeInputs)})

    def can_replay(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def can_sample(self, filter: int, num_logprobs: int | None) -> bool:
        return filter in GRAPH_FILTERS and (num_logprobs is None or num_logprobs <= GRAPH_LOGPROBS)

    def bucket(self, batch_size: int) -> int:
        return next(size for size in self.buckets if size >= batch_size)

    def load(self, decode: DecodeInputs, sampling_slots: np.ndarray | None = None):
        """Copy the decodes, and their sampling slots where a sample graph is to run, into the graphs' input
        buffer (without waiting)."""
        bs = self.bucket(decode.num_seqs)
        self.layout.fill(self.layout.views(self.staging.host(self.layout.num_bytes)), decode, sampling_slots, bs)
        self.staging.copy_to(self.inputs, self.layout.bytes_for(bs))

    def replay_decode(self, n: int) -> torch.Tensor:
        """The logits of the n loaded rows ([n, vocab_size] on rank 0; width 0 elsewhere)."""
        self.decode_graphs[self.bucket(n)].replay()
        return self.logits[:n]

    def replay_sample(self, n: int, filter: int):
        """Sample the n rows whose logits the decode graph just wrote, from their loaded slots."""
        self.sample_graphs[self.bucket(n), filter].replay()

    def replay_logprobs(self, n: int, k: int):
        """The top k log-probabilities of the n rows just sampled, and their tokens'."""
        graph, out = self.logprobs_graphs[self.bucket(n)]
        graph.replay()
        return out.map(lambda column: column[:n, :k] if column.dim() == 2 else column[:n])


def capture(pool, fn, *args) -> tuple[torch.cuda.CUDAGraph, object, object]:
    """fn(*args) captured as a graph in `pool` (None: a new one), after one run outside the capture, where
    Triton compiles or loads its kernels for these shapes; the pool; and what the captured call returned
    (its tensors are the graph's, rewritten at each replay)."""
    graph = torch.cuda.CUDAGraph()
    fn(*args)
    with torch.cuda.graph(graph, pool):
        out = fn(*args)
    torch.cuda.synchronize()
    return graph, graph.pool(), out
