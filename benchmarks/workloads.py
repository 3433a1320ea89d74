"""The named workloads: seeded random token-id prompts, output lengths and the engine arguments each needs.

Every request samples at temperature 0.6 with ignore_eos, so a run's output is exactly the sum of its
max_tokens. Both engines get the same requests and the same explicit arguments; everything else is each
engine's own default, as a new user would run it. `scale` shrinks request counts and lengths
proportionally (at least 1 of each) for smoke runs; at scale 1 `bench` is nano-vllm's bench.py workload,
drawn in its order.
"""
import random
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


def bench(draw: Draw) -> Workload:
    """bench.py: every prompt (its length, then its ids), then every output length. bench.py passes
    max_model_len=4096, which is both engines' default (capped at the model's limit by both), so it is left
    out: with no engine arguments, bench shares a process with the other default-argument workloads under
    the harness's --group."""
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
    """About 216k prompt tokens: both engines prefill them over many steps of their default 16384-token
    budget, chunking the prompt that does not fit in a step's remainder."""
    n = draw.count(24)
    prompts = [draw.tokens(draw.length(6000, 12000)) for _ in range(n)]
    return Workload("long_prompts", prompts, [draw.length(64, 256) for _ in range(n)], {"max_model_len": 16384})


def single(draw: Draw) -> Workload:
    """One sequence's decode speed: a 128-token prompt, 512 output tokens."""
    return Workload("single", [draw.tokens(draw.count(128))], [draw.count(512)])


WORKLOADS = {f.__name__: f for f in (bench, many_short, shared_prefix, long_prompts, single, bench_tp2)}


def make_workload(name: str, scale: float = 1.0, vocab_size: int | None = None) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    max_token_id = MAX_TOKEN_ID if vocab_size is None else min(MAX_TOKEN_ID, vocab_size - 1)
    workload = WORKLOADS[name](Draw(scale, max_token_id))
    workload.warmup_max_tokens = scaled(WARMUP_MAX_TOKENS, scale)
    if "max_model_len" in workload.engine_kwargs:  # a small model for smoke runs may allow no more
        workload.engine_kwargs["max_model_len"] = scaled(workload.engine_kwargs["max_model_len"], scale)
    return workload
