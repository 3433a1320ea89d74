from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, where it stands in the KV cache and what the next step computes.

    Tokens [0, num_cached_tokens) have their K/V in the cache; a step computes the next
    num_scheduled_tokens of them. When that reaches the last token, the step samples a new one.
    """

    counter = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams = SamplingParams(),
                 seed: int | None = None):
        self.seq_id = next(Sequence.counter)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.token_offset = 0  # index in token_ids of token 0; workers hold only the scheduled chunk
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_prompt_cache_hits = -1  # prompt tokens found in the cache at first admission
        self.block_table: list[int] = []
        self.sampling_params = sampling_params
        self.seed = sampling_params.seed if seed is None else seed
        self.finish_reason: str | None = None  # "stop" or "length"
        self.stop_reason: int | str | None = None
        self.output_text: str | None = None  # set when a stop string cut the text
        self.logprobs: list = []  # per generated token, when sampling_params.logprobs is set
        self.cumulative_logprob = 0.0

    def __len__(self):
        return self.num_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def scheduled_token_ids(self) -> list[int]:
        start = self.num_cached_tokens - self.token_offset
        return self.token_ids[start:start + self.num_scheduled_tokens]

    @property
    def samples_this_step(self) -> bool:
        """Whether the scheduled tokens reach the end of the sequence, so a new token is due."""
        return self.num_cached_tokens + self.num_scheduled_tokens == self.num_tokens

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
        self.num_tokens += 1

    def finish(self, reason: str, stop_reason: int | str | None = None):
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason

    # Workers need only what the step computes: the scheduled chunk (one token once decoding).
    def __getstate__(self):
        return (self.num_tokens, self.num_cached_tokens, self.num_scheduled_tokens, self.block_table,
                self.scheduled_token_ids)

    def __setstate__(self, state):
        (self.num_tokens, self.num_cached_tokens, self.num_scheduled_tokens, self.block_table,
         self.token_ids) = state
        self.token_offset = self.num_cached_tokens
