from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 for the most likely token
    decoded_token: str | None = None


# At each generated position: token id -> its Logprob (the top-k and the sampled token).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
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
