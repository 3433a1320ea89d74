"""The Triton kernels on a CPU, under Triton's interpreter (TRITON_INTERPRET=1), against float64 and the
CPU path's PyTorch functions: their indexing, masking and reductions are checked on every CI run, not
only on a GPU. Skipped where Triton is not installed, and where a GPU is (the interpreter would take
over the kernels for the whole process).

The interpreter runs each program in numpy, so inputs are float32 (its bfloat16 casts truncate and its
bfloat16 dots are not a GPU's) and shapes are small. Its `range()` takes no bound computed from a
kernel's arguments or from memory (`int()` of a one-element array); `run_time_loop_bounds` lets it.
"""
import itertools
import os

import pytest
import torch

if torch.cuda.is_available():  # tests/test_gpu.py runs the kernels themselves; the interpreter would take them over
    pytest.skip("a GPU is here: the kernels run compiled", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined: before the kernel modules are imported
triton = pytest.importorskip("triton")

from nanovllm.layers import activation, layernorm  # noqa: E402
from nanovllm.layers.attention_torch import store_kvcache  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

from conftest import fp8_value_group, fp8_value_layout, prepare_qkv_reference  # noqa: E402


@pytest.fixture
def run_time_loop_bounds(monkeypatch):
    from triton.runtime import interpreter
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


@pytest.fixture
def last_grid_dimension_first(monkeypatch):
    """The interpreter runs a grid's programs with its last dimension outermost and each backwards, where it runs the
    last innermost: programs that share work along it (a split sum's programs of one tile) then run apart, as on a
    GPU they may."""
    from triton.runtime import interpreter
    set_grid_idx = interpreter.InterpreterBuilder.set_grid_idx

    def reordered(builder, x, y, z):
        nx, ny, nz = builder.grid_dim
        position = nx * ny * nz - 1 - ((x * ny + y) * nz + z)
        z, rest = divmod(position, nx * ny)
        set_grid_idx(builder, rest // ny, rest % ny, z)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "set_grid_idx", reordered)


@pytest.fixture
def exact_fp8_casts(monkeypatch):
    """The interpreter's float32 -> e4m3 cast loses a rounding's carry into the exponent (124.3 -> 64, not 128):
    PyTorch's cast, which rounds as a GPU does, in its place."""
    import numpy as np
    from triton.runtime import interpreter
    convert = interpreter._convert_float

    def patched(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == triton.language.float32 and output_dtype == triton.language.float8e4nv:
            floats = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return floats.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(data, input_dtype, output_dtype, rounding_mode)
    monkeypatch.setattr(interpreter, "_convert_float", patched)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def paged_attention_reference(q, k_cache, v_cache, context_lens, block_tables) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per sequence over its keys, read through its block table, in float64."""
    num_heads, block_size = q.size(1), k_cache.size(1)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, n in enumerate(context_lens.tolist()):
        keys = torch.arange(n)
        blocks = block_tables[i, keys // block_size].long()
        k, v = (c[blocks, keys % block_size].double() for c in (k_cache, v_cache))  # [n, kv_heads, d]
        group = num_heads // k.size(1)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * q.size(-1) ** -0.5
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


# One-tile splits; 512- and 1,024-key splits of 128-key tiles (the latter above SHORT_SPLIT_PAIRS (sequence, KV
# head) pairs, here 0), and of 64-key tiles where 128 keys would pass TILE_BYTES (here 4,096); and programs that
# take several splits each (a round of 256 or 2,048 keys: block tables wider than a round, as at any
# max_model_len over 8,192).
@pytest.mark.parametrize("num_seqs, keys_per_round, short_split_pairs, tile_bytes",
                         [(3, 8192, 384, 65536), (17, 8192, 384, 65536), (17, 8192, 0, 65536), (17, 8192, 0, 4096),
                          (3, 256, 384, 65536), (17, 2048, 384, 65536), (17, 2048, 0, 65536)])
def test_decode_attention(run_time_loop_bounds, monkeypatch, num_seqs, keys_per_round, short_split_pairs,
                          tile_bytes):
    """Sequences of one split and of several, whose last split to finish combines them; a second call
    gives the same output (the kernel leaves its arrival counters zeroed)."""
    from nanovllm.engine.step_io import longest_first
    from nanovllm.kernels import decode_attention as module
    from nanovllm.kernels.decode_attention import decode_attention
    monkeypatch.setattr(module, "KEYS_PER_ROUND", keys_per_round)
    monkeypatch.setattr(module, "SHORT_SPLIT_PAIRS", short_split_pairs)
    monkeypatch.setattr(module, "TILE_BYTES", tile_bytes)
    torch.manual_seed(0)
    block_size, width, num_blocks = 16, 160, 192
    k_cache, v_cache = (torch.randn(num_blocks, block_size, 2, 32) for _ in range(2))
    context_lens = torch.tensor([0, 700, 1, 64, 65, 1023, 1024, 1025, 2100, 5, 130] * 2, dtype=torch.int32)[:num_seqs]
    block_tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in range(num_seqs)]).int()
    q = torch.randn(num_seqs, 4, 32)
    out = decode_attention(q, k_cache, v_cache, context_lens, block_tables, 32**-0.5)
    assert not out[0].any()  # a padded row (no keys) gives zeros
    want = paged_attention_reference(q, k_cache, v_cache, context_lens, block_tables)
    assert relative_error(out, want) < 1e-5
    assert torch.equal(decode_attention(q, k_cache, v_cache, context_lens, block_tables, 32**-0.5), out)
    order = torch.from_numpy(longest_first(context_lens.numpy()))  # the engine's program order
    ordered = decode_attention(q, k_cache, v_cache, context_lens, block_tables, 32**-0.5, seq_order=order)
    assert relative_error(ordered, want) < 1e-5


def test_decode_split_rule_edges():
    """One-tile splits up to SMALL_BATCH sequences; above, 512-key splits up to 384 (sequence, KV head) pairs over a
    bf16 cache and 512 over an FP8 one, then 1,024 and 2,048 keys; 64-key tiles where 128 keys pass TILE_BYTES."""
    from nanovllm.kernels.decode_attention import split_and_tile_keys
    rule = split_and_tile_keys  # (sequences, KV heads, an FP8 cache, a key's bytes)
    assert rule(16, 8, False, 256) == (64, 64)
    assert rule(48, 8, False, 256) == (512, 128) and rule(49, 8, False, 256) == (1024, 128)
    assert rule(96, 4, False, 256) == (512, 128) and rule(97, 4, False, 256) == (1024, 128)
    assert rule(64, 8, True, 128) == (512, 128) and rule(65, 8, True, 128) == (2048, 128)
    assert rule(49, 8, False, 1024) == (1024, 64)  # float32 keys of 256 dims


def causal_attention_reference(q, k, v, q_lens, k_lens) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per sequence in float64, each query at row i of a q_len chunk seeing the keys up
    to position k_len - q_len + i; k and v by token, GQA by repeating the KV heads."""
    out, starts_q, starts_k = torch.zeros(q.shape, dtype=torch.float64), 0, 0
    for q_len, k_len in zip(q_lens, k_lens):
        qs, ks, vs = (x.double() for x in (q[starts_q:starts_q + q_len], k[starts_k:starts_k + k_len],
                                            v[starts_k:starts_k + k_len]))
        group = qs.size(1) // ks.size(1)
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * q.size(-1) ** -0.5
        visible = torch.arange(k_len)[None, :] <= (k_len - q_len + torch.arange(q_len))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts_q:starts_q + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
        starts_q, starts_k = starts_q + q_len, starts_k + k_len
    return out


# New prompts (keys by token); chunks continuing a cached prefix (keys through the block table, some sequences
# with more keys than queries; cache blocks smaller than a tile of keys, and larger); GQA and MHA; a head size that
# is not a power of two; tiles smaller than a chunk.
@pytest.mark.parametrize("paged, head_dim, num_kv_heads, block_size",
                         [(False, 64, 2, 16), (True, 64, 2, 16), (True, 64, 2, 64), (True, 48, 4, 16)])
def test_prefill_attention(run_time_loop_bounds, paged, head_dim, num_kv_heads, block_size):
    from nanovllm.kernels.prefill_attention import prefill_attention
    torch.manual_seed(0)
    num_heads = 4
    q_lens = [1, 37, 70, 16]
    k_lens = [q + prefix for q, prefix in zip(q_lens, [0, 21, 32, 150] if paged else [0] * 4)]
    q = torch.randn(sum(q_lens), num_heads, head_dim)
    k, v = (torch.randn(sum(k_lens), num_kv_heads, head_dim) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32) for lens in (q_lens, k_lens))
    want = causal_attention_reference(q, k, v, q_lens, k_lens)
    if paged:  # every sequence's keys in shuffled cache blocks
        blocks_per_seq = [-(-n // block_size) for n in k_lens]
        order = torch.randperm(sum(blocks_per_seq) + 3)
        block_tables = torch.full((len(k_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
        k_cache, v_cache = (torch.zeros(len(order), block_size, num_kv_heads, head_dim) for _ in range(2))
        taken = 0
        for i, n in enumerate(k_lens):
            block_tables[i, :blocks_per_seq[i]] = order[taken:taken + blocks_per_seq[i]]
            taken += blocks_per_seq[i]
            keys = torch.arange(n)
            slots = block_tables[i, keys // block_size].long(), keys % block_size
            k_cache[slots], v_cache[slots] = k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        got = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), head_dim ** -0.5,
                                block_tables, block_m=16, block_n=32)
    else:
        got = prefill_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), head_dim ** -0.5, block_m=16, block_n=32)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("with_residual", [False, True])
def test_residual_rms_norm(with_residual):
    from nanovllm.kernels.elementwise import residual_rms_norm
    x, residual, weight = torch.randn(5, 96) * 3, torch.randn(5, 96), torch.randn(96)
    got = residual_rms_norm(x, residual if with_residual else None, weight, 1e-6)
    want = layernorm.residual_rms_norm(x, residual if with_residual else None, weight, 1e-6)
    if with_residual:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    summed = x.double() + (residual.double() if with_residual else 0)
    exact = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert relative_error(got, want) < 1e-6 and relative_error(got, exact) < 1e-6


def test_silu_and_mul():
    from nanovllm.kernels.elementwise import silu_and_mul
    x = torch.randn(3, 2 * 1100) * 4  # two blocks a row, the second partly past the width
    gate, up = x.double().chunk(2, dim=-1)
    assert relative_error(silu_and_mul(x), activation.silu_and_mul(x)) < 1e-6
    assert relative_error(silu_and_mul(x), torch.nn.functional.silu(gate) * up) < 1e-6


@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3's heads are normalised, Llama's and Qwen2's are not
@pytest.mark.parametrize("num_heads", [4, 6, 2])  # GQA groups of 2, 3 and 1 over 2 KV heads
def test_prepare_qkv_normalises_rotates_and_stores_the_mapped_slots(qk_norm, num_heads):
    from nanovllm.kernels.prepare_qkv import prepare_qkv
    num_tokens, num_kv_heads, d = 6, 2, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * d) * 3
    positions = torch.randint(0, 1000, (num_tokens,))
    q_norm, k_norm, rotary = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6), RotaryEmbedding(d, 1000, 1e4)
    for norm in (q_norm, k_norm):
        norm.weight.data = torch.rand(d) + 0.5
    slots = torch.tensor([3, -1, 0, 17, 30, 8], dtype=torch.int32)
    k_cache, v_cache = (torch.full((2, 16, num_kv_heads, d), float("nan")) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    if not qk_norm:
        q_norm = k_norm = None
    norms = (q_norm.weight, k_norm.weight, 1e-6) if qk_norm else None
    q, k, v = prepare_qkv(qkv, positions, num_heads, num_kv_heads, norms, rotary.cos_sin_cache, k_cache, v_cache, slots,
                          keep_kv=True)
    ref_q, ref_k, ref_v = prepare_qkv_reference(qkv, positions, num_heads, num_kv_heads, q_norm, k_norm, rotary)
    store_kvcache(ref_k, ref_v, want_k, want_v, slots)
    assert relative_error(q, ref_q) < 1e-5 and relative_error(k, ref_k) < 1e-5 and torch.equal(v, ref_v)
    for got, want in ((k_cache, want_k), (v_cache, want_v)):  # only the mapped slots written
        assert torch.equal(got.isnan(), want.isnan())
        assert relative_error(got.nan_to_num(), want.nan_to_num()) < 1e-5


@pytest.mark.parametrize("k", [300, 2500])  # one block of weights, and two (the second prefetched, partly masked)
def test_one_row_linear(run_time_loop_bounds, k):
    from nanovllm.kernels.one_row_linear import one_row_linear
    x, w, b = torch.randn(1, k), torch.randn(71, k) * k**-0.5, torch.randn(71)
    assert relative_error(one_row_linear(x, w, b), x.double() @ w.double().T + b.double()) < 1e-5


@pytest.mark.parametrize("k", [300, 2500])
def test_one_row_linear_takes_silu_and_mul(run_time_loop_bounds, k):
    """The down projection's row [gate | up] (k wide each): silu(gate) * up in float64, then the matmul."""
    from nanovllm.kernels.one_row_linear import one_row_linear
    x, w = torch.randn(1, 2 * k) * 3, torch.randn(71, k) * k**-0.5
    gate, up = x.double().chunk(2, dim=-1)
    exact = (torch.nn.functional.silu(gate) * up) @ w.double().T
    assert relative_error(one_row_linear(x, w, silu_and_mul=True), exact) < 1e-5


def sampling_state(num_slots: int, vocab_size: int):
    """A state whose slots use every feature at random: biases (some -inf), token counts with prompt
    tokens, penalties, seeds, temperatures (slot 0 greedy), and bad words (slot 1's match its last tokens)."""
    from nanovllm.layers.sampling_state import HAS_BAD_WORDS, HAS_BIAS, HAS_PENALTIES, IN_PROMPT, SamplingState
    state = SamplingState(num_slots, vocab_size, torch.device("cpu"))
    state.temperature[:num_slots] = torch.rand(num_slots) + 0.3
    state.temperature[0] = 0.0
    state.bias[:num_slots] = torch.randn(num_slots, vocab_size)
    state.bias[2, ::7] = -torch.inf
    counts = torch.randint(0, 3, (num_slots, vocab_size), dtype=torch.int32)
    state.counts[:num_slots] = counts + IN_PROMPT * (torch.rand(num_slots, vocab_size) < 0.2).int()
    state.presence_penalty[:num_slots] = torch.rand(num_slots)
    state.frequency_penalty[:num_slots] = torch.rand(num_slots)
    state.repetition_penalty[:num_slots] = torch.rand(num_slots) + 0.5
    state.seed[:num_slots] = torch.randint(0, 2**62, (num_slots,))
    state.seeded[:num_slots] = torch.tensor([i % 2 for i in range(num_slots)], dtype=torch.int32)
    state.generated[:num_slots] = torch.randint(0, 500, (num_slots,), dtype=torch.int32)
    state.flags[:num_slots] = torch.tensor([HAS_BIAS | HAS_PENALTIES | HAS_BAD_WORDS, HAS_BAD_WORDS,
                                            HAS_BIAS, HAS_PENALTIES][:num_slots], dtype=torch.int32)
    state.recent[1, -2:] = torch.tensor([40, 41])
    state.bad_prefixes[1, 0, -2:] = torch.tensor([40, 41])  # matched: bans 42
    state.bad_last[1, 0] = 42
    state.bad_prefixes[1, 1, -1] = 39  # not matched
    state.bad_last[1, 1] = 43
    return state


def test_process_kernel_matches_process_native():
    """Every feature of `process` against its PyTorch version; a row reads only what its slot's flags name."""
    from nanovllm.kernels.sampling import process
    from nanovllm.layers.sampler import process_native
    torch.manual_seed(0)
    state = sampling_state(4, 2100)
    slots = torch.tensor([0, 1, 2, 3, 4, 1])  # 4: the scratch slot, as a graph's padding rows
    logits = torch.randn(6, 2100) * 3
    got = process(logits, slots, state)
    state.bias[(state.flags & 1) == 0] = 0.0  # what the kernel skips, the reference must not apply
    state.counts[(state.flags & 2) == 0] = 0
    want = process_native(logits, slots, state)
    assert torch.equal(got.isinf(), want.isinf()) and got[1, 42].item() == -torch.inf and got[1, 43] > -torch.inf
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-6)


def test_race_kernel_is_the_race_reference_given_its_noise():
    """`race` against the PyTorch race on the noise the kernel draws (`exponential_noise`), under thresholds;
    a seeded row draws the same noise at any row of any batch, an unseeded one new noise at each counter."""
    from nanovllm.kernels.sampling import exponential_noise, race
    from nanovllm.layers.sampler import race_reference
    torch.manual_seed(0)
    state = sampling_state(4, 2100)
    scores = torch.randn(5, 2100)
    slots = torch.tensor([0, 1, 2, 3, 2])  # slots 1 and 3 are seeded
    thresholds = torch.tensor([0.0, -torch.inf, 1.0, 0.5, -torch.inf])
    counter = torch.tensor([12345])
    noise = exponential_noise(slots, state, counter, 2100)
    assert (noise > 0).all() and abs(noise.mean().item() - 1) < 0.05
    tokens = race(scores, slots, thresholds, state, counter)
    assert torch.equal(tokens, race_reference(scores, thresholds, state.temperature[slots], noise))
    assert scores[2, tokens[2]] >= 1.0 and scores[3, tokens[3]] >= 0.5
    assert tokens[0] == scores[0].argmax()  # slot 0 is greedy
    seeded_alone = exponential_noise(torch.tensor([1]), state, torch.tensor([999]), 2100)
    assert torch.equal(seeded_alone[0], noise[1])  # slot 1 is seeded
    assert not torch.equal(noise[2], noise[4])  # unseeded rows: noise of their own
    assert not torch.equal(exponential_noise(slots, state, counter + 1, 2100)[2], noise[2])


def test_race_draws_from_the_softmax():
    """Frequencies over 16 rows x 25 counters against softmax(scores) over 4 tokens, in the first and the
    last of two chunks."""
    from nanovllm.kernels.sampling import race
    from nanovllm.layers.sampling_state import SamplingState
    vocab_size, tokens = 2100, [5, 2050, 2051, 2099]
    scores = torch.full((16, vocab_size), -30.0)
    scores[:, tokens] = torch.tensor([0.5, 0.3, 0.15, 0.05]).log() * 2  # temperature 0.5, applied by `process`
    state = SamplingState(1, vocab_size, torch.device("cpu"))
    slots, thresholds = torch.zeros(16, dtype=torch.int64), torch.full((16,), -torch.inf)
    draws = torch.stack([race(scores, slots, thresholds, state, torch.tensor([c])) for c in range(25)])
    expected = torch.softmax(scores[0, tokens], dim=0)  # [0.69, 0.25, 0.06, 0.01]
    observed = torch.stack([(draws == t).double().mean() for t in tokens])
    assert (observed - expected).abs().max() < 0.1, (observed, expected)


@pytest.mark.parametrize("record_rows", [128, 4, 2])  # the counter's rows in one look, in two (the last part full)
@pytest.mark.parametrize("greedy_only", [False, True])  # and in three
def test_record_kernel_matches_record_native(run_time_loop_bounds, monkeypatch, greedy_only, record_rows):
    """Counts, last tokens and lengths of each row's slot (two padding rows in the scratch slot), and the
    counter, which a step of greedy and seeded rows leaves (padding rows are greedy)."""
    import copy

    from nanovllm.kernels import sampling
    from nanovllm.kernels.sampling import record
    from nanovllm.layers.sampler import record_native
    monkeypatch.setattr(sampling, "RECORD_ROWS", record_rows)
    torch.manual_seed(0)
    state = sampling_state(4, 2100)
    if greedy_only:
        state.temperature.zero_()
    slots, tokens = torch.tensor([3, 0, 1, 4, 4, 2]), torch.tensor([7, 2099, 42, 5, 6, 9])  # slot 2 draws unseeded
    native, counter, native_counter = copy.deepcopy(state), torch.tensor([77]), torch.tensor([77])
    record(slots, tokens, state, counter)
    record_native(slots, tokens, native, native_counter)
    assert counter.item() == native_counter.item() == (77 if greedy_only else 78)
    assert torch.equal(state.counts, native.counts) and torch.equal(state.generated, native.generated)
    assert torch.equal(state.recent[:4], native.recent[:4])  # the scratch slot's are whichever row's came last
    assert state.recent[0, -1] == 2099 and torch.equal(state.recent[1, -3:], torch.tensor([40, 41, 42]))


@pytest.mark.parametrize("record_rows", [128, 2])
def test_the_counter_looks_at_no_slot_past_the_rows(run_time_loop_bounds, monkeypatch, record_rows):
    """No row draws unseeded noise, but slot 0 would (its rows past the batch read as slot 0): the counter stays."""
    from nanovllm.kernels import sampling
    monkeypatch.setattr(sampling, "RECORD_ROWS", record_rows)
    state = sampling_state(4, 2100)
    state.temperature[0], state.seeded[0] = 1.0, 0
    counter = torch.tensor([77])
    sampling.record(torch.tensor([3, 1, 4]), torch.tensor([7, 8, 9]), state, counter)
    assert counter.item() == 77


def test_moe_align_by_hand():
    """Pairs 0..5 of experts [[1, 0], [1, 3], [0, 1]], blocks of 4: expert 0's run is pairs 1 and 4, expert 1's
    pairs 0, 2 and 5, expert 2 has none, expert 3's is pair 3, each padded with 6 (no pair) to 4; the runs end
    at 4, 8, 8 and 12, the padded pairs' count."""
    from nanovllm.kernels.moe_align import align
    sorted_pairs, ends = align(torch.tensor([[1, 0], [1, 3], [0, 1]]), num_experts=4, block_m=4)
    assert ends.tolist() == [4, 8, 8, 12]
    runs = [sorted_pairs[start:end].tolist() for start, end in ((0, 4), (4, 8), (8, 12))]
    assert [sorted(run[:n]) + run[n:] for run, n in zip(runs, (2, 3, 1))] == [[1, 4, 6, 6], [0, 2, 5, 6], [3, 6, 6, 6]]


@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalise", [(37, 8, 2, True), (5, 128, 8, True),
                                                                       (6, 60, 4, False)])
