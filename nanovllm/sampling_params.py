import copy
import math
import warnings
from dataclasses import dataclass, replace
from enum import Enum

# vLLM's _MAX_TEMP: a temperature above 0 and below it becomes it, with a warning; smaller ones would scale the
# logits past float32's range (or round to 0, which samples greedily on the device and not on the host).
MIN_TEMPERATURE = 1e-2


class RequestOutputKind(Enum):
    """What LLMEngine.step() returns for a request as it progresses (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far, at every step
    DELTA = 1  # only what this step added
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's constraint on a completion's text: exactly one of
    json: a JSON schema (a dict, or its text) the output must satisfy;
    regex: a regular expression the whole output must match;
    choice: one of these strings, verbatim;
    grammar: an EBNF grammar (GBNF, as llama.cpp writes it; its rule `root` is the whole output);
    json_object: True for any JSON object;
    structural_tag: xgrammar's structural tag (its JSON text).
    disable_any_whitespace: JSON without whitespace between its tokens: no indentation, no spaces after
        "," and ":".
    disable_additional_properties: objects hold only the properties the schema names (the backend's default
        already, kept for vLLM's API); disable_fallback is vLLM's, with nothing to fall back to here.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one constraint of {', '.join(CONSTRAINTS)}; got "
                             f"{' and '.join(given) if given else 'none'}")
        kinds = dict(json=(str, dict), regex=(str,), choice=(list, tuple), grammar=(str,), json_object=(bool,),
                     structural_tag=(str,), whitespace_pattern=(str,))
        for name, kind in kinds.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"structured outputs' {name} must be {' or '.join(k.__name__ for k in kind)}, "
                                 f"got {type(value).__name__}")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured outputs' choice must be a non-empty list of strings, got {self.choice!r}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured outputs' whitespace_pattern is not supported by the xgrammar backend: give "
                             "disable_any_whitespace=True for JSON without whitespace")

    @property
    def kind(self) -> str:
        """The name of the one constraint given."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class SamplingParams:
    """How to sample a request's completions, with vLLM's names and meanings.

    n: completions of the prompt; they share its KV blocks through the prefix cache.
    temperature: 0 picks the most likely token (greedy); larger values flatten the distribution. A value
        between 0 and 0.01 is taken as 0.01, as vLLM does.
    top_p: keep the most likely tokens whose probabilities add up to at least top_p, in (0, 1].
    top_k: keep the k most likely tokens; 0 or -1 keeps all.
    min_p: drop tokens less likely than min_p times the most likely token's probability, in [0, 1].
        The filters apply in vLLM's order: min_p, then top_k, then top_p on what is left.
    seed: the same seed gives the same completion, whatever else is in the batch.
    stop: strings that end the completion at their first match; the match is cut from the text
        unless include_stop_str_in_output.
    stop_token_ids: token ids that end the completion (and stay in it).
    min_tokens: end-of-sequence and stop_token_ids are suppressed until this many tokens exist.
    max_tokens: the most tokens to generate; None: as many as max_model_len leaves after the prompt.
    ignore_eos: keep generating past the end-of-sequence token, up to max_tokens.
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logits of tokens already
        generated, once (presence) or once per occurrence (frequency).
    repetition_penalty: > 0; divides positive and multiplies negative logits of tokens in the prompt
        or the completion so far (1 is off).
    logit_bias: token id -> a finite value added to its logit before sampling (-100 or 100 all but bans
        or forces a token, as in OpenAI's API).
    allowed_token_ids: only these tokens may be sampled.
    bad_words: words that may not be generated: the last token of a word is forbidden wherever the
        completion so far ends with the word's other tokens (with and without a leading space).
    logprobs: also return, at each generated position, the log-probabilities of the `logprobs` most
        likely tokens and of the sampled one (0: only the sampled one's; -1: every token's), from the
        model's raw logits.
    prompt_logprobs: likewise at each prompt position after the first (those tokens are computed
        again rather than taken from the prefix cache).
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: the last max_model_len).
    detokenize: False leaves the text empty (the token ids come as ever).
    skip_special_tokens: leave special tokens out of the text.
    output_kind: what LLMEngine.step() returns as the request progresses; LLM.generate() waits for
        the end whatever it says.
    structured_outputs: a StructuredOutputsParams the completion's text must satisfy (a JSON schema, a
        regex, a choice, a grammar); end-of-sequence is allowed only where the constraint is complete.
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
    max_tokens: int | None = 64
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self._check_types()
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_ranges()
        self._check_token_lists()
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, which would overflow the "
                          f"scaled logits: {MIN_TEMPERATURE} is used", stacklevel=3)
            self.temperature = MIN_TEMPERATURE

    def _check_types(self):
        for names, kinds, what in TYPE_RULES:
            for name in names:
                value = getattr(self, name)
                if value is not None and (isinstance(value, bool) != (kinds == (bool,)) or
                                          not isinstance(value, kinds)):
                    raise ValueError(f"{name} must be {what}, got {value!r}")
                if kinds == NUMBER and not is_finite(value):
                    raise ValueError(f"{name} must be a finite number, got {value!r}")

    def _check_ranges(self):
        max_tokens = self.max_tokens
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0 (0 is greedy)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 or 0 (off) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", max_tokens is None or max_tokens >= 1, "must be None or >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= (max_tokens or self.min_tokens),
             f"must be in [0, max_tokens={max_tokens}]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("logprobs", self.logprobs is None or self.logprobs >= -1, "must be None, -1 (every token) or >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= -1,
             "must be None, -1 (every token) or >= 0"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
             "must be None, -1 or >= 1"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)}")

    def _check_token_lists(self):
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need the text: they cannot be used with detokenize=False")
        if not all(is_token_id(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must hold non-negative token ids, got {self.stop_token_ids}")
        if self.logit_bias is not None:
            self._check_logit_bias()
        if self.allowed_token_ids is not None and not (
                self.allowed_token_ids and all(is_token_id(t) for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids}")
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must hold non-empty strings, got {self.bad_words}")

    def _check_logit_bias(self):
        if not all(is_token_id(t) and isinstance(v, NUMBER) and not isinstance(v, bool)
                   for t, v in self.logit_bias.items()):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias}")
        infinite = next(((t, v) for t, v in self.logit_bias.items() if not is_finite(v)), None)
        if infinite is not None:
            raise ValueError(f"logit_bias must hold finite values (-100 or 100 all but bans or forces a token), got "
                             f"{infinite[1]!r} for token {infinite[0]}")

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's: SamplingParams from arguments that may be None, a None taking the field's default."""
        return cls(**{name: value for name, value in kwargs.items() if value is not None})

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    def token_ids_named(self) -> dict[str, list[int]]:
        """The token ids these params name, to check against a vocabulary."""
        return dict(stop_token_ids=self.stop_token_ids, logit_bias=list(self.logit_bias or ()),
                    allowed_token_ids=self.allowed_token_ids or [])

    def may_stop(self, num_output_tokens: int) -> bool:
        """Whether a completion may end at its num_output_tokens-th token (by EOS, a stop token id or a stop
        string): its first min_tokens tokens cannot, and the sampler keeps EOS and stop ids from them."""
        return num_output_tokens > self.min_tokens

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


FLOAT32_MAX = 3.4028234663852886e38


def is_finite(value: float) -> bool:
    """Finite in float32, which the sampler computes in (an integer past a float's range is not)."""
    try:
        return math.isfinite(value) and abs(value) <= FLOAT32_MAX
    except OverflowError:
        return False


NUMBER = (int, float)
# (fields, accepted types, how the error says it) for the fields whose type is checked
TYPE_RULES = [
    (("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"),
     (int,), "an integer"),
    (("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"),
     NUMBER, "a number"),
    (("include_stop_str_in_output", "ignore_eos", "detokenize", "skip_special_tokens"), (bool,), "True or False"),
    (("stop_token_ids", "allowed_token_ids", "bad_words"), (list, tuple), "a list"),
    (("logit_bias",), (dict,), "a dict"),
    (("stop",), (str, list, tuple), "a text or a list of texts"),
    (("output_kind",), (RequestOutputKind,), "a RequestOutputKind"),
    (("structured_outputs",), (StructuredOutputsParams,), "a StructuredOutputsParams"),
]


def final_only(params: SamplingParams) -> SamplingParams:
    """params, with output_kind FINAL_ONLY (a copy, unless it has it): for callers that take whole requests."""
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
