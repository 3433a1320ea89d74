"""The sampler's passes over the vocabulary in Triton: `process` (logits to the scores sampled from) and
`race` (one token per row from them), and `record`. `layers/sampler.py`'s `process_native`, `race_native` and
`record_native` are the same functions in PyTorch, and what a CPU runs. Each reads the rows' slots of the sampler's
state (`layers/sampling_state.py`), whose layout it takes from the state it is given.

Each program takes one chunk of one row, and reads a row's slot of the sampling state only for the
features the slot's flags name, so a row of plain temperature sampling reads its logits and nothing else.

The race draws from softmax(scores) restricted to scores >= the row's threshold: the argmax of
scores - log E, E ~ Exp(1), computed in base 2. Its noise is Philox, four uniforms a draw (`tl.rand4x`):
keyed by the sampler's step counter and the token's place in the batch, or, for a seeded row, by its
seed and the completion's length, so that a seeded row draws the same noise in any batch.
"""
import torch
import triton
import triton.language as tl

CHUNK = 2048
RECORD_ROWS = 128  # rows record_kernel's last program looks at a time
LOG2_E = tl.constexpr(1.4426950408889634)
LOG2_LOG2_E = tl.constexpr(0.5287663729448977)


@triton.jit
def process_kernel(logits_ptr, logits_stride, slots_ptr, out_ptr, vocab_size, temperature_ptr, flags_ptr, bias_ptr,
                   counts_ptr, presence_ptr, frequency_ptr, repetition_ptr, bad_prefixes_ptr, bad_last_ptr, recent_ptr,
                   CHUNK: tl.constexpr, WORDS: tl.constexpr, PREFIX: tl.constexpr, PREFIX_POW2: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_PENALTIES: tl.constexpr, HAS_BAD_WORDS: tl.constexpr,
                   COUNT_MASK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < vocab_size
    slot = tl.load(slots_ptr + row).to(tl.int64)
    flags = tl.load(flags_ptr + slot)
    x = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + cols, mask=in_vocab, other=0.0).to(tl.float32)
    state = slot * vocab_size + cols
    if flags & HAS_BIAS:
        x += tl.load(bias_ptr + state, mask=in_vocab, other=0.0)
    if flags & HAS_PENALTIES:
        counts = tl.load(counts_ptr + state, mask=in_vocab, other=0)
        repetition = tl.load(repetition_ptr + slot)
        x = tl.where(counts != 0, tl.where(x > 0, x / repetition, x * repetition), x)
        in_output = counts & COUNT_MASK
        x -= tl.load(frequency_ptr + slot) * in_output.to(tl.float32)
        x -= tl.load(presence_ptr + slot) * (in_output > 0).to(tl.float32)
    if flags & HAS_BAD_WORDS:
        x = tl.where(_banned_by_bad_words(cols, slot, bad_prefixes_ptr, bad_last_ptr, recent_ptr, WORDS, PREFIX,
                                          PREFIX_POW2), float("-inf"), x)
    temperature = tl.load(temperature_ptr + slot)
    if temperature > 0:
        x = x / temperature
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + cols, x, mask=in_vocab)


@triton.jit
def _banned_by_bad_words(cols, slot, bad_prefixes_ptr, bad_last_ptr, recent_ptr, WORDS: tl.constexpr,
                         PREFIX: tl.constexpr, PREFIX_POW2: tl.constexpr):
    """Whether each of `cols` is the last token of a bad word whose other tokens end the completion."""
    words = tl.arange(0, WORDS)
    places = tl.arange(0, PREFIX_POW2)
    in_prefix = places < PREFIX
    prefixes = tl.load(bad_prefixes_ptr + (slot * WORDS + words[:, None]) * PREFIX + places[None, :],
                       mask=in_prefix[None, :], other=-2)
    recent = tl.load(recent_ptr + slot * PREFIX + places, mask=in_prefix, other=-1)
    mismatches = tl.sum(((prefixes != -2) & (prefixes != recent[None, :])).to(tl.int32), axis=1)
    last = tl.load(bad_last_ptr + slot * WORDS + words)
    banned = tl.where((mismatches == 0) & (last >= 0), last, -1)  # [WORDS]
    return tl.sum((cols[:, None] == banned[None, :]).to(tl.int32), axis=1) > 0


