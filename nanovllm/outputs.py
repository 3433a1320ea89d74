from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 for the most likely token
    decoded_token: str | None = None


# At each generated position: token id -> its Logprob (the top-k and the sampled token).
PositionLogprobs = dict[int, Logprob]


class FlatLogprobs(Sequence):
    """A completion's PositionLogprobs, one per generated token, kept in flat lists (as vLLM's FlatLogprobs):
    a position's dict of Logprobs is made when it is read. A dict and k + 1 objects a token, kept for the
    whole run, cost more in Python's garbage collector, which walks them again and again, than making them
    did (`benchmarks/host_loop.py`, docs/benchmarks.md)."""

    __slots__ = ("starts", "token_ids", "logprobs", "ranks", "decoded_tokens")

    def __init__(self):
        self.starts: list[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.decoded_tokens: list[str | None] = []

    def append_position(self, token_ids: list[int], logprobs: list[float], ranks: list[int],
                        decoded_tokens: list[str | None]):
        self.starts.append(len(self.token_ids))
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.ranks += ranks
        self.decoded_tokens += decoded_tokens

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # a negative index counted from the end; IndexError past either end
        start = self.starts[index]
        end = self.starts[index + 1] if index + 1 < len(self) else len(self.token_ids)
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(start, end)}

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: FlatLogprobs | list[PositionLogprobs] | None  # a sequence of PositionLogprobs either way
    finish_reason: str | None  # "stop" (EOS, a stop string or stop token id), "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or token id; None for EOS or length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """When a request arrived, was first scheduled, got its first and last token, and finished
    (time.time() seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result, with vLLM's fields. `out["text"]` and `out["token_ids"]` give the first
    completion's, as nano-vllm's dicts did."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None at the first position

    def __getitem__(self, key: str):
        if key in ("text", "token_ids"):
            return getattr(self.outputs[0], key)
        raise KeyError(f"{key!r}: use the attribute instead (this output answers 'text' and 'token_ids')")


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's PoolingRequestOutput: a pooling engine's result for one request, finished."""

    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class PoolingOutput:
    """vLLM's PoolingOutput: what `LLM.encode` gives for a prompt, its pooled values as a tensor."""

    data: "torch.Tensor"


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: the pooled vector of a prompt."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(PoolingRequestOutput):
    """vLLM's EmbeddingRequestOutput: what `LLM.embed` returns for each prompt (an EmbeddingOutput)."""

    __slots__ = ()


@dataclass(slots=True)
class ClassificationOutput:
    """vLLM's ClassificationOutput: a prompt's class probabilities (its scores, with use_activation=False)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(PoolingRequestOutput):
    """vLLM's ClassificationRequestOutput: what `LLM.classify` returns for each prompt (a ClassificationOutput)."""

    __slots__ = ()


@dataclass(slots=True)
class ScoringOutput:
    """vLLM's ScoringOutput: a pair's score."""

    score: float


class ScoringRequestOutput(PoolingRequestOutput):
    """vLLM's ScoringRequestOutput: what `LLM.score` returns for each pair (a ScoringOutput)."""

    __slots__ = ()
