"""One way to sample, for every row and every SamplingParams field: from the logits and each row's sampling
slot (`SamplingState`), with no host value read and no shape that depends on the rows' parameters, so a
CUDA graph captures it whole.

    scores = process(logits)       bias, allowed ids, bad words and min_tokens (the slot's bias row),
                                   penalties from the slot's token counts, then / temperature
    threshold = filter(scores)     min_p, top_k, top_p as one cut per row (`SamplingInputs.filter`)
    token = race(scores >= threshold)   the exponential race: argmax of scores - log E, E ~ Exp(1)
    record(token)                  the slot's counts, last tokens and length, for the next step

Greedy rows take the argmax and draw nothing. The passes over the vocabulary are Triton kernels on CUDA
(`kernels/sampling.py`) and the PyTorch functions here on a CPU.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import on_cuda
from nanovllm.layers.sampled_logprobs import SampledLogprobs
from nanovllm.layers.sampling_state import HAS_BAD_WORDS, IN_PROMPT, SamplingState

# How a step's rows are filtered (`SamplingInputs.filter`), the cheapest that serves every row: no filter or
# min_p alone; top_k up to FILTER_CANDIDATES (top_p and min_p within them); anything else, a full sort.
NO_FILTER, CANDIDATES, FULL_SORT = 0, 1, 2
FILTER_CANDIDATES = 64
# splitmix64's constants, as signed 64-bit integers (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


class Sampler(nn.Module):
    """Samples rows from their logits and slots, and records the tokens in the slots.

    Noise that no request's seed fixes is keyed by a step counter on the device, drawn at start from a
    generator seeded with the engine's seed (the same each run; the caller's torch random state is left
    alone) and advanced by every step that draws, so a CUDA graph draws anew at each replay; a step of
    greedy or seeded rows alone leaves it, so they change nothing of later unseeded draws."""

    def __init__(self, seed: int | None, num_slots: int, vocab_size: int):
        super().__init__()
        generator = torch.Generator(torch.get_default_device())
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        counter = torch.randint(0, 2**62, (1,), generator=generator)
        self.register_buffer("noise_counter", counter, persistent=False)
        self.state = SamplingState(num_slots, vocab_size, counter.device)
        self.process, self.race, self.record = process_native, race_native, record_native
        if on_cuda():
            from nanovllm.kernels import sampling
            self.process, self.race, self.record = sampling.process, sampling.race, sampling.record

    def forward(self, logits: torch.Tensor, slots: torch.Tensor, filter: int) -> torch.Tensor:
        """A token per row of logits [num_rows, vocab_size], sampled as its slot says. [num_rows] int64"""
        state = self.state
        scores = self.process(logits, slots, state)
        tokens = self.race(scores, slots, row_thresholds(scores, slots, state, filter), state, self.noise_counter)
        self.record(slots, tokens, state, self.noise_counter)
        return tokens


def row_thresholds(scores: torch.Tensor, slots: torch.Tensor, state: SamplingState, filter: int) -> torch.Tensor | None:
    """Each row's lowest kept score under its min_p, top_k and top_p, in vLLM's order (min_p, then top_k,
    then top_p on what is left, keeping the token that crosses top_p); -inf where nothing is cut. Ties at
    the cut are kept. [num_rows] float32; None for NO_FILTER (every score is kept)."""
    if filter == NO_FILTER:
        return None
    top_k, top_p, min_p = state.top_k[slots], state.top_p[slots], state.min_p[slots]
    if filter == CANDIDATES:  # every row with top_p or a top_k has a top_k within the candidates
        candidates = scores.topk(min(FILTER_CANDIDATES, scores.size(1)), dim=1).values
        cut = cut_sorted(candidates, top_k, top_p, min_p)
        return torch.where(top_k > 0, cut, min_p_cut(candidates[:, 0], min_p))
    assert filter == FULL_SORT
    return cut_sorted(scores.sort(dim=1, descending=True).values, top_k, top_p, min_p)


def min_p_cut(row_max: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """p >= min_p * p_max, as a score: max + log(min_p) (-inf where min_p is 0)."""
    return row_max + torch.log(min_p)


def cut_sorted(sorted_scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor) -> torch.Tensor:
    """The lowest kept of each row's highest scores (descending), which hold every token it keeps."""
    width = sorted_scores.size(1)
    ranks = torch.arange(width, device=sorted_scores.device)
    valid = (ranks < torch.where(top_k > 0, top_k, width).unsqueeze(1))
    valid &= sorted_scores >= min_p_cut(sorted_scores[:, :1], min_p.unsqueeze(1))
    mass = torch.exp(sorted_scores - sorted_scores[:, :1]) * valid
    cumulative = mass.cumsum(dim=1)
    kept = valid & ((cumulative - mass < top_p.unsqueeze(1) * cumulative[:, -1:]) | (top_p >= 1).unsqueeze(1))
    kept[:, 0] = True  # the best token always stays
    return torch.where(kept, sorted_scores, torch.inf).amin(dim=1)