@triton.jit
def _seeded_key(seed, generated):
    """A Philox key for (seed, completion length): splitmix64 of the pair."""
    x = seed.to(tl.uint64) + generated.to(tl.uint64) * tl.full((), 0x9E3779B97F4A7C15, tl.uint64)
    x = (x ^ (x >> 30)) * tl.full((), 0xBF58476D1CE4E5B9, tl.uint64)
    x = (x ^ (x >> 27)) * tl.full((), 0x94D049BB133111EB, tl.uint64)
    return x ^ (x >> 31)


@triton.jit
def _exponential_log2(row, chunk, num_chunks, slot, counter_ptr, seed_ptr, seeded_ptr, generated_ptr,
                      CHUNK: tl.constexpr):
    """log2 of Exp(1) noise for one chunk of one row (see the module's docstring for its keys)."""
    seeded = tl.load(seeded_ptr + slot) != 0
    seeded_key = _seeded_key(tl.load(seed_ptr + slot), tl.load(generated_ptr + slot))
    key = tl.where(seeded, seeded_key, tl.load(counter_ptr).to(tl.uint64))
    first = tl.where(seeded, chunk, row * num_chunks + chunk) * (CHUNK // 4)
    u0, u1, u2, u3 = tl.rand4x(key, first + tl.arange(0, CHUNK // 4))
    uniform = tl.maximum(tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), (CHUNK,)), 1e-30)  # can be 0
    return tl.log2(tl.maximum(-tl.log2(uniform), 1e-10)) - LOG2_LOG2_E  # log2(E), E = -ln U


@triton.jit
def race_kernel(scores_ptr, slots_ptr, thresholds_ptr, counter_ptr, chunk_max_ptr, chunk_arg_ptr, vocab_size,
                num_chunks, temperature_ptr, seed_ptr, seeded_ptr, generated_ptr, CHUNK: tl.constexpr,
                HAS_THRESHOLDS: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < vocab_size
    slot = tl.load(slots_ptr + row).to(tl.int64)
    x = tl.load(scores_ptr + row.to(tl.int64) * vocab_size + cols, mask=in_vocab, other=float("-inf"))
    x = tl.where(x == x, x, float("-inf"))  # NaN loses to -inf in argmax: a NaN row takes token 0, not vocab_size
    if tl.load(temperature_ptr + slot) > 0:
        noise = _exponential_log2(row, chunk, num_chunks, slot, counter_ptr, seed_ptr, seeded_ptr, generated_ptr,
                                  CHUNK)
        kept = in_vocab
        if HAS_THRESHOLDS:
            kept &= x >= tl.load(thresholds_ptr + row)
        x = tl.where(kept, x * LOG2_E - noise, float("-inf"))
    best = tl.argmax(x, axis=0, tie_break_left=True)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, tl.max(x, axis=0))
    tl.store(chunk_arg_ptr + row * num_chunks + chunk, chunk * CHUNK + best)


@triton.jit
def pick_kernel(chunk_max_ptr, chunk_arg_ptr, tokens_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS)
    has_chunk = chunks < num_chunks
    maxima = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=has_chunk, other=float("-inf"))
    best = tl.argmax(maxima, axis=0, tie_break_left=True)
    token = tl.sum(tl.where(chunks == best, tl.load(chunk_arg_ptr + row * num_chunks + chunks, mask=has_chunk,
                                                    other=0), 0), axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64))


@triton.jit(do_not_specialize=["num_rows"])  # one compiled kernel for every batch: none compiles mid-run
def record_kernel(slots_ptr, tokens_ptr, num_rows, counter_ptr, counts_ptr, recent_ptr, generated_ptr, temperature_ptr,
                  seeded_ptr, vocab_size, RECENT: tl.constexpr, RECENT_POW2: tl.constexpr, ROWS: tl.constexpr):
    """Programs [0, num_rows): a row's token into its slot. Program num_rows: the counter advances if any
    row drew unseeded noise (the race has read it: this kernel runs after), looking at ROWS rows at a time."""
    row = tl.program_id(0)
    if row == num_rows:
        drew = 0
        for first in range(0, num_rows, ROWS):
            rows = first + tl.arange(0, ROWS)
            slots = tl.load(slots_ptr + rows, mask=rows < num_rows, other=0)
            draws = (rows < num_rows) & (tl.load(temperature_ptr + slots) > 0) & (tl.load(seeded_ptr + slots) == 0)
            drew = tl.maximum(drew, tl.max(draws.to(tl.int32), axis=0))
        if drew > 0:
            tl.store(counter_ptr, tl.load(counter_ptr) + 1)
        return
    slot = tl.load(slots_ptr + row).to(tl.int64)
    token = tl.load(tokens_ptr + row)
    tl.atomic_add(counts_ptr + slot * vocab_size + token, 1)  # padding rows share the scratch slot
    tl.atomic_add(generated_ptr + slot, 1)
    places = tl.arange(0, RECENT_POW2)
    recent = tl.load(recent_ptr + slot * RECENT + places + 1, mask=places + 1 < RECENT, other=0)
    recent = tl.where(places == RECENT - 1, token, recent)
    tl.store(recent_ptr + slot * RECENT + places, recent, mask=places < RECENT)


