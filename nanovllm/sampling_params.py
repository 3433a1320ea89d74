from dataclasses import dataclass
from enum import Enum


class RequestOutputKind(Enum):
    """What LLMEngine.step() returns for a request as it progresses (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far, at every step
    DELTA = 1  # only what this step added
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass(slots=True)
class SamplingParams:
    """How to sample a request's completions, with vLLM's names and meanings.

    n: completions of the prompt; they share its KV blocks through the prefix cache.
    temperature: 0 picks the most likely token (greedy); larger values flatten the distribution.
    top_p: keep the most likely tokens whose probabilities add up to at least top_p, in (0, 1].
    top_k: keep the k most likely tokens; 0 or -1 keeps all.
    min_p: drop tokens less likely than min_p times the most likely token's probability, in [0, 1].
        The filters apply in vLLM's order: min_p, then top_k, then top_p on what is left.
    seed: the same seed gives the same completion, whatever else is in the batch.
    stop: strings that end the completion at their first match; the match is cut from the text
        unless include_stop_str_in_output.
    stop_token_ids: token ids that end the completion (and stay in it).
    min_tokens: end-of-sequence and stop_token_ids are suppressed until this many tokens exist.
    max_tokens: the most tokens to generate.
    ignore_eos: keep generating past the end-of-sequence token, up to max_tokens.
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logits of tokens already
        generated, once (presence) or once per occurrence (frequency).
    repetition_penalty: > 0; divides positive and multiplies negative logits of tokens in the prompt
        or the completion so far (1 is off).
    logprobs: also return, at each generated position, the log-probabilities of the `logprobs` most
        likely tokens and of the sampled one (0: only the sampled one's), from the model's raw logits.
    skip_special_tokens: leave special tokens out of the text.
    output_kind: what LLMEngine.step() returns as the request progresses; LLM.generate() waits for
        the end whatever it says.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    max_tokens: int = 64
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_ranges()
        self._check_stops()

    def _check_ranges(self):
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0 (0 is greedy)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 or 0 (off) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, f"must be in [0, max_tokens={self.max_tokens}]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be None or >= 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)}")

    def _check_stops(self):
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must hold non-negative token ids, got {self.stop_token_ids}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)
