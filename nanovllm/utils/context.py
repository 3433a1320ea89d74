import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Context:
    """Per-step attention metadata, shared by every attention layer of the model.

    A step computes, for each sequence, a run of query tokens that ends at position
    `seqlens_k - 1`; the first `seqlens_k - seqlens_q` of its keys are already in the cache. A prefill's
    sequences with keys in the cache (a prefix hit, an earlier chunk) come first: their queries attend through
    the block tables, the others' over the step's own keys.
    """

    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1]
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1]
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None  # [num_tokens], -1 writes nothing
    context_lens: torch.Tensor | None = None  # [num_seqs], keys per sequence (decode)
    seq_order: torch.Tensor | None = None  # [num_seqs], the rows longest first (decode attention's program order)
    block_tables: torch.Tensor | None = None  # [num_seqs, max_num_blocks], -1 padded
    num_paged_seqs: int = 0  # the leading sequences of a prefill that attend over the cache
    num_paged_tokens: int = 0  # their query tokens
    max_paged_seqlen_q: int = 0  # the longest of their chunks
    cu_seqlens_fresh: torch.Tensor | None = None  # [num_others + 1] the others' cu_seqlens, from 0 (None: none)

    @property
    def attends_own_keys(self) -> bool:
        """Whether some of a prefill's sequences attend over the step's own keys rather than the cache's."""
        return self.is_prefill and (self.num_paged_seqs == 0 or self.cu_seqlens_fresh is not None)


def prefill_context(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                    slot_mapping: torch.Tensor | None, block_tables: torch.Tensor | None, num_paged_seqs: int = 0,
                    num_paged_tokens: int = 0, max_paged_seqlen_q: int = 0) -> Context:
    """A prefill's Context, whose first num_paged_seqs sequences (num_paged_tokens query tokens, in chunks of up to
    max_paged_seqlen_q) attend over the cache, and the others' cu_seqlens, counted from the first of their tokens."""
    num_seqs = cu_seqlens_q.numel() - 1
    fresh = None
    if num_paged_seqs < num_seqs:
        fresh = cu_seqlens_q[num_paged_seqs:] - num_paged_tokens if num_paged_seqs else cu_seqlens_q
    return Context(is_prefill=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, slot_mapping=slot_mapping, block_tables=block_tables,
                   num_paged_seqs=num_paged_seqs, num_paged_tokens=num_paged_tokens,
                   max_paged_seqlen_q=max_paged_seqlen_q, cu_seqlens_fresh=fresh)


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