def test_moe_route(num_tokens, num_experts, top_k, renormalise):
    """The routing kernel against moe.route's softmax and torch.topk: the same experts in the same order,
    and their weights."""
    from nanovllm.kernels.moe_route import route
    from nanovllm.layers import moe
    torch.manual_seed(num_experts)
    logits = torch.randn(num_tokens, num_experts) * 3
    weights, expert_ids = route(logits, top_k, renormalise)
    want_weights, want_ids = moe.route(logits, top_k, renormalise)
    assert torch.equal(expert_ids, want_ids) and expert_ids.dtype == torch.int64
    assert relative_error(weights, want_weights) < 1e-6 and weights.dtype == torch.float32


@pytest.mark.parametrize("num_tokens", [256, 600])
def test_moe_align_in_one_program_and_in_several(num_tokens):
    """1,024 pairs (the most one program aligns) and 2,400 (three programs of the counting and placing
    kernels) over 16 experts, two of them empty: every expert's run holds its pairs, then padding to the
    block, against a sort in PyTorch."""
    from nanovllm.kernels.moe_align import align
    torch.manual_seed(0)
    expert_ids = torch.randint(0, 14, (num_tokens, 4))
    expert_ids[expert_ids == 5] = 15  # experts 5 and 14 get no pair
    sorted_pairs, ends = align(expert_ids, num_experts=16, block_m=16)
    counts = torch.bincount(expert_ids.flatten(), minlength=16)
    want_ends = torch.cumsum((counts + 15) // 16 * 16, dim=0)
    assert ends.tolist() == want_ends.tolist()
    for expert, (count, end) in enumerate(zip(counts.tolist(), ends.tolist())):
        start = end - (count + 15) // 16 * 16
        run = sorted_pairs[start:end]
        assert sorted(run[:count].tolist()) == torch.nonzero(expert_ids.flatten() == expert).flatten().tolist()
        assert (run[count:] == num_tokens * 4).all()


def moe_reference(x, w13, w2, weights, expert_ids, round_hidden=None) -> torch.Tensor:
    """sum_k weights[t, k] * down(silu(gate x) * up x) of expert ids[t, k], token by token, in float64;
    `round_hidden` rounds silu(gate x) * up x before the down projection."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.size(0)):
        for weight, expert in zip(weights[t].tolist(), expert_ids[t].tolist()):
            gate, up = (w13[expert].double() @ x[t].double()).chunk(2)
            hidden = torch.nn.functional.silu(gate) * up
            out[t] += weight * (w2[expert].double() @ (round_hidden(hidden) if round_hidden else hidden))
    return out


# chosen: fused_moe_few's kernels up to 16 tokens; own_down: the down kernel on tiles other than gate/up's;
# swapped: both products taken transposed
@pytest.mark.parametrize("path", ["chosen", "aligned", "own_down", "swapped"])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_fused_moe(num_tokens, path):
    """Experts 1, 4 and 6 of 8 get no token, most blocks are partly filled, and the hidden (97) and
    intermediate (79) sizes end inside a block; against float64 and the CPU path's expert loop."""
    from nanovllm.kernels.fused_moe import choose_tiles, fused_experts
    from nanovllm.layers.moe import experts_loop, route
    torch.manual_seed(num_tokens)
    num_experts, hidden, intermediate, top_k = 8, 97, 79, 2
    x = torch.randn(num_tokens, hidden)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden) / 10
    w2 = torch.randn(num_experts, hidden, intermediate) / 10
    logits = torch.randn(num_tokens, num_experts)
    logits[:, [1, 4, 6]] = -torch.inf
    weights, expert_ids = route(logits, top_k, renormalise=True)
    tiles = choose_tiles(num_tokens * top_k, num_experts) if path != "chosen" else None
    down_tiles = tiles._replace(block_n=2 * tiles.block_n, block_k=32, num_stages=2) if path == "own_down" else None
    if path == "swapped":
        tiles = tiles._replace(swap_ab=True)
    got = fused_experts(x, w13, w2, weights, expert_ids, tiles, down_tiles=down_tiles)
    assert relative_error(got, moe_reference(x, w13, w2, weights, expert_ids)) < 1e-5
    assert relative_error(got, experts_loop(x, w13, w2, weights, expert_ids)) < 1e-5


