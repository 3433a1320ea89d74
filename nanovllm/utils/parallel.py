"""The tensor-parallel rank and size of the model being built in this process.

Layers read them once, when they are built, and call torch.distributed only when the size is above 1:
at tensor_parallel_size 1 there is no process group at all, so any number of such engines can live
in one process.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist

_rank, _size = 0, 1


def get_tp_rank() -> int:
    return _rank


def get_tp_size() -> int:
    return _size


@contextmanager
def tensor_parallel(rank: int, size: int):
    """Build the model's layers for rank `rank` of `size` inside this block."""
    global _rank, _size
    saved = _rank, _size
    _rank, _size = rank, size
    try:
        yield
    finally:
        _rank, _size = saved


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the tensor-parallel ranks, in place (x is a layer's own new output)."""
    dist.all_reduce(x)
    return x
