import numpy as np
import torch

from nanovllm.engine.device_inputs import PinnedStaging, aligned_offsets, view_as
from nanovllm.engine.step_input import StepInput
from nanovllm.utils.context import Context, set_context

MAX_CAPTURED_BATCH_SIZE = 1024


def decode_batch_buckets(max_bs: int) -> list[int]:
    """Decode batch sizes that get a graph: 1, 2, 4, 8, then multiples of 16 up to 256, of 32 up to 512,
    of 64 beyond (padded rows cost little: they read no keys), and max_bs itself."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32), *range(576, MAX_CAPTURED_BATCH_SIZE + 1, 64)]
    buckets = [bs for bs in sizes if bs <= max_bs]
    return buckets if buckets[-1] == max_bs else [*buckets, max_bs]


class InputLayout:
    """Where each decode input lies in one byte buffer, on the host and on the device alike. Rows past a
    batch are padding: no token, no key, no slot. Block tables come last, so a batch of b rows needs
    only the bytes up to block-table row b."""

    def __init__(self, max_bs: int, max_num_blocks: int):
        self.fields = dict(input_ids=(np.int64, (max_bs,), 0), positions=(np.int64, (max_bs,), 0),
                           pending_rows=(np.int64, (max_bs,), -1), temperatures=(np.float32, (max_bs,), 1.0),
                           slot_mapping=(np.int32, (max_bs,), -1), context_lens=(np.int32, (max_bs,), 0),
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

    def fill(self, views: dict, step: StepInput, temperatures: np.ndarray | None, n: int, bs: int):
        """Rows [0, n) from the step's decode rows, rows [n, bs) padding."""
        width = step.block_tables.shape[1]
        pending_rows = np.full(n, -1, dtype=np.int64)
        pending_rows[step.pending_indices] = step.pending_rows  # a decode row's token index is its row
        rows = dict(input_ids=step.token_ids[:n], positions=step.positions[:n], pending_rows=pending_rows,
                    temperatures=temperatures[:n] if temperatures is not None else 1.0,
                    slot_mapping=step.slot_mapping[:n], context_lens=step.seq_lens[:n])
        for name, values in rows.items():
            views[name][:n] = values
            views[name][n:bs] = self.fields[name][2]
        views["block_tables"][:n, :width] = step.block_tables[:n]
        views["block_tables"][:n, width:] = -1
        views["block_tables"][n:bs] = -1


class DecodeGraphs:
    """A decode step captured as CUDA graphs, one per batch-size bucket: `decode_step(input_ids, positions,
    pending_rows, temperatures, logits)` fills in the tokens the previous step left on the device, runs
    the model, writes its logits into `logits` (rows of this object's `logits`, [max_bs, logits_width];
    width 0 on ranks that hold none), which steps that sample otherwise read, and samples at each row's
    temperature where it stores the step's tokens.

    Graphs are captured largest first, so the smaller ones fit in what the largest leaves of their
    one shared memory pool. A batch replays the graph of the next bucket up. The graphs read their
    inputs from one device buffer laid out as the host fills it, so each replay's inputs arrive in one
    copy; it is sized for the largest batch and a sequence of max_model_len + 1 tokens.
    """

    @torch.inference_mode()
    def __init__(self, decode_step, max_bs: int, max_num_blocks: int, logits_width: int, dtype: torch.dtype,
                 device: torch.device):
        self.decode_step = decode_step
        self.buckets = decode_batch_buckets(max_bs)
        self.layout = InputLayout(max_bs, max_num_blocks)
        self.inputs = torch.zeros(self.layout.num_bytes, dtype=torch.uint8, device=device)
        self.buffers = self.layout.views(self.inputs)
        for name, (_, _, padding) in self.layout.fields.items():
            self.buffers[name].fill_(padding)
        self.logits = torch.zeros(max_bs, logits_width, dtype=dtype, device=device)
        self.staging = PinnedStaging()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for bs in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with set_context(self._context(bs)):
                self._forward(bs)  # Triton compiles or loads this batch size's kernels outside the capture
                with torch.cuda.graph(graph, pool):
                    self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def _context(self, bs: int) -> Context:
        b = self.buffers
        return Context(is_prefill=False, slot_mapping=b["slot_mapping"][:bs], context_lens=b["context_lens"][:bs],
                       block_tables=b["block_tables"][:bs])

    def _forward(self, bs: int):
        b = self.buffers
        self.decode_step(b["input_ids"][:bs], b["positions"][:bs], b["pending_rows"][:bs], b["temperatures"][:bs],
                         self.logits[:bs])

    def can_replay(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def bucket(self, batch_size: int) -> int:
        return next(size for size in self.buckets if size >= batch_size)

    def load(self, step: StepInput, temperatures: np.ndarray | None = None):
        """Copy the step's decode rows, and their temperatures where given, into the graphs' input buffer
        (without waiting)."""
        n = step.num_decode
        bs = self.bucket(n)
        num_bytes = self.layout.bytes_for(bs)
        self.layout.fill(self.layout.views(self.staging.host(self.layout.num_bytes)), step, temperatures, n, bs)
        self.staging.copy_to(self.inputs, num_bytes)

    def replay(self, n: int) -> torch.Tensor:
        """The logits of the n loaded rows ([n, vocab_size], rank 0's; the step's tokens are sampled too)."""
        self.graphs[self.bucket(n)].replay()
        return self.logits[:n]
