"""Temperature sampling over the vocabulary in Triton, for batches of plain sampling (temperatures alone).

The exponential race of `sampler.sample` (argmax of logits / T - log E, E ~ Exp(1)) with the noise drawn
inside the kernel (Philox, keyed by a step counter on the device and the token's place in the batch),
so the logits are read once and nothing else is: compiled from PyTorch, the same step wrote the noise
out and read it back, 0.45 ms of a 256-sequence decode step (`benchmarks/profile_engine.py`).
The noise, not the read, bounds it: one 10-round Philox draw a token took 114 us of a bench step of
about 140 rows; a draw of four uniforms (`tl.rand4x`) and base-2 logarithms take 74 us.
Rows at temperature 0 take the first maximum of their logits. Each program reduces one chunk of one
row; a second kernel picks each row's best chunk and advances the counter, so a CUDA graph that
captures the two draws new noise at every replay.

Imported only on CUDA, so `import nanovllm` needs no Triton.
"""
import torch
import triton
import triton.language as tl

CHUNK = 2048
LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def chunk_kernel(logits_ptr, logits_stride, temperatures_ptr, counter_ptr, chunk_max_ptr, chunk_arg_ptr, vocab_size,
                 num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < vocab_size
    scores = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + cols, mask=in_vocab,
                     other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperatures_ptr + row)
    if temperature > 0:
        # One Philox draw gives four uniforms: a quarter of the draws of one `tl.rand` per token.
        quads = (row * num_chunks + chunk) * (CHUNK // 4) + tl.arange(0, CHUNK // 4)
        u0, u1, u2, u3 = tl.rand4x(tl.load(counter_ptr), quads)
        uniform = tl.maximum(tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), (CHUNK,)), 1e-30)  # can be 0
        # The race in base 2: argmax of logits / T - ln(-ln U) is argmax of logits * log2(e) / T - log2(-log2 U).
        exponential = tl.maximum(-tl.log2(uniform), 1e-10)
        scores = tl.where(in_vocab, scores * (LOG2_E / temperature) - tl.log2(exponential), float("-inf"))
    best = tl.argmax(scores, axis=0, tie_break_left=True)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, tl.max(scores, axis=0))
    tl.store(chunk_arg_ptr + row * num_chunks + chunk, chunk * CHUNK + best)


@triton.jit
def pick_kernel(chunk_max_ptr, chunk_arg_ptr, counter_ptr, tokens_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS)
    has_chunk = chunks < num_chunks
    maxima = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=has_chunk, other=float("-inf"))
    best = tl.argmax(maxima, axis=0, tie_break_left=True)
    token = tl.sum(tl.where(chunks == best, tl.load(chunk_arg_ptr + row * num_chunks + chunks, mask=has_chunk,
                                                    other=0), 0), axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    if row == 0:  # every chunk program of this step has read the counter
        tl.store(counter_ptr, tl.load(counter_ptr) + 1)


def sample_plain(logits: torch.Tensor, temperatures: torch.Tensor, counter: torch.Tensor, chunk: int = CHUNK,
                 num_warps: int = 4) -> torch.Tensor:
    """One token per row of logits [num_rows, vocab_size] at the rows' temperatures ([num_rows] float32,
    0 = greedy); `counter` ([1] int64 on the device) keys the noise and is advanced. `chunk`: the
    vocabulary entries a program reduces, a power of 2 of at least 4 * 32 * num_warps."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and num_rows * vocab_size < 2**31
    num_chunks = triton.cdiv(vocab_size, chunk)
    chunk_max = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    chunk_kernel[(num_rows, num_chunks)](logits, logits.stride(0), temperatures, counter, chunk_max, chunk_arg,
                                         vocab_size, num_chunks, CHUNK=chunk, num_warps=num_warps)
    pick_kernel[(num_rows,)](chunk_max, chunk_arg, counter, tokens, num_chunks,
                             CHUNKS=triton.next_power_of_2(num_chunks))
    return tokens