def test_topk_sum():
    """Each token's top_k rows summed, against float64: a hidden size past one program's 1,024 columns that ends
    inside a block. (float32: the interpreter truncates a cast to bfloat16, where the GPU rounds.)"""
    from nanovllm.kernels.fused_moe import topk_sum
    torch.manual_seed(0)
    per_pair = torch.randn(5 * 8, 2100) * torch.logspace(-2, 2, 2100)
    got = topk_sum(per_pair, top_k=8)
    want = per_pair.double().view(5, 8, 2100).sum(1)
    assert got.shape == (5, 2100) and relative_error(got, want) < 1e-6


def few_token_experts_error(num_tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
                            seed: int) -> float:
    """fused_moe_few's kernels on random weights and routes, against float64."""
    from nanovllm.kernels.fused_moe_few import few_token_experts
    from nanovllm.layers.moe import route
    torch.manual_seed(seed)
    x = torch.randn(num_tokens, hidden)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate) / intermediate**0.5
    weights, expert_ids = route(torch.randn(num_tokens, num_experts), top_k, renormalise=True)
    got = few_token_experts(x, w13, w2, weights, expert_ids)
    return relative_error(got, moe_reference(x, w13, w2, weights, expert_ids))


def test_few_token_experts_over_several_blocks_of_the_reduction():
    """fused_moe_few's kernels where the hidden size (2,500) takes two steps of the gate/up reduction and an
    odd intermediate size (79) ends inside a program's columns."""
    assert few_token_experts_error(3, num_experts=6, hidden=2500, intermediate=79, top_k=2, seed=0) < 1e-5


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_few_token_experts_at_an_odd_top_k(num_tokens):
    """fused_moe_few's kernels at top_k 3, an intermediate size (600) that ends inside its down reduction's
    block and a hidden size (97) that ends inside a down program's columns."""
    assert few_token_experts_error(num_tokens, num_experts=5, hidden=97, intermediate=600, top_k=3,
                                   seed=num_tokens) < 1e-5


