import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Context:
    """Per-step attention metadata, shared by every attention layer of the model.

    A step computes, for each sequence, a run of query tokens that ends at position
    `seqlens_k - 1`; the first `seqlens_k - seqlens_q` of its keys are already in the cache.
    """

    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1]
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1]
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None  # [num_tokens], -1 writes nothing
    context_lens: torch.Tensor | None = None  # [num_seqs], keys per sequence (decode)
    block_tables: torch.Tensor | None = None  # [num_seqs, max_num_blocks], -1 padded
    has_cached_prefix: bool = False


class _ThreadContext(threading.local):
    """One Context a thread, so that two engines stepped from two threads each see their own step."""

    context = Context()


_current = _ThreadContext()


def get_context() -> Context:
    return _current.context


@contextmanager
def set_context(context: Context):
    _current.context = context
    try:
        yield context
    finally:
        _current.context = Context()
