from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import on_cuda
from nanovllm.layers.activation import silu_and_mul, silu_and_mul_linear
from nanovllm.utils.fp8_weights import BLOCK, FP8, dequantize, get_fp8_scheme, quantize, scale_region, scale_shape
from nanovllm.utils.loader import copy_weight
from nanovllm.utils.parallel import all_reduce, get_tp_rank, get_tp_size


class LinearBase(nn.Module):
    """A linear layer whose weight is split across tensor-parallel ranks along `tp_dim` (0: output rows, 1: input
    columns); on CUDA Triton kernels take one-row inputs (a decode step of one sequence). Built under an FP8
    scheme (`utils/fp8_weights.py`), the weight is kept in e4m3 beside its `weight_scale`, and the matmul reads
    it as it is (on a CPU through its dequantized copy), unless the checkpoint leaves the `modules` the layer holds
    (their names in the checkpoint: q/k/v's three) unquantized."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int = 0,
                 modules: Sequence[str] = ()):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.fp8_scheme = get_fp8_scheme(modules)
        dtype = FP8 if self.fp8_scheme else None
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weights = (self.weight,)  # what the matmul reads: the weight, and its scale where it is FP8
        if self.fp8_scheme:
            shape = scale_shape(self.fp8_scheme, output_size, input_size)
            self.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
            self.weight_scale.weight_loader = self.weight_loader
            self.weights = (self.weight, self.weight_scale)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.linear = linear_for(self.fp8_scheme, takes_gate_up=False)
        # On CUDA a per-channel FP8 matmul takes rows the norm before it rounded to e4m3 per token (FP8Rows)
        self.takes_quantized_rows = self.fp8_scheme == "channel" and on_cuda()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor):
        size = self.weight.size(self.tp_dim)
        self.load_region(param, loaded_weight, self.tp_rank * size, 0, size)

    def load_region(self, param: nn.Parameter, loaded: torch.Tensor, source_start: int, target_start: int, size: int):
        """Copy [source_start, source_start + size) of the checkpoint tensor along tp_dim (in the weight's rows or
        columns, whatever param is) into [target_start, target_start + size) of param."""
        if param is self.bias and self.tp_dim == 1:  # a row-parallel layer's bias is whole on every rank
            copy_weight(param.data, loaded)
        elif param is self.bias or not self.fp8_scheme:
            dim = 0 if param is self.bias else self.tp_dim
            check_whole(loaded, dim, size * self.tp_size)
            copy_weight(param.data.narrow(dim, target_start, size), loaded.narrow(dim, source_start, size))
        else:
            load_fp8_region(self.weight.data, self.weight_scale.data, self.fp8_scheme, loaded,
                            param is self.weight_scale, self.tp_dim, source_start, target_start, size,
                            size * self.tp_size,
                            what=f"{type(self).__name__} of rank {self.tp_rank} of {self.tp_size}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, *self.weights, self.bias)


class ColumnParallelLinear(LinearBase):
    """Splits the output features: each rank computes its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, modules: Sequence[str] = ()):
        tp_size = get_tp_size()
        assert output_size % tp_size == 0
        super().__init__(input_size, output_size // tp_size, bias, tp_dim=0, modules=modules)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one weight (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, modules: Sequence[str] = ()):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, modules)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int):
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        self.load_region(param, loaded_weight, self.tp_rank * shard_size, shard_offset, shard_size)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections as one weight; each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, modules: Sequence[str] = ()):
        tp_size = get_tp_size()
        self.head_size = head_size
        self.num_heads = total_num_heads // tp_size
        self.num_kv_heads = total_num_kv_heads // tp_size
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias, modules)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str):
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        shard_offset, shard_size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            loaded_shard_id]
        self.load_region(param, loaded_weight, self.tp_rank * shard_size, shard_offset, shard_size)


class RowParallelLinear(LinearBase):
    """Splits the input features: each rank computes a partial sum, then all ranks add them up. With
    `takes_gate_up`, the input is a gated MLP's [gate | up] (twice input_size), of which the layer takes
    silu(gate) * up: the activation and this matmul are one kernel for a one-row input on CUDA."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, takes_gate_up: bool = False,
                 modules: Sequence[str] = ()):
        tp_size = get_tp_size()
        assert input_size % tp_size == 0
        super().__init__(input_size // tp_size, output_size, bias, tp_dim=1, modules=modules)
        if takes_gate_up:
            self.linear = linear_for(self.fp8_scheme, takes_gate_up=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, *self.weights, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y) if self.tp_size > 1 else y


def linear_for(fp8_scheme: str | None, takes_gate_up: bool):
    """The matmul a layer built here runs: (x, weight[, scale], bias) -> y; with takes_gate_up, of
    silu(gate) * up for x = [gate | up]."""
    if on_cuda():
        from nanovllm.kernels import fp8_linear, one_row_linear
        kernels = fp8_linear if fp8_scheme else one_row_linear
        return kernels.silu_and_mul_linear if takes_gate_up else kernels.linear
    if not fp8_scheme:
        return silu_and_mul_linear if takes_gate_up else F.linear
    if takes_gate_up:
        return lambda x, weight, scale, bias: dequantized_linear(silu_and_mul(x), weight, scale, bias)
    return dequantized_linear


def dequantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference an FP8 weight's kernels are held to: F.linear on the weight dequantized to x's dtype."""
    return F.linear(x, dequantize(weight, scale).to(x.dtype), bias)


def load_fp8_region(weight: torch.Tensor, scale: torch.Tensor, scheme: str, loaded: torch.Tensor, loads_scale: bool,
                    dim: int, source_start: int, target_start: int, size: int, source_total: int, what: str):
    """Copy rows (dim 0) or columns (dim 1) [source_start, source_start + size) of a checkpoint tensor (of
    `source_total` along dim) into [target_start, target_start + size) of a kept FP8 weight: an FP8 weight as it
    is; a scale (`loads_scale`) block by block or row by row, a value per tensor repeated; an unquantized weight
    (quantization="fp8") quantized here, with its scale."""
    if not loads_scale and loaded.dtype != FP8:
        quantized, quantized_scale = quantize(loaded.to(weight.device), scheme)  # whole rows, as a CPU does at load
        for tensor, is_scale in ((quantized, False), (quantized_scale, True)):
            load_fp8_region(weight, scale, scheme, tensor, is_scale, dim, source_start, target_start, size,
                            source_total, what)
        return
    if not loads_scale:
        check_whole(loaded, dim, source_total)
        copy_weight(weight.narrow(dim, target_start, size), loaded.narrow(dim, source_start, size))
        return
    target_scale = scale_region(scale, scheme, dim, target_start, size, weight.size(dim), what)
    if loaded.numel() == 1:  # one scale for the whole tensor
        target_scale.fill_(loaded.item())
    else:
        source = loaded.reshape(-1, 1) if scheme == "channel" else loaded
        if scheme == "block" or dim == 0:
            check_whole(source, dim, source_total if scheme == "channel" else -(-source_total // BLOCK))
        copy_weight(target_scale, scale_region(source, scheme, dim, source_start, size, source_total, what))


def check_whole(loaded: torch.Tensor, dim: int, expected: int):
    """A checkpoint tensor of which each rank takes a share must be as large as the config makes the whole:
    a larger one would load in part without a word. (RuntimeError: the loader names the tensor and the shapes.)"""
    if loaded.size(dim) != expected:
        raise RuntimeError(f"{loaded.size(dim)} along dimension {dim} where the model's config gives {expected}")