def packed_fp8(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight [..., N, K] packed by the FP8 checkpoint tests' packer, a matrix at a time, as e4m3 and its scale
    (per row or per 128x128 block), and the float64 weight they stand for."""
    from test_fp8_checkpoints import pack_blocks, pack_channels, unpack_blocks
    pack = pack_blocks if scheme == "block" else lambda w: pack_channels(w, "channel")
    pairs = [pack(matrix) for matrix in weight.reshape(-1, *weight.shape[-2:])]
    packed = torch.stack([p for p, _ in pairs]).reshape(weight.shape)
    scale = torch.stack([s for _, s in pairs]).reshape(*weight.shape[:-2], *pairs[0][1].shape)
    exact = [unpack_blocks(p, s) if scheme == "block" else p.float() * s for p, s in pairs]
    return packed, scale, torch.stack(exact).reshape(weight.shape).double()


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("k", [300, 2500])  # one block of the reduction (three of scales), and two (20 of scales)
def test_one_row_linear_reads_fp8_weights(run_time_loop_bounds, scheme, k):
    from nanovllm.kernels.one_row_linear import one_row_linear
    torch.manual_seed(k)
    x, b = torch.randn(1, 2 * k), torch.randn(300)
    packed, scale, exact = packed_fp8(torch.randn(300, k) * k**-0.5, scheme)
    assert relative_error(one_row_linear(x[:, :k], packed, b, scale=scale), x[:, :k].double() @ exact.T + b) < 1e-5
    gate, up = x.double().chunk(2, dim=-1)
    silu_and_mul = (torch.nn.functional.silu(gate) * up) @ exact.T
    assert relative_error(one_row_linear(x, packed, silu_and_mul=True, scale=scale), silu_and_mul) < 1e-5


def e4m3_by_groups(x: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """x as W8A8 kernels see it: each row's groups of 128 columns (or each whole row, per_token) rounded to e4m3
    by a scale of amax / 448."""
    group = x.size(-1) if per_token else 128
    groups = torch.nn.functional.pad(x.float(), (0, -x.size(-1) % group)).unflatten(-1, (-1, group))
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 448.0
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2)[..., :x.size(-1)].double()


def dequantized_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [rows, cols] times its scales [rows, groups]: of 128 columns each, or one a row, in float64."""
    group = 128 if scale.size(1) > 1 else q.size(1)
    return (q.double() * scale.double().repeat_interleave(group, 1)[:, :q.size(1)])


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("for_torch", [False, True])
@pytest.mark.parametrize("silu_and_mul", [False, True])
def test_quantize_groups(exact_fp8_casts, silu_and_mul, for_torch, per_token):
    """Rows of 300 (two groups and a part, or one scale a row); a row of zeros stays zero. For torch's block-scaled
    matmul: the 5 rows padded to 8 with zeros, the scales [rows, groups] column-major; per token, as they are."""
    from nanovllm.kernels.fp8_linear import quantize_groups
    torch.manual_seed(0)
    x = torch.randn(5, 600 if silu_and_mul else 300) * 4
    x[2] = 0
    q, scale = quantize_groups(x, silu_and_mul, for_torch=for_torch, per_token=per_token)
    if silu_and_mul:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    rows, groups = 8 if for_torch and not per_token else 5, 1 if per_token else 3
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, 300) and scale.shape == (rows, groups)
    assert scale.stride() == ((1, 1) if per_token else (1, 8) if for_torch else (3, 1))  # row-wise: contiguous
    dequantized = dequantized_rows(q, scale)
    assert relative_error(dequantized[:5], e4m3_by_groups(x, per_token)) < 1e-6
    assert not dequantized[5:].any()


