import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import on_cuda
from nanovllm.layers.activation import silu_and_mul_linear
from nanovllm.utils.loader import copy_weight
from nanovllm.utils.parallel import all_reduce, get_tp_rank, get_tp_size


class LinearBase(nn.Module):
    """A linear layer whose weight may be split across tensor-parallel ranks along `tp_dim`; on CUDA a
    Triton kernel takes one-row inputs (a decode step of one sequence)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int | None = None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.linear = F.linear
        if on_cuda():
            from nanovllm.kernels import one_row_linear
            self.linear = one_row_linear.linear

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor):
        if self.tp_dim is not None:
            shard_size = param.size(self.tp_dim)
            loaded_weight = loaded_weight.narrow(self.tp_dim, self.tp_rank * shard_size, shard_size)
        copy_weight(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Splits the output features: each rank computes its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp_size = get_tp_size()
        assert output_size % tp_size == 0
        super().__init__(input_size, output_size // tp_size, bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one weight (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int):
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        target = param.data.narrow(self.tp_dim, shard_offset, shard_size)
        copy_weight(target, loaded_weight.chunk(self.tp_size, self.tp_dim)[self.tp_rank])


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections as one weight; each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_tp_size()
        self.head_size = head_size
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = total_num_kv_heads // tp_size
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str):
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        shard_offset, shard_size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            loaded_shard_id]
        target = param.data.narrow(self.tp_dim, shard_offset, shard_size)
        copy_weight(target, loaded_weight.chunk(self.tp_size, self.tp_dim)[self.tp_rank])


class RowParallelLinear(LinearBase):
    """Splits the input features: each rank computes a partial sum, then all ranks add them up. With
    `takes_gate_up`, the input is a gated MLP's [gate | up] (twice input_size), of which the layer takes
    silu(gate) * up: the activation and this matmul are one kernel for a one-row input on CUDA."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, takes_gate_up: bool = False):
        tp_size = get_tp_size()
        assert input_size % tp_size == 0
        super().__init__(input_size // tp_size, output_size, bias, tp_dim=1)
        if takes_gate_up:
            self.linear = silu_and_mul_linear
            if on_cuda():
                from nanovllm.kernels import one_row_linear
                self.linear = one_row_linear.silu_and_mul_linear

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor):
        if param.dim() == 1:  # the bias is not split
            copy_weight(param.data, loaded_weight)
        else:
            super().weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y) if self.tp_size > 1 else y
