from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's completion.

    temperature: 0 picks the most likely token (greedy); larger values flatten the distribution.
    max_tokens: the most tokens to generate.
    ignore_eos: keep generating past the end-of-sequence token, up to `max_tokens`.
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