@pytest.mark.parametrize("with_residual", [False, True])
def test_residual_rms_norm_quantizes_per_token(exact_fp8_casts, with_residual):
    """With quantize: the norm as without, and beside it its rows rounded to e4m3 by a scale per row (a row of
    zeros stays zero), as quantize_groups(per_token=True) lays them out."""
    from nanovllm.kernels.elementwise import residual_rms_norm
    torch.manual_seed(0)
    x, residual, weight = torch.randn(5, 300) * 3, torch.randn(5, 300), torch.randn(300)
    x[2] = 0
    residual[2] = 0
    got = residual_rms_norm(x, residual if with_residual else None, weight, 1e-6, quantize=True)
    want = layernorm.residual_rms_norm(x, residual if with_residual else None, weight, 1e-6)
    if with_residual:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert relative_error(got.rows, want) < 1e-6
    assert got.quantized.dtype == torch.float8_e4m3fn and got.quantized.shape == (5, 300)
    assert got.scale.shape == (5, 1)
    assert relative_error(dequantized_rows(got.quantized, got.scale), e4m3_by_groups(got.rows, per_token=True)) < 1e-6
    assert not got.quantized[2].float().any()
    for plain in (x[:1], x.unsqueeze(0)):  # one row (the one-row kernel's) and 3-D rows are not quantized
        assert isinstance(residual_rms_norm(plain, None, weight, 1e-6, quantize=True), torch.Tensor)


