"""What a step leaves on the device between launch and result: a step whose model has run, waiting for its
sampler (structured outputs), and rank 0's sampled tokens on their way to the host."""
from typing import NamedTuple

import torch

from nanovllm.engine.step_io import StepInput, StepOutput
from nanovllm.layers.sampled_logprobs import SampledLogprobs


class UnsampledStep(NamedTuple):
    """A step whose model has run: its logits (rank 0's; None elsewhere) wait for the sampler."""

    step: StepInput
    logits: torch.Tensor | None
    slots: torch.Tensor | None  # the rows' sampling slots on the device, where they sample outside a graph
    graph_samples: bool
    prompt_logprobs: SampledLogprobs | None


class AsyncStepOutput:
    """Rank 0's sampled tokens of a step, with their log-probabilities and those of the scored prompt
    positions where asked for (or a pooling engine's pooled rows), copied to the host as the device finishes;
    `result()` waits for them."""

    def __init__(self, token_ids: torch.Tensor, logprobs: SampledLogprobs | None,
                 prompt_logprobs: SampledLogprobs | None = None, pooled: torch.Tensor | None = None):
        self.token_ids = _to_host(token_ids)
        self.pooled = _to_host(pooled) if pooled is not None else None
        self.logprobs, self.prompt_logprobs = (x.map(_to_host) if x is not None else None
                                               for x in (logprobs, prompt_logprobs))
        self.done = None
        if token_ids.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def result(self) -> StepOutput:
        if self.done is not None:
            self.done.synchronize()
        logprobs, prompt_logprobs = (x.map(torch.Tensor.tolist) if x is not None else None
                                     for x in (self.logprobs, self.prompt_logprobs))
        pooled = self.pooled.numpy() if self.pooled is not None else None  # by value through a rank's pipe
        return StepOutput(self.token_ids.tolist(), logprobs, prompt_logprobs, pooled)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy on the host (the tensor may be a view of a buffer the next step overwrites)."""
    if not t.is_cuda:
        return t.clone()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
