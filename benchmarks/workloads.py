"""The harness's named workloads (seeded random token-id prompts, output lengths, the engine arguments each needs)
and the sampling variants a workload can be run with. Every request samples at temperature 0.6 with ignore_eos,
so a run's output is the sum of its max_tokens. At scale 1 `bench` is nano-vllm's bench.py workload, drawn in its
order; `scale` shrinks request counts and lengths (at least 1 of each) for smoke runs.
"""
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

TEMPERATURE = 0.6
# bench.py draws token ids in [0, 10000]; a model with a smaller vocabulary gets ids below its size.
MAX_TOKEN_ID = 10000
WARMUP_PROMPT = [1, 2, 3, 4]
WARMUP_MAX_TOKENS = 64


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    engine_kwargs: dict = field(default_factory=dict)
    num_gpus: int = 1  # GPUs it needs; fewer visible ones skip it
    warmup_max_tokens: int = WARMUP_MAX_TOKENS

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def longest_request(self) -> int:
        """Tokens of the longest prompt plus its output: the window it needs."""
        return max(len(prompt) + n for prompt, n in zip(self.prompts, self.max_tokens))


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


class Draw:
    """Seeded draws of counts, lengths and token ids; counts and lengths scaled by `scale`, at least 1."""

    def __init__(self, scale: float, max_token_id: int, seed: int = 0):
        self.rng = random.Random(seed)  # the same stream as bench.py's random.seed(0); randint(...)
        self.scale = scale
        self.max_token_id = max_token_id

    def count(self, n: int) -> int:
        return scaled(n, self.scale)

    def length(self, low: int, high: int) -> int:
        return self.rng.randint(self.count(low), self.count(high))

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randint(0, self.max_token_id) for _ in range(n)]

    def reseeded(self, seed: int) -> "Draw":
        return Draw(self.scale, self.max_token_id, seed)


def bench(draw: Draw) -> Workload:
    """bench.py: every prompt (its length, then its ids), then every output length. Its max_model_len=4096 is both
    engines' default, so it is left out, and bench shares a process with the other workloads under --group."""
    n = draw.count(256)
    prompts = [draw.tokens(draw.length(100, 1024)) for _ in range(n)]
    max_tokens = [draw.length(100, 1024) for _ in range(n)]
    return Workload("bench", prompts, max_tokens)


def bench_tp2(draw: Draw) -> Workload:
    workload = bench(draw)
    return Workload("bench_tp2", workload.prompts, workload.max_tokens, {"tensor_parallel_size": 2}, num_gpus=2)


def many_short(draw: Draw) -> Workload:
    n = draw.count(2048)
    prompts = [draw.tokens(draw.length(16, 64)) for _ in range(n)]
    return Workload("many_short", prompts, [draw.length(32, 128) for _ in range(n)])


def shared_prefix(draw: Draw) -> Workload:
    prefix = draw.tokens(draw.count(1536))
    n = draw.count(256)
    prompts = [prefix + draw.tokens(draw.length(64, 256)) for _ in range(n)]
    return Workload("shared_prefix", prompts, [draw.length(128, 384) for _ in range(n)])


def long_prompts(draw: Draw) -> Workload:
    """About 216k prompt tokens, prefilled over many steps of both engines' default 16384-token budget."""
    n = draw.count(24)
    prompts = [draw.tokens(draw.length(6000, 12000)) for _ in range(n)]
    return Workload("long_prompts", prompts, [draw.length(64, 256) for _ in range(n)], {"max_model_len": 16384})


def single(draw: Draw) -> Workload:
    """One sequence's decode speed: a 128-token prompt, 512 output tokens."""
    return Workload("single", [draw.tokens(draw.count(128))], [draw.count(512)])


def sampling(draw: Draw) -> Workload:
    """bench's prompt lengths with shorter outputs, for --sampling's variants; with a seed of its own, so that a
    grouped process does not find its prompts in the cache from bench."""
    draw = draw.reseeded(1)
    n = draw.count(256)
    prompts = [draw.tokens(draw.length(100, 1024)) for _ in range(n)]
    return Workload("sampling", prompts, [draw.length(100, 512) for _ in range(n)])


WORKLOADS = {f.__name__: f for f in (bench, many_short, shared_prefix, long_prompts, single, bench_tp2, sampling)}
DEFAULT_WORKLOADS = [name for name in WORKLOADS if name != "sampling"]  # sampling is for --sampling's variants


