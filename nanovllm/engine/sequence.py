from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One completion of a request as the scheduler sees it: its tokens and where it stands in the KV cache.

    Tokens [0, num_computed_tokens) have their K/V in the cache, or will have once the steps already
    scheduled have run. `num_tokens` also counts a token that a step still on the device is sampling:
    its id is not known here yet (`num_pending_tokens`, at most one), so `token_ids` holds
    num_tokens - num_pending_tokens ids. `pending_row` is that token's row among its step's samples.
    `num_cached_tokens` counts the prompt tokens found in the prefix cache when it was first admitted.
    Its text and log-probabilities are the output processor's (`Request.completions`).
    """

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 seed: int | None = None, bad_words_token_ids: list[list[int]] = (), *, seq_id: int):
        sampling_params = sampling_params or SamplingParams()
        assert seed is None or sampling_params.seed is not None, "a completion's seed derives from its params'"
        self.seq_id = seq_id  # unique within its engine (the input processor numbers them)
        self.status = SequenceStatus.WAITING
        self.is_finished = False  # status is FINISHED: asked of every running sequence at every step
        self.token_ids = list(token_ids)
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_pending_tokens = 0
        self.max_num_tokens = -1  # where max_tokens or max_model_len stops it: set as the scheduler takes it
        self.pending_row = -1
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.num_cached_tokens = -1  # -1 until first admitted
        self.block_table: list[int] = []
        self.sampling_params = sampling_params
        self.seed = sampling_params.seed if seed is None else seed
        self.bad_words_token_ids = bad_words_token_ids  # each bad word's tokens, in its spellings
        self.sampling_slot = -1  # its row of the sampler's state while it runs (the scheduler assigns it)
        self.sampling_needs = 0  # what its rows ask of a step's sampling (`sampling_inputs.sampling_needs`)
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.stop_reason: int | str | None = None

    def __len__(self):
        return self.num_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_known_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def add_pending_token(self, row: int):
        """A step now sampling row `row` will give this sequence its next token."""
        self.num_tokens += 1
        self.num_pending_tokens += 1
        self.pending_row = row

    def resolve_pending_token(self, token_id: int):
        self.token_ids.append(token_id)
        self.num_pending_tokens -= 1

    def finish(self, reason: str, stop_reason: int | str | None = None):
        """A token still pending will never be known: it no longer counts."""
        self.status, self.is_finished = SequenceStatus.FINISHED, True
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.num_tokens -= self.num_pending_tokens
        self.num_pending_tokens = 0