def test_torch_row_wise_matmul_takes_rows_quantized_per_token(exact_fp8_casts):
    """Per-channel weights above TORCH_ROWWISE_ROWS: the rows as quantize_groups makes them for torch's row-wise
    matmul (65: no multiple of 4), which torch's own checks take (its CPU matmul here), against float64."""
    from nanovllm.kernels.fp8_linear import quantize_groups, torch_matmul
    torch.manual_seed(0)
    x, b = torch.randn(65, 256), torch.randn(96)
    packed, scale, exact = packed_fp8(torch.randn(96, 256) / 15, "channel")
    got = torch_matmul(quantize_groups(x, for_torch=True, per_token=True), 65, packed, scale, b, torch.float32)
    assert relative_error(got, e4m3_by_groups(x, per_token=True) @ exact.T + b) < 1e-5


@pytest.mark.parametrize("rows, columns, k, row_scales, tiles", [
    (16, 1024, 2048, True, (16, 32)), (65, 1024, 2048, True, (64, 32)), (256, 1024, 3072, True, (64, 32)),
    (128, 2048, 4096, True, (64, 32)), (257, 1024, 2048, True, (64, 128)), (129, 2048, 4096, True, (64, 128)),
    (256, 1024, 2048, False, (64, 128)), (2048, 128, 1024, True, (64, 128)), (128, 6144, 2048, True, (64, 32)),
    (129, 6144, 1024, True, (64, 128)), (128, 6144, 2049, True, (64, 128)), (300, 128, 4096, True, (64, 128))])
def test_fp8_matmul_tiles_at_decode_batches(rows, columns, k, row_scales, tiles):
    """Above 64 rows with row scales, the 64x32 tiles stay for an output of at most 16 tiles of 128x128 up to 256
    rows, and for sums of at most 2,048 columns up to 128 rows; other products take tiles by rows."""
    from nanovllm.kernels.fp8_tiles import choose_tiles
    chosen = choose_tiles(rows, columns, k, row_scales)
    assert (chosen.block_m, chosen.block_n) == tiles


@pytest.mark.parametrize("rows, columns, k, split_k", [
    (65, 1024, 2048, 3), (128, 1024, 3072, 4), (256, 1024, 3072, 2), (65, 2048, 4096, 2), (65, 4096, 1024, 1),
    (16, 1024, 640, 1), (16, 1024, 4096, 4), (300, 1024, 3072, 1)])
def test_fp8_matmul_split_k_rule(rows, columns, k, split_k):
    """A tile's sum splits towards 256 programs in all, each at least 5 steps of 128 columns, at most 4 ways; prompt
    tiles do not split."""
    from nanovllm.kernels.fp8_tiles import choose_split_k, choose_tiles
    assert choose_split_k(rows, columns, k, choose_tiles(rows, columns, k, row_scales=True)) == split_k


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("k, split_k", [(1000, 3), (200, 4)])
def test_fp8_matmul_split_over_programs(run_time_loop_bounds, exact_fp8_casts, last_grid_dimension_first, scheme,
                                        k, split_k):
    """A tile's sum split over programs (the last to finish adds the partials), the tiles' programs interleaved: 8
    steps over 3 splits, the last ending inside a step; 2 steps over 4, two splits empty. Against float64, and the
    same output from a second call (the counters are left zeroed)."""
    from nanovllm.kernels.fp8_linear import fp8_matmul, quantize_groups
    from nanovllm.kernels.fp8_tiles import Tiles
    torch.manual_seed(k)
    x, b = torch.randn(70, k), torch.randn(100)
    packed, scale, exact = packed_fp8(torch.randn(100, k) / 15, scheme)
    q, q_scale = quantize_groups(x, per_token=scheme == "channel")
    got = fp8_matmul(q, q_scale, packed, scale, b, out_dtype=torch.float32, tiles=Tiles(64, 32), split_k=split_k)
    assert relative_error(got, e4m3_by_groups(x, per_token=scheme == "channel") @ exact.T + b) < 1e-5
    again = fp8_matmul(q, q_scale, packed, scale, b, out_dtype=torch.float32, tiles=Tiles(64, 32), split_k=split_k)
    assert torch.equal(again, got)


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("rows, tiles, for_torch, per_token", [
    (5, None, False, False), (40, None, False, False), (300, None, False, False), (70, (32, 64, 64), False, False),
    (70, (32, 64, 64), True, False), (70, (32, 64, 64), True, True), (40, None, False, True)])
