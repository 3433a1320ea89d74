from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.kernel_choice import choose_kernel

# splitmix64's constants, as signed 64-bit integers (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step: host arrays as the engine builds them, tensors on the
    model's device once the sampling rank has uploaded them (the types below).

    A feature no row uses stays None, so a batch of plain temperature sampling pays for nothing
    else. Which features are on is decided here, on the host, from the requests: the sampler never
    reads a device value to choose a path.
    """

    temperatures: torch.Tensor  # [num_rows] float32, 0 = greedy
    top_k: torch.Tensor | None = None  # [num_rows] int64, vocab_size where off
    top_p: torch.Tensor | None = None  # [num_rows] float32, 1 where off
    min_p: torch.Tensor | None = None  # [num_rows] float32, 0 where off
    seeded_rows: torch.Tensor | None = None  # [num_seeded] int64
    seeds: torch.Tensor | None = None  # [num_seeded] int64
    seed_steps: torch.Tensor | None = None  # [num_seeded] int64: tokens generated so far
    presence_penalties: torch.Tensor | None = None  # [num_rows] float32
    frequency_penalties: torch.Tensor | None = None  # [num_rows] float32
    repetition_penalties: torch.Tensor | None = None  # [num_rows] float32
    output_token_ids: torch.Tensor | None = None  # [num_rows, max_len] int64, vocab_size padded
    prompt_token_ids: torch.Tensor | None = None  # [num_rows, max_len] int64, vocab_size padded
    suppressed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) to forbid
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows restricted; (rows, ids) allowed
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, bias)
    num_logprobs: int | None = None  # the most top log-probabilities any row asked for

    @property
    def is_plain(self) -> bool:
        """Temperatures alone: no filter, penalty, seed, constraint or log-probabilities (a graph samples it)."""
        return all(getattr(self, field.name) is None for field in fields(self) if field.name != "temperatures")

    @property
    def uses_filters(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None


@dataclass(slots=True)
class SampledLogprobs:
    """Raw log-probabilities (before penalties, temperature and filters) of a step's rows: tensors on the
    device, lists once a step's output reaches the host (`map`)."""

    top_ids: torch.Tensor | list  # [num_rows, k]
    top_logprobs: torch.Tensor | list  # [num_rows, k]
    sampled_logprobs: torch.Tensor | list  # [num_rows]
    sampled_ranks: torch.Tensor | list  # [num_rows], 1 for the most likely token

    def columns(self) -> list:
        return [self.top_ids, self.top_logprobs, self.sampled_logprobs, self.sampled_ranks]

    def map(self, fn) -> "SampledLogprobs":
        """The record with fn applied to each column: e.g. copied to the host, or as lists there."""
        return SampledLogprobs(*map(fn, self.columns()))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def seeded_exponential(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [num_rows, vocab_size] that depends only on (seed, step, token id): a counter-based
    generator (splitmix64), so a seeded row draws the same numbers in any batch, at any position.
    Each (seed, step) is mixed into its own stream key; the stream then counts over the token ids."""
    stream = _splitmix64(_splitmix64(seeds) + steps * _GOLDEN)
    token_ids = torch.arange(vocab_size, device=seeds.device)
    x = _splitmix64(stream.unsqueeze(1) + (token_ids + 1) * _GOLDEN)
    uniform = (_shift_right(x, 40).float() + 0.5) * (1.0 / (1 << 24))  # 24 random bits, in (0, 1)
    return -torch.log(uniform)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM's formulas: the repetition penalty divides positive and multiplies negative logits of
    tokens seen in the prompt or the output; then frequency x count and presence x seen are subtracted."""
    num_rows, vocab_size = logits.shape
    counts = torch.zeros(num_rows, vocab_size + 1, device=logits.device)
    counts.scatter_add_(1, batch.output_token_ids, torch.ones_like(batch.output_token_ids, dtype=counts.dtype))
    counts = counts[:, :vocab_size]
    seen = counts > 0
    if batch.prompt_token_ids is not None:
        in_prompt = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
        in_prompt.scatter_(1, batch.prompt_token_ids, True)
        seen_anywhere = seen | in_prompt[:, :vocab_size]
        penalty = batch.repetition_penalties.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen_anywhere, penalised, logits)
    logits = logits - batch.frequency_penalties.unsqueeze(1) * counts
    return logits - batch.presence_penalties.unsqueeze(1) * seen


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                 min_p: torch.Tensor | None) -> torch.Tensor:
    """Zero the tokens that min_p, then top_k, then top_p (on what is left) remove; rows need not sum to 1."""
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
    if top_k is None and top_p is None:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(probs.size(1), device=probs.device)
        sorted_probs = sorted_probs.masked_fill(ranks >= top_k.unsqueeze(1), 0.0)
    if top_p is not None:
        # Keep a token while the mass above it is below top_p: the token that crosses it stays.
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        total = sorted_probs.sum(dim=-1, keepdim=True)
        sorted_probs = sorted_probs.masked_fill(mass_above >= top_p.unsqueeze(1) * total, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


ARGMAX_CHUNK = 1024


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row, in two stages (chunks, then the best chunk), so that a few rows
    over the vocabulary still spread over the whole GPU. [num_rows, vocab_size] -> [num_rows]"""
    num_rows, vocab_size = scores.shape
    num_chunks = -(-vocab_size // ARGMAX_CHUNK)
    padded = F.pad(scores, (0, -vocab_size % ARGMAX_CHUNK), value=-torch.inf).view(num_rows, num_chunks, ARGMAX_CHUNK)
    chunk_max, chunk_argmax = padded.max(dim=-1)  # [num_rows, num_chunks]
    best_chunk = chunk_max.argmax(dim=-1, keepdim=True)
    return (best_chunk * ARGMAX_CHUNK + chunk_argmax.gather(1, best_chunk)).squeeze(1)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
           top_p: torch.Tensor | None, min_p: torch.Tensor | None, noise: torch.Tensor) -> torch.Tensor:
    """One token per row: argmax where the temperature is 0, else a draw from the filtered softmax(logits / T),
    with `noise` Exp(1) [num_rows, vocab_size].

    Exponential race: with E ~ Exp(1) per token, argmax(p / E) draws from p, normalised or not. Without
    filters that is argmax(logits / T - log E), which needs no softmax over the vocabulary."""
    logits = logits.float()
    greedy = argmax(logits)
    safe_temperatures = torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
    noise = noise.clamp_min(1e-10)
    if top_k is None and top_p is None and min_p is None:
        sampled = argmax(logits / safe_temperatures - noise.log())
    else:
        probs = filter_probs(torch.softmax(logits / safe_temperatures, dim=-1), top_k, top_p, min_p)
        sampled = argmax(probs / noise)
    return torch.where(temperatures > 0, sampled, greedy)


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SampledLogprobs:
    logprobs = torch.log_softmax(logits, dim=-1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], tokens[:, None][:, :0])
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1
    return SampledLogprobs(top_ids, top_logprobs, sampled, ranks)


def constrain(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM's order before penalties: allowed tokens only, then forbidden ones (min_tokens, bad words)
    out, then the logit bias."""
    if batch.allowed is not None:
        restricted_rows, rows, token_ids = batch.allowed
        keep = torch.ones_like(logits, dtype=torch.bool)
        keep[restricted_rows] = False
        keep[rows, token_ids] = True
        logits = logits.float().masked_fill(~keep, -torch.inf)
    if batch.suppressed is not None:
        logits = logits.float().index_put(batch.suppressed, torch.tensor(-torch.inf, device=logits.device))
    if batch.logit_bias is not None:
        rows, token_ids, bias = batch.logit_bias
        logits = logits.float().index_put((rows, token_ids), bias, accumulate=True)
    return logits


class Sampler(nn.Module):
    """Samples a step's rows as their SamplingBatch says. Temperatures alone (on the logits, or on what
    constraints and penalties made of them) take `plain_sampler`'s kernels on CUDA, one pass over the
    logits with noise a device counter keys (advanced by each step, so a CUDA graph draws anew at each
    replay), and `sample` on a CPU. Filters and seeded rows take `sample`.

    Noise that no request's seed fixes comes from the sampler's own generator (the counter is drawn
    from it too), seeded with the engine's seed: the same each run, and the caller's torch random state
    is left alone."""

    def __init__(self, seed: int | None):
        super().__init__()
        self.generator = torch.Generator(torch.get_default_device())
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        counter = torch.randint(0, 2**62, (1,), generator=self.generator)
        self.register_buffer("noise_counter", counter, persistent=False)
        self.plain_kernel = choose_kernel(self._sample_plain_native, "plain_sampler:sample_plain")

    def sample_plain(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """The tokens of a plain batch (SamplingBatch.is_plain)."""
        return self.plain_kernel(logits, temperatures, self.noise_counter)

    def _sample_plain_native(self, logits: torch.Tensor, temperatures: torch.Tensor, counter: torch.Tensor):
        """`sample_plain` in PyTorch: its noise comes from the generator, not from the counter."""
        return sample(logits, temperatures, None, None, None, self._exponential(logits))

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, SampledLogprobs | None]:
        if batch.is_plain:
            return self.sample_plain(logits, batch.temperatures), None
        processed = constrain(logits, batch)
        if batch.output_token_ids is not None:
            processed = apply_penalties(processed.float(), batch)
        if batch.uses_filters or batch.seeds is not None:
            noise = self._exponential(logits)
            if batch.seeds is not None:
                noise[batch.seeded_rows] = seeded_exponential(batch.seeds, batch.seed_steps, logits.size(1))
            tokens = sample(processed, batch.temperatures, batch.top_k, batch.top_p, batch.min_p, noise)
        else:  # float32 always, so one variant of the kernels, compiled at warm-up, serves every batch
            tokens = self.sample_plain(processed.float(), batch.temperatures)
        if batch.num_logprobs is None:
            return tokens, None
        return tokens, raw_logprobs(logits.float(), tokens, batch.num_logprobs)

    def _exponential(self, logits: torch.Tensor) -> torch.Tensor:
        """Exp(1) noise like the logits, in float32, from the generator."""
        return torch.empty_like(logits, dtype=torch.float32).exponential_(1, generator=self.generator)
