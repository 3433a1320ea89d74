from dataclasses import dataclass, field

from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import RequestMetrics
from nanovllm.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class Request:
    """A prompt and its `n` completions (one Sequence each), as LLMEngine tracks it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    num_sent: list[tuple[int, int]] = field(init=False)  # per completion, for DELTA outputs: (tokens, chars)

    def __post_init__(self):
        self.num_sent = [(0, 0)] * len(self.seqs)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)