def test_fp8_matmul(run_time_loop_bounds, exact_fp8_casts, scheme, rows, tiles, for_torch, per_token):
    """W8A8: rows, output columns (300) and the reduction (200: a group and a part) all end inside a tile;
    against float64 on the activations rounded by groups (or per token) here. Scales in each layout of
    quantize_groups."""
    from nanovllm.kernels.fp8_linear import fp8_matmul, quantize_groups
    from nanovllm.kernels.fp8_tiles import Tiles
    torch.manual_seed(rows)
    x, b = torch.randn(rows, 200), torch.randn(300)
    packed, scale, exact = packed_fp8(torch.randn(300, 200) / 15, scheme)
    q, q_scale = quantize_groups(x, for_torch=for_torch, per_token=per_token)
    got = fp8_matmul(q[:rows], q_scale[:rows], packed, scale, b, out_dtype=torch.float32,
                     tiles=tiles and Tiles(*tiles))
    assert relative_error(got, e4m3_by_groups(x, per_token) @ exact.T + b) < 1e-5


def fp8_experts_layer(num_tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int, scheme: str,
                      w2_divisor: float) -> tuple:
    """Tokens, stacked FP8 experts (w13, then w2: each packed, its scale, the float64 it holds) and their routes,
    seeded by num_tokens."""
    from nanovllm.layers.moe import route
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden)
    w13 = packed_fp8(torch.randn(num_experts, 2 * intermediate, hidden) / 15, scheme)
    w2 = packed_fp8(torch.randn(num_experts, hidden, intermediate) / w2_divisor, scheme)
    return x, w13, w2, *route(torch.randn(num_tokens, num_experts), top_k, renormalise=True)


@pytest.mark.parametrize("scheme", ["channel", "block"])
# fused_moe_few's kernels (W8A16), then the grouped ones (W8A8): on the tiles chosen at 40 pairs (32x128x128
# transposed) and at 74 (64x64x128), and on 16x64x128 transposed
@pytest.mark.parametrize("num_tokens, swap_ab", [(3, False), (20, False), (37, False), (37, True)])
def test_fused_moe_reads_fp8_experts(exact_fp8_casts, num_tokens, swap_ab, scheme):
    """Stacked FP8 experts with their scales: the hidden size (200) ends inside a block of scales; the
    intermediate size is a whole block (128), as the up rows' scales must start at one. The grouped path
    rounds x and the intermediate rows to e4m3 by groups, as the reference here does."""
    from nanovllm.kernels.fused_moe import Tiles, fused_experts
    top_k = 2
    x, (w13, w13_scale, w13_exact), (w2, w2_scale, w2_exact), weights, expert_ids = fp8_experts_layer(
        num_tokens, num_experts=4, hidden=200, intermediate=128, top_k=top_k, scheme=scheme, w2_divisor=11)
    tiles = Tiles(16, 64, 128, swap_ab=True) if swap_ab else None
    got = fused_experts(x, w13, w2, weights, expert_ids, tiles, w13_scale=w13_scale, w2_scale=w2_scale)
    w8a8 = num_tokens * top_k > 32
    want = moe_reference(e4m3_by_groups(x) if w8a8 else x, w13_exact, w2_exact, weights, expert_ids,
                         e4m3_by_groups if w8a8 else None)
    assert relative_error(got, want) < (2e-3 if w8a8 else 1e-5)


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_few_token_experts_read_fp8_experts_over_groups(num_tokens, scheme):
    """fused_moe_few's kernels with FP8 experts (FP8_TILES): the down sum (intermediate 384) steps over 256
    columns, two groups of block scales, and ends inside a step; top_k 3 leaves one of the four slots empty;
    the hidden size (199) ends inside a gate/up step and a down program's columns. Against float64 on the
    dequantized weights (W8A16: activations are not rounded on this path)."""
    from nanovllm.kernels.fused_moe_few import FP8_TILES, few_token_experts
    x, (w13, w13_scale, w13_exact), (w2, w2_scale, w2_exact), weights, expert_ids = fp8_experts_layer(
        num_tokens, num_experts=5, hidden=199, intermediate=384, top_k=3, scheme=scheme, w2_divisor=20)
    got = few_token_experts(x, w13, w2, weights, expert_ids, w13_scale, w2_scale)
    assert FP8_TILES.down_step_bytes // w2.element_size() == 256
    assert relative_error(got, moe_reference(x, w13_exact, w2_exact, weights, expert_ids)) < 1e-5