def process_native(logits: torch.Tensor, slots: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """`kernels.sampling.process` in PyTorch."""
    x = logits.float() + state.bias[slots]
    counts = state.counts[slots]
    repetition = state.repetition_penalty[slots].unsqueeze(1)
    x = torch.where(counts != 0, torch.where(x > 0, x / repetition, x * repetition), x)
    in_output = (counts & (IN_PROMPT - 1)).float()
    x = x - state.frequency_penalty[slots].unsqueeze(1) * in_output
    x = x - state.presence_penalty[slots].unsqueeze(1) * (in_output > 0)
    has_bad_words = (state.flags[slots] & HAS_BAD_WORDS) != 0
    x = x.masked_fill(banned_by_bad_words(slots, state, x.size(1)) & has_bad_words.unsqueeze(1), -torch.inf)
    temperature = state.temperature[slots].unsqueeze(1)
    return torch.where(temperature > 0, x / temperature, x)


def banned_by_bad_words(slots: torch.Tensor, state: SamplingState, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] bool: the last tokens of the bad words whose other tokens end the completion."""
    prefixes, recent = state.bad_prefixes[slots], state.recent[slots].unsqueeze(1)
    matched = ((prefixes == -2) | (prefixes == recent)).all(dim=2)
    last = state.bad_last[slots].long()
    banned = torch.zeros(len(slots), vocab_size + 1, dtype=torch.bool, device=slots.device)
    banned.scatter_(1, torch.where(matched & (last >= 0), last, vocab_size), True)
    return banned[:, :vocab_size]


def race_native(scores: torch.Tensor, slots: torch.Tensor, thresholds: torch.Tensor | None, state: SamplingState,
                counter: torch.Tensor) -> torch.Tensor:
    """`kernels.sampling.race` in PyTorch, with splitmix64 noise under the same keys."""
    noise = keyed_exponential(slots, state, counter, scores.size(1))
    return race_reference(scores, thresholds, state.temperature[slots], noise)


def record_native(slots: torch.Tensor, tokens: torch.Tensor, state: SamplingState, counter: torch.Tensor):
    """The tokens into their rows' slots; the counter advances if any row drew unseeded noise."""
    state.record(slots, tokens)
    counter += ((state.temperature[slots] > 0) & (state.seeded[slots] == 0)).any()


def race_reference(scores: torch.Tensor, thresholds: torch.Tensor | None, temperatures: torch.Tensor,
                   noise: torch.Tensor) -> torch.Tensor:
    """The race given its Exp(1) noise [num_rows, vocab_size]; also the reference the kernel is tested against."""
    kept = scores >= thresholds.unsqueeze(1) if thresholds is not None else torch.ones_like(scores, dtype=torch.bool)
    raced = torch.where(kept, scores - noise.clamp_min(1e-10).log(), -torch.inf)
    return argmax(torch.where(temperatures.unsqueeze(1) > 0, raced, scores))


def keyed_exponential(slots: torch.Tensor, state: SamplingState, counter: torch.Tensor, vocab_size: int):
    """Exp(1) noise per row: keyed by (seed, completion length) for a seeded row, else by (counter, row)."""
    seeded = state.seeded[slots] != 0
    rows = torch.arange(len(slots), device=slots.device)
    keys = torch.where(seeded, state.seed[slots], counter.expand(len(slots)))
    steps = torch.where(seeded, state.generated[slots].long(), rows - len(slots))
    return seeded_exponential(keys, steps, vocab_size)


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


MASK_ROWS_AT_ONCE = 32  # bounds the unpacked masks' memory: 32 rows of a 152k vocabulary take 20 MB


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor):
    """Structured outputs: -inf, in place, on the tokens a row's bitmask leaves out (bit j of its int32 word w
    allows token 32 * w + j), for the given rows of the logits."""
    bits = 1 << torch.arange(32, dtype=torch.int32, device=bitmask.device)
    for part_rows, part in zip(rows.split(MASK_ROWS_AT_ONCE), bitmask.split(MASK_ROWS_AT_ONCE)):
        banned = ((part.unsqueeze(-1) & bits) == 0).flatten(1)[:, :logits.size(1)]
        logits[part_rows] = logits[part_rows].masked_fill_(banned, float("-inf"))


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SampledLogprobs:
    """Log-probabilities of the raw logits (before any processing): the top k, the sampled token's and its
    rank. The top k and the rank come from the logits themselves (log-softmax keeps their order), so only
    the log-normaliser is computed in float32 over the vocabulary."""
    log_normaliser = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    top_logits, top_ids = logits.topk(k, dim=-1) if k else (logits[:, :0], tokens[:, None][:, :0])
    sampled_logits = logits.gather(1, tokens.unsqueeze(1))
    ranks = (logits > sampled_logits).sum(dim=-1) + 1
    sampled = (sampled_logits.float() - log_normaliser).squeeze(1)
    return SampledLogprobs(top_ids, top_logits.float() - log_normaliser, sampled, ranks)
