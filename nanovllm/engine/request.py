from dataclasses import dataclass, field

from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import FlatLogprobs, PositionLogprobs, RequestMetrics
from nanovllm.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class CompletionState:
    """What the output processor keeps of one completion: its text as it grows (where it is needed token
    by token), its log-probabilities, and how much of them DELTA outputs have already sent."""

    detokenizer: IncrementalDetokenizer | None = None
    logprobs: FlatLogprobs = field(default_factory=FlatLogprobs)  # per generated token, where asked for
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


@dataclass(slots=True, eq=False)
class Request:
    """A prompt and its `n` completions as LLMEngine tracks them: a Sequence each for the scheduler, and a
    CompletionState each for the output processor."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    completions: list[CompletionState] = field(init=False)
    detokenizes_per_token: bool = False  # its completions carry detokenizers (the output processor's choice)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=lambda: [None])  # per prompt position
    grammar: object = None  # the compiled constraint of params.structured_outputs (engine/structured_outputs.py)
    pooling_params: object = None  # a pooling engine's request: its PoolingParams (engine/pooling.py)

    def __post_init__(self):
        self.completions = [CompletionState() for _ in self.seqs]

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all(): asked of every running request at every step
            if not seq.is_finished:
                return False
        return True

    def completion(self, seq: Sequence) -> CompletionState:
        return self.completions[self.seqs.index(seq)]