def fp8_cache(shape, values: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random e4m3 cache with a scale per token and head, laid out as `utils/fp8_kv.py` documents (values as
    `fp8_value_layout` lays them out, scales [block, kv head, slot]), and the float64 values it holds by slot
    ([block, slot, kv head, dim], the reference's). shape: [blocks, slots, kv heads, dims]."""
    cache = (torch.rand(shape) * 896 - 448).to(torch.float8_e4m3fn)
    scales = torch.rand(shape[:-1]) * 1e-2 + 1e-3
    held = cache.double() * scales.double()[..., None]
    return (fp8_value_layout(cache) if values else cache), scales.transpose(1, 2).contiguous(), held


# One-tile splits (64 keys), then 512-key splits (128-key tiles); tiles over several blocks, and in one block:
# splits over several blocks, within one, and over blocks they do not start or end with (384, 640 keys); programs
# that take several splits (a round of 1,024 keys); splits of a length not a power of two (384 keys); the 1,024- and
# 2,048-key splits (2,048: above FP8_SHORT_SPLIT_PAIRS), over blocks they do not start or end with and taken
# several a program; GQA groups of 2 and of 8 (Qwen3-30B-A3B's); values in groups of 16, 32 and 64 slots.
@pytest.mark.parametrize("num_seqs,block_size,keys_per_round,split,group", [
    (3, 16, 8192, None, 2), (3, 64, 8192, None, 2), (17, 16, 8192, None, 2), (17, 48, 8192, None, 2),
    (17, 96, 8192, None, 2), (17, 128, 8192, None, 2),
    (17, 384, 8192, None, 2), (17, 640, 1024, None, 2), (17, 2048, 8192, None, 2), (17, 128, 8192, (384, 128), 2),
    (17, 128, 8192, (1024, 128), 2), (17, 256, 8192, (2048, 128), 2), (17, 384, 2048, (2048, 128), 2),
    (17, 128, 8192, None, 8)])
def test_decode_attention_over_an_fp8_cache(run_time_loop_bounds, monkeypatch, num_seqs, block_size, keys_per_round,
                                            split, group):
    from nanovllm.engine.step_io import longest_first
    from nanovllm.kernels import decode_attention as module
    from nanovllm.kernels.decode_attention import decode_attention
    monkeypatch.setattr(module, "KEYS_PER_ROUND", keys_per_round)
    torch.manual_seed(0)
    width = -(-2100 // block_size)
    num_blocks = width + 32
    (k_cache, k_scales, k_values), (v_cache, v_scales, v_values) = (fp8_cache((num_blocks, block_size, 2, 32), values)
                                                                    for values in (False, True))
    context_lens = torch.tensor([0, 700, 1, 64, 65, 1023, 1024, 1025, 2100, 5, 130] * 2, dtype=torch.int32)[:num_seqs]
    block_tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in range(num_seqs)]).int()
    for row, length in zip(block_tables, context_lens.tolist()):
        row[-(-length // block_size):] = -1  # no block past a sequence's keys: none may be read
    q = torch.randn(num_seqs, 2 * group, 32)
    split_keys, tile_keys = split or (None, None)
    order = torch.from_numpy(longest_first(context_lens.numpy()))  # the engine's program order
    out = decode_attention(q, k_cache, v_cache, context_lens, block_tables, 32**-0.5, split_keys=split_keys,
                           tile_keys=tile_keys, kv_scales=(k_scales, v_scales), seq_order=order)
    want = paged_attention_reference(q, k_values, v_values, context_lens, block_tables)
    assert relative_error(out, want) < 1e-5


@pytest.mark.parametrize("head_dim,block_size,block_m,block_n", [
    (64, 16, 16, 32), (64, 32, 16, 16), (64, 128, 16, 32), (48, 16, 16, 16), (48, 96, 16, 32), (64, 16, 64, 64)])
def test_prefill_attention_over_an_fp8_cache(run_time_loop_bounds, head_dim, block_size, block_m, block_n):
    """Chunks continuing cached prefixes, read through the block table from an e4m3 cache: tiles over two blocks
    (four: the engine's 64x64 tiles over blocks of 16), in one, and heads padded to a power of two; values in groups
    of 16, 32 and 64 slots."""
    from nanovllm.kernels.prefill_attention import prefill_attention
    torch.manual_seed(0)
    num_heads, num_kv_heads = 4, 2
    q_lens, prefixes = [1, 37, 70, 16], [0, 21, 32, 150]
    k_lens = [q + prefix for q, prefix in zip(q_lens, prefixes)]
    blocks_per_seq = [-(-n // block_size) for n in k_lens]
    order = torch.randperm(sum(blocks_per_seq))
    block_tables = torch.full((len(k_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = order[taken:taken + n]
        taken += n
    shape = (sum(blocks_per_seq), block_size, num_kv_heads, head_dim)
    (k_cache, k_scales, k_values), (v_cache, v_scales, v_values) = (fp8_cache(shape, values)
                                                                    for values in (False, True))
    keys = [(block_tables[i, torch.arange(n) // block_size].long(), torch.arange(n) % block_size)
            for i, n in enumerate(k_lens)]
    k, v = (torch.cat([values[slots] for slots in keys]) for values in (k_values, v_values))
    q = torch.randn(sum(q_lens), num_heads, head_dim)
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32) for lens in (q_lens, k_lens))
    got = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), head_dim ** -0.5, block_tables,
                            block_m=block_m, block_n=block_n, kv_scales=(k_scales, v_scales))
    assert relative_error(got, causal_attention_reference(q, k, v, q_lens, k_lens)) < 1e-5


@pytest.mark.parametrize("block_size", [16, 48, 96, 128])  # value groups of 16 (one, three), 32 (three), 64 (two)
def test_prepare_qkv_stores_e4m3_heads_with_their_scales(exact_fp8_casts, block_size):
    """Each stored head is the PyTorch layers' key or value over its scale, its largest magnitude over 448, as e4m3
    rounds it (within float32's rounding of the head's values before the cast), values in groups of slots."""
    from nanovllm.kernels.prepare_qkv import prepare_qkv
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads, d = 6, 4, 2, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * d) * 3
    positions = torch.randint(0, 1000, (num_tokens,))
    q_norm, k_norm, rotary = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6), RotaryEmbedding(d, 1000, 1e4)
    slots = torch.tensor([3, -1, 0, block_size - 1, block_size + 40 % block_size, 2 * block_size - 7]).int()
    group = fp8_value_group(block_size)
    k_cache = torch.zeros(2, block_size, num_kv_heads, d, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(2, num_kv_heads, block_size // group, d, group, dtype=torch.float8_e4m3fn)  # (utils/fp8_kv)
    k_scales, v_scales = (torch.full((2, num_kv_heads, block_size), -1.0) for _ in range(2))  # [block, kv head, slot]
    prepare_qkv(qkv, positions, num_heads, num_kv_heads, (q_norm.weight, k_norm.weight, 1e-6), rotary.cos_sin_cache,
                k_cache, v_cache, slots, keep_kv=False, kv_scales=(k_scales, v_scales))
    _, ref_k, ref_v = prepare_qkv_reference(qkv, positions, num_heads, num_kv_heads, q_norm, k_norm, rotary)
    written = slots >= 0
    blocks, within = slots[written].long() // block_size, slots[written].long() % block_size
    values_by_slot = v_cache.permute(0, 2, 4, 1, 3).flatten(1, 2)  # [block, slot, kv head, dim]
    for cache, scales, ref in ((k_cache, k_scales, ref_k), (values_by_slot, v_scales, ref_v)):
        got_scales = scales[blocks, :, within]
        want_scales = ref[written].double().abs().amax(-1) / 448
        assert torch.allclose(got_scales.double(), want_scales, rtol=1e-5)
        assert (scales.ne(-1).sum((0, 2)) == written.sum()).all()  # only the mapped slots
        got = cache[blocks, within].double()
        want = (ref[written].double() / want_scales[..., None]).to(torch.float8_e4m3fn).double()
        assert (got - want).abs().le(want.abs() * 2**-3 + 2**-9).all()  # at most one e4m3 step apart
        assert (got.abs().amax(-1) == 448).all()
