import torch
from torch import nn

from nanovllm.utils.context import Context, set_context

MAX_CAPTURED_BATCH_SIZE = 1024


def decode_batch_buckets(max_bs: int) -> list[int]:
    """Decode batch sizes that get a graph: 1, 2, 4, 8, then multiples of 16 up to 256, of 32 up to 512,
    of 64 beyond (padded rows cost little: they read no keys), and max_bs itself."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32), *range(576, MAX_CAPTURED_BATCH_SIZE + 1, 64)]
    buckets = [bs for bs in sizes if bs <= max_bs]
    return buckets if buckets[-1] == max_bs else [*buckets, max_bs]


class DecodeGraphs:
    """The decode forward captured as CUDA graphs, one per batch-size bucket.

    Graphs are captured largest first, so the smaller ones fit in what the largest leaves of their
    one shared memory pool. A batch replays the graph of the next bucket up, through static input
    buffers sized for the largest batch and for a sequence of max_model_len + 1 tokens.
    """

    @torch.inference_mode()
    def __init__(self, model: nn.Module, max_bs: int, max_num_blocks: int, hidden_size: int, device: torch.device):
        self.model = model
        self.buckets = decode_batch_buckets(max_bs)
        on_device = dict(device=device)
        self.buffers = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, **on_device),
            positions=torch.zeros(max_bs, dtype=torch.int64, **on_device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int32, **on_device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, **on_device),
            block_tables=torch.full((max_bs, max_num_blocks), -1, dtype=torch.int32, **on_device),
            outputs=torch.zeros(max_bs, hidden_size, dtype=model.model.norm.weight.dtype, **on_device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for bs in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with set_context(self._context(bs)):
                self._forward(bs)  # compiles this batch size outside the capture
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
        b["outputs"][:bs] = self.model(b["input_ids"][:bs], b["positions"][:bs])

    def can_replay(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """The last hidden states of a decode batch: [batch_size, hidden_size]."""
        bs = input_ids.size(0)
        b = self.buffers
        b["input_ids"][:bs] = input_ids
        b["positions"][:bs] = positions
        # Padded rows write no slot and attend to no key; no earlier replay's blocks stay behind.
        b["slot_mapping"].fill_(-1)
        b["slot_mapping"][:bs] = context.slot_mapping
        b["context_lens"].zero_()
        b["context_lens"][:bs] = context.context_lens
        b["block_tables"].fill_(-1)
        b["block_tables"][:bs, :context.block_tables.size(1)] = context.block_tables
        self.graphs[next(size for size in self.buckets if size >= bs)].replay()
        return b["outputs"][:bs]
