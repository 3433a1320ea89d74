from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SampledLogprobs:
    """Raw log-probabilities (before penalties, temperature and filters) of a step's rows: tensors on the
    device, lists once a step's output reaches the host (`map`)."""

    top_ids: torch.Tensor | list  # [num_rows, k]
    top_logprobs: torch.Tensor | list  # [num_rows, k]
    sampled_logprobs: torch.Tensor | list  # [num_rows]
    sampled_ranks: torch.Tensor | list  # [num_rows], 1 for the most likely token

    def columns(self) -> list:
        return [self.top_ids, self.top_logprobs, self.sampled_logprobs, self.sampled_ranks]

    def map(self, fn) -> "SampledLogprobs":
        """The record with fn applied to each column: e.g. copied to the host, or as lists there."""
        return SampledLogprobs(*map(fn, self.columns()))
