"""vLLM's PoolingParams: what an embedding request asks of its pooled vector."""
from dataclasses import dataclass


@dataclass
class PoolingParams:
    """`dimensions`: keep the embedding's first `dimensions` values (Matryoshka models only, whose config says
    `is_matryoshka` or lists `matryoshka_dimensions`); `use_activation`: normalise the embedding to unit length
    (None: True, as vLLM's embed does); `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: the
    last max_model_len)."""

    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be None or an integer, got {value!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens not in (-1,) and \
                self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or >= 1, got {self.truncate_prompt_tokens}")
        if self.use_activation not in (None, True, False):
            raise ValueError(f"use_activation must be None, True or False, got {self.use_activation!r}")

    @property
    def normalize(self) -> bool:
        return self.use_activation is not False