def make_workload(name: str, scale: float = 1.0, vocab_size: int | None = None,
                  max_model_len: int | None = None) -> Workload:
    """The named workload; with `max_model_len`, that window, as given, in place of its own (which `scale`
    shrinks: a small model for smoke runs may allow no more)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    workload = WORKLOADS[name](Draw(scale, max_token_id(vocab_size)))
    workload.warmup_max_tokens = scaled(WARMUP_MAX_TOKENS, scale)
    if max_model_len is not None:
        workload.engine_kwargs["max_model_len"] = max_model_len
    elif "max_model_len" in workload.engine_kwargs:
        workload.engine_kwargs["max_model_len"] = scaled(workload.engine_kwargs["max_model_len"], scale)
    return workload


def vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


def max_token_id(vocab_size: int | None) -> int:
    return MAX_TOKEN_ID if vocab_size is None else min(MAX_TOKEN_ID, vocab_size - 1)


def fixed(kwargs: dict) -> Callable[[int, int], dict]:
    return lambda index, vocab_size: kwargs


def spread_logit_bias(vocab_size: int) -> dict[int, float]:
    """+1.5 on 64 token ids spread evenly over the vocabulary."""
    return {i * vocab_size // 64: 1.5 for i in range(64)}


# Structured outputs: the JSON schema of a name, an integer and a list of strings; a regex that never ends.
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                  "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["name", "age", "tags"]}
OPEN_REGEX = r"[A-Za-z0-9 ,.]+"


def every_other(kwargs: dict) -> Callable[[int, int], dict]:
    return lambda index, vocab_size: kwargs if index % 2 == 0 else {}


# name -> (request index, the model's vocabulary size) -> the SamplingParams arguments it adds.
SAMPLING_VARIANTS: dict[str, Callable[[int, int], dict]] = {
    "plain": fixed({}),  # the usual requests: every other variant's ratio is to this one
    "top_p_top_k": fixed({"top_p": 0.95, "top_k": 20}),  # Qwen3's generation_config.json
    "min_p": fixed({"min_p": 0.05}),
    "repetition_penalty": fixed({"repetition_penalty": 1.1}),
    "presence_frequency": fixed({"presence_penalty": 0.5, "frequency_penalty": 0.5}),
    "seed": lambda index, vocab_size: {"seed": index},
    "logprobs": fixed({"logprobs": 5}),
    "bad_words": fixed({"bad_words": ["hello", "world", " the", " of"]}),  # tokenized with the model's tokenizer
    "logit_bias": lambda index, vocab_size: {"logit_bias": spread_logit_bias(vocab_size)},
    "json_schema": fixed({"structured_outputs": {"json": PERSON_SCHEMA}}),
    "regex": fixed({"structured_outputs": {"regex": OPEN_REGEX}}),
    "json_schema_half": every_other({"structured_outputs": {"json": PERSON_SCHEMA}}),  # and free ones beside
}


def sampling_kwargs(variant: str, num_requests: int, vocab_size: int) -> list[dict]:
    """The arguments the variant adds to each request's SamplingParams."""
    return [SAMPLING_VARIANTS[variant](index, vocab_size) for index in range(num_requests)]


def relabelled(prompts: list[list[int]], variant: str, vocab_size: int | None) -> list[list[int]]:
    """The prompts with every token id mapped through the variant's own permutation of the ids they are
    drawn from (`plain`'s is the identity): the same lengths and shared prefixes, none of the same blocks."""
    if variant == "plain":
        return prompts
    ids = list(range(max_token_id(vocab_size) + 1))
    random.Random(f"sampling variant {variant}").shuffle(ids)
    return [[ids[token] for token in prompt] for prompt in prompts]


def request_file(workload: Workload, variant: str, vocab_size: int) -> dict:
    """What run_one.py reads for the workload with the sampling variant; the variant's SamplingParams
    arguments only where it adds any, so plain's requests are the original nano-vllm's API."""
    requests = {"workload": workload.name, "sampling": variant,
                "prompts": relabelled(workload.prompts, variant, vocab_size), "max_tokens": workload.max_tokens,
                "temperature": TEMPERATURE, "warmup_prompt": WARMUP_PROMPT,
                "warmup_max_tokens": workload.warmup_max_tokens}
    if variant != "plain":
        kwargs = sampling_kwargs(variant, len(workload.prompts), vocab_size)
        requests.update(sampling_kwargs=kwargs, warmup_sampling_kwargs=kwargs[0])
    return requests
