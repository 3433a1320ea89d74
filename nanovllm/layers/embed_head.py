import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.loader import copy_weight
from nanovllm.utils.parallel import all_reduce, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows across tensor-parallel ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        assert num_embeddings % self.tp_size == 0
        self.num_embeddings_per_partition = num_embeddings // self.tp_size
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor):
        shard_size = param.size(0)
        copy_weight(param.data, loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = F.embedding(mask * (x - self.vocab_start_idx), self.weight) * mask.unsqueeze(1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; rank 0 gathers every rank's slice of the logits, into `out` where given."""

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.tp_size == 1:
            return F.linear(x, self.weight) if out is None else torch.matmul(x, self.weight.t(), out=out)
        logits = F.linear(x, self.weight)  # [num_tokens, vocab_size // tp_size]
        all_logits = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, all_logits, 0)
        return torch.cat(all_logits, -1, out=out) if self.tp_rank == 0 else None