@triton.jit
def noise_kernel(slots_ptr, counter_ptr, out_ptr, vocab_size, num_chunks, seed_ptr, seeded_ptr, generated_ptr,
                 CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    noise = _exponential_log2(row, chunk, num_chunks, slot, counter_ptr, seed_ptr, seeded_ptr, generated_ptr, CHUNK)
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + cols, tl.exp2(noise), mask=cols < vocab_size)


def process(logits: torch.Tensor, slots: torch.Tensor, state) -> torch.Tensor:
    """The scores each row samples from: its logits with its slot's bias, penalties and bad words applied,
    over its temperature (left as they are where it is 0). [num_rows, vocab_size] float32"""
    num_rows, vocab_size = logits.shape
    _, words, prefix = state.bad_prefixes.shape
    assert logits.stride(1) == 1
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    process_kernel[(num_rows, triton.cdiv(vocab_size, CHUNK))](
        logits, logits.stride(0), slots, out, vocab_size, state.temperature, state.flags, state.bias, state.counts,
        state.presence_penalty, state.frequency_penalty, state.repetition_penalty, state.bad_prefixes, state.bad_last,
        state.recent, CHUNK=CHUNK, WORDS=words, PREFIX=prefix, PREFIX_POW2=triton.next_power_of_2(prefix),
        HAS_BIAS=state.HAS_BIAS, HAS_PENALTIES=state.HAS_PENALTIES, HAS_BAD_WORDS=state.HAS_BAD_WORDS,
        COUNT_MASK=state.IN_PROMPT - 1)
    return out


def race(scores: torch.Tensor, slots: torch.Tensor, thresholds: torch.Tensor | None, state, counter: torch.Tensor,
         chunk: int = CHUNK) -> torch.Tensor:
    """One token per row: the argmax where the row's temperature is 0, else a draw from softmax(scores)
    over the scores at or above the row's threshold (None: every score). [num_rows] int64"""
    num_rows, vocab_size = scores.shape
    num_chunks = triton.cdiv(vocab_size, chunk)
    chunk_max = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=scores.device)
    chunk_arg = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=scores.device)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=scores.device)
    race_kernel[(num_rows, num_chunks)](scores, slots, thresholds, counter, chunk_max, chunk_arg, vocab_size,
                                        num_chunks, state.temperature, state.seed, state.seeded, state.generated,
                                        CHUNK=chunk, HAS_THRESHOLDS=thresholds is not None)
    pick_kernel[(num_rows,)](chunk_max, chunk_arg, tokens, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks))
    return tokens


def record(slots: torch.Tensor, tokens: torch.Tensor, state, counter: torch.Tensor):
    """`SamplingState.record` and the counter's advance (`sampler.record_native`) in one launch."""
    num_rows, recent = len(slots), state.recent.size(1)
    record_kernel[(num_rows + 1,)](slots, tokens, num_rows, counter, state.counts, state.recent, state.generated,
                                   state.temperature, state.seeded, state.counts.size(1), RECENT=recent,
                                   RECENT_POW2=triton.next_power_of_2(recent), ROWS=RECORD_ROWS)


def exponential_noise(slots: torch.Tensor, state, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The Exp(1) noise `race` draws for these rows at this counter, for tests. [num_rows, vocab_size]"""
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    out = torch.empty(len(slots), vocab_size, dtype=torch.float32, device=slots.device)
    noise_kernel[(len(slots), num_chunks)](slots, counter, out, vocab_size, num_chunks, state.seed, state.seeded,
                                           state.generated, CHUNK=CHUNK)
    return out
