"""What a user passes in, made into a checked Request (vLLM's Processor): the prompt parsed, tokenized and
truncated, it and the sampling params checked against the model, max_tokens=None filled in, the bad
words' token ids found, and a Sequence made for each of the n completions. The model's
generation_config.json gives the default sampling params and, with the tokenizer, the EOS ids.
"""
import dataclasses
import json
import os
import time
from itertools import count

from nanovllm.config import Config
from nanovllm.engine.pooling import check_pooling_params, pooling_sampling_params
from nanovllm.engine.request import Request
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.structured_outputs import StructuredOutputs
from nanovllm.layers.sampling_state import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from nanovllm.outputs import RequestMetrics
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams

# A text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": [...]} dicts.
Prompt = str | list[int] | dict


class InputProcessor:

    def __init__(self, config: Config, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        # vLLM's generation_config: "auto" and "vllm" read the model's generation_config.json ("vllm" only
        # for its end-of-sequence ids, not its sampling defaults); a folder, its own.
        source = config.generation_config
        path = os.path.join(config.model if source in ("auto", "vllm") else source, "generation_config.json")
        generation = generation_config(path)
        self.eos_token_ids = eos_token_ids(tokenizer, config, generation, path)
        self.generation_defaults = {} if source == "vllm" else {  # vLLM skips a null value
            name: value for name, value in generation.items() if name in GENERATION_DEFAULTS and value is not None}
        self.seq_ids = count()  # this engine's
        self.structured_outputs = StructuredOutputs(tokenizer, config.hf_config.vocab_size, self.eos_token_ids,
                                                    config.structured_outputs_config)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults, as vLLM gives them."""
        return SamplingParams(**self.generation_defaults)

    def default_params(self) -> SamplingParams | PoolingParams:
        """What a request without params takes: the default SamplingParams, or PoolingParams on a pooling engine."""
        return PoolingParams() if self.config.runner == "pooling" else self.default_sampling_params()

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams,
                     index: int | None = None, add_special_tokens: bool = True) -> Request:
        """A checked request, not yet queued; `index`, where given, numbers the prompt in errors. A pooling
        engine's takes PoolingParams, a generating engine's SamplingParams."""
        if self.config.runner == "pooling":
            return self._pooling_request(request_id, prompt, params, index, add_special_tokens)
        return self._sampling_request(request_id, prompt, params, index, add_special_tokens)

    def _sampling_request(self, request_id: str, prompt: Prompt, params: SamplingParams, index: int | None,
                          add_special_tokens: bool) -> Request:
        name = "the prompt" if index is None else f"prompt {index}"
        if not isinstance(params, SamplingParams):
            owner = "the sampling params" if index is None else f"sampling params {index}"
            raise ValueError(f"{owner} is a {type(params).__name__}, not SamplingParams")
        text, token_ids = self.tokenize_prompt(prompt, name, add_special_tokens)
        token_ids = self._truncated(token_ids, params.truncate_prompt_tokens)
        self._check_prompt(name, token_ids)
        params = self._checked_params(name, params, len(token_ids))
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words or [])
        check_bad_words(bad_words)
        seqs = [Sequence(token_ids, params, seed, bad_words, seq_id=next(self.seq_ids))
                for seed in child_seeds(params.seed, params.n)]
        request = Request(str(request_id), text, list(token_ids), params, seqs, RequestMetrics(time.time()))
        if params.structured_outputs is not None:
            request.grammar = self.structured_outputs.compile(params.structured_outputs, name)
        return request

    def _pooling_request(self, request_id: str, prompt: Prompt, params: PoolingParams, index: int | None,
                         add_special_tokens: bool) -> Request:
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams or a list of them, got {type(params).__name__} "
                             f"(an engine made with runner='pooling' takes no SamplingParams)")
        params = check_pooling_params(params, self.config.hf_config)
        request = self._sampling_request(request_id, prompt, pooling_sampling_params(params), index,
                                         add_special_tokens)
        request.pooling_params = params
        return request

    def tokenize_prompt(self, prompt: Prompt, name: str = "the prompt",
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt; the text is None when it came as token ids."""
        text, token_ids = parse_prompt(name, prompt)
        if token_ids is None:
            check_text(name, text)
            token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return text, token_ids

    def _truncated(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` tokens of the prompt (-1: the last max_model_len), as vLLM truncates."""
        if keep is None:
            return token_ids
        return token_ids[-(self.config.max_model_len if keep == -1 else keep):]

    def _checked_params(self, name: str, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """The params checked against the vocabulary, with logprobs=-1 made the whole vocabulary (vLLM's), a top_k
        that keeps the whole vocabulary made 0 (off), and max_tokens=None what max_model_len leaves."""
        vocab_size = self.config.hf_config.vocab_size
        whole = {field: vocab_size for field in ("logprobs", "prompt_logprobs") if getattr(params, field) == -1}
        if params.top_k >= vocab_size:
            whole["top_k"] = 0
        if whole:
            params = dataclasses.replace(params, **whole)
        for field in ("logprobs", "prompt_logprobs"):
            if (getattr(params, field) or 0) > vocab_size:
                raise ValueError(f"{field}={getattr(params, field)} exceeds the vocabulary's {vocab_size} tokens")
        for field, token_ids in params.token_ids_named().items():
            bad = next((t for t in token_ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"{field} has token id {bad} outside the vocabulary [0, {vocab_size})")
        if params.max_tokens is not None:
            return params
        room = self.config.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(f"{name} has {num_prompt_tokens} tokens and fills max_model_len="
                             f"{self.config.max_model_len}: max_tokens=None leaves no room for a completion")
        return dataclasses.replace(params, max_tokens=room)

    def _check_prompt(self, name: str, token_ids: list[int]):
        if not token_ids:
            raise ValueError(f"{name} is empty")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"{name} has {len(token_ids)} tokens, longer than "
                             f"max_model_len={self.config.max_model_len}")
        vocab_size = self.config.hf_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:  # ints, as parse_prompt and the tokenizer give them
            bad = next(t for t in token_ids if not 0 <= t < vocab_size)
            raise ValueError(f"{name} has token id {bad!r} outside the vocabulary [0, {vocab_size})")


def parse_prompt(name: str, prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt, `name` in errors; the token ids are None while the text is to be tokenized."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        return _parse_prompt_dict(name, prompt)
    if isinstance(prompt, list | tuple) and set(map(type, prompt)) <= {int}:  # no bools, no floats
        return None, list(prompt)
    raise ValueError(f"{name} is a {type(prompt).__name__}: expected a text, a list of token ids, "
                     f"or a dict with 'prompt' or 'prompt_token_ids'")


def check_text(name: str, text: str):
    """A text the tokenizer can take: one holding a lone surrogate (from a JSON "\\ud800" or a file decoded with
    surrogateescape) is not Unicode text, and the tokenizer would fail with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} holds {text[error.start]!r} at character {error.start}, a lone surrogate, which is "
                         f"not text (UTF-8 cannot encode it)") from None


def check_defaults_only(lora_request=None, priority=None):
    """vLLM's per-request LoRA adapters and priorities, which this engine has not: only their defaults."""
    if lora_request is not None:
        raise ValueError("lora_request is not supported: this engine serves the checkpoint's own weights "
                         "(merge the LoRA adapter into them)")
    if priority is not None and any(priority if isinstance(priority, list) else [priority]):
        raise ValueError(f"priority={priority!r} is not supported: requests are scheduled first come, "
                         f"first served (leave priority out, or 0)")


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def _parse_prompt_dict(name: str, prompt: dict) -> tuple[str | None, list[int] | None]:
    unknown = sorted(set(prompt) - set(PROMPT_DICT_KEYS))
    if unknown or not set(prompt) & set(PROMPT_DICT_KEYS):
        raise ValueError(f"{name} is a dict with keys {sorted(prompt)}: expected 'prompt' (a text) "
                         f"or 'prompt_token_ids' (a list of token ids)")
    if "prompt_token_ids" in prompt:
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, list | tuple):
            raise ValueError(f"{name}: 'prompt_token_ids' must be a list of token ids, got {type(token_ids).__name__}")
        return prompt.get("prompt"), parse_prompt(name, token_ids)[1]
    if not isinstance(prompt["prompt"], str):
        raise ValueError(f"{name}: 'prompt' must be a text, got {type(prompt['prompt']).__name__}")
    return prompt["prompt"], None


def generation_config(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


# generation_config.json's sampling fields that vLLM takes as the default SamplingParams
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def eos_token_ids(tokenizer, config: Config, generation: dict, generation_path: str) -> frozenset[int]:
    """The tokenizer's end-of-sequence id and those of config.json and generation_config.json. One outside the
    model's vocabulary is refused naming where it came from: the model cannot sample it, and the sampler, which
    holds EOS back for min_tokens, would index past its vocabulary with it."""
    vocab_size = config.hf_config.vocab_size
    sources = {f"the tokenizer's eos_token {tokenizer.eos_token!r} (of {config.tokenizer!r})": tokenizer.eos_token_id,
               f"the model's config ({config.model!r})": config.hf_config.eos_token_id,
               repr(generation_path): generation.get("eos_token_id")}
    ids = set()
    for source, entry in sources.items():
        for token_id in [i for i in (entry if isinstance(entry, list) else [entry]) if i is not None]:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"{source} gives the end-of-sequence token id {token_id}, outside the model's "
                                 f"vocabulary [0, {vocab_size})")
            ids.add(token_id)
    return frozenset(ids)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, as written alone and after a space (vLLM's two spellings)."""
    for word in words:
        check_text("a bad word", word)
    spellings = {tuple(tokenizer.encode(spelling, add_special_tokens=False))
                 for word in words for spelling in (word.strip(), " " + word.strip())}
    return [list(ids) for ids in sorted(spellings) if ids]


def check_bad_words(spellings: list[list[int]]):
    """The sampler keeps up to MAX_BAD_WORDS spellings of two or more tokens, each of up to MAX_BAD_WORD_TOKENS."""
    long = [ids for ids in spellings if len(ids) > 1]
    if len(long) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words spell {len(long)} words of two or more tokens (as written and after a space); "
                         f"at most {MAX_BAD_WORDS} are taken")
    longest = max(map(len, long), default=0)
    if longest > MAX_BAD_WORD_TOKENS:
        raise ValueError(f"bad_words has a word of {longest} tokens; at most {MAX_BAD_WORD_TOKENS} are taken")


def child_seeds(seed: int | None, n: int) -> list[int | None]:
    """One seed per completion: the request's for the first, distinct ones derived from it for the rest."""
    if seed is None:
        return [None] * n
    return [seed & (2**63 - 1)] + [hash((seed, i)) & (2**63 - 1) for i in range(1, n)]
