"""The CUDA path (prompt and decode attention, the Triton KV store, decode graphs) on a random bf16 checkpoint with
Qwen3-0.6B's dimensions, against transformers' float32 forward on the same weights.

Each engine configuration runs once, in a module fixture that collects what the tests check and
then exits the engine. "The same greedy tokens" is gpu_helpers.assert_same_greedy's.
"""

from contextlib import contextmanager

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence

from conftest import prepare_qkv_reference
from gpu_helpers import BASE, PROMPTS, TOLERANCE, assert_same_greedy, generate, random_prompts

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu

LOGITS_PROMPT_LENS = [7, 60, 256, 300, 513, 1000]


@pytest.fixture(scope="module")
def checkpoint(qwen3_checkpoint) -> str:
    return qwen3_checkpoint


@pytest.fixture(scope="module")
def reference(qwen3_reference):
    return qwen3_reference


def start_engine(checkpoint: str, **kwargs) -> LLM:
    return LLM(checkpoint, **{**BASE, **kwargs})


def num_compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@contextmanager
def counting_triton_variants():
    """Counts the Triton kernel variants this process builds (compiled, or loaded from the disk cache)
    while the context is open: [count], updated in place."""
    import triton
    count, previous = [0], triton.knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        count[0] += 1
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        yield count
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous


def engine_prefill_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every prompt position from one prefill step of the engine's model (all prompts batched)."""
    from nanovllm.engine.input_builder import build_step_input
    from nanovllm.engine.scheduler import SchedulerOutput
    runner, block_manager = llm.executor.model_runner, llm.scheduler.block_manager
    seqs = [Sequence(prompt, seq_id=i) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        block_manager.allocate(seq)
        assert seq.num_computed_tokens == 0
    n = len(seqs)
    out = SchedulerOutput(seqs=seqs, num_computed=[0] * n, num_scheduled=[len(p) for p in prompts],
                          pending_rows=[-1] * n, num_hashed_before=[0] * n, row_samples=[True] * n, sampled=seqs)
    try:
        step, _ = build_step_input(out, llm.config.kvcache_block_size, ())
        with torch.inference_mode():
            prefill, = runner.inputs.upload(step.prefill)
            logits = runner.model.compute_logits(runner._prefill(prefill)).float()
    finally:
        for seq in seqs:
            block_manager.deallocate(seq)
    return list(logits.split([len(p) for p in prompts]))


@pytest.fixture(scope="module")
def graph_run(checkpoint) -> dict:
    """The default engine: decode graphs, the KV cache sized from gpu_memory_utilization."""
    with counting_triton_variants() as triton_variants:
        llm = start_engine(checkpoint, gpu_memory_utilization=0.5)
        try:
            return run_the_default_engine(llm, triton_variants)
        finally:
            llm.exit()


def run_the_default_engine(llm: LLM, triton_variants: list[int]) -> dict:
    free, total = torch.cuda.mem_get_info()
    runner = llm.executor.model_runner
    run = dict(buckets=runner.decode_graphs.buckets, num_blocks=runner.num_kvcache_blocks,
               used_fraction=(total - free) / total, block_size=llm.config.kvcache_block_size,
               triton_variants_at_start=triton_variants[0], compiled_graphs=num_compiled_graphs())
    run["logits"] = engine_prefill_logits(llm, random_prompts(LOGITS_PROMPT_LENS, seed=2))
    run["tokens"], run["prefill_tokens"] = generate(llm, PROMPTS)
    run["tokens_hit"], run["prefill_tokens_hit"] = generate(llm, PROMPTS)  # every full block is cached now
    run["tokens_odd"], _ = generate(llm, PROMPTS[:5])  # a decode batch of 5 replays the graph for 8
    run["tokens_alone"], _ = generate(llm, PROMPTS[:1])  # one row: the Triton one-row matmuls
    # Shapes start-up did not see: one-token prompts, sampling at odd batch sizes, prompts joining decodes.
    generate(llm, random_prompts([1, 1, 3], seed=4), SamplingParams(temperature=0.7, max_tokens=9))
    mixed = random_prompts([5, 17, 130, 600, 33, 2, 1000], seed=5)
    llm.generate(mixed, [SamplingParams(temperature=0.5, max_tokens=7 * i + 1) for i in range(len(mixed))],
                 use_tqdm=False)
    run["triton_variants_after_runs"] = triton_variants[0]
    return run


@pytest.fixture(scope="module")
def eager_run(checkpoint) -> dict:
    llm = start_engine(checkpoint, enforce_eager=True, num_kvcache_blocks=64)
    try:
        assert llm.executor.model_runner.decode_graphs is None
        return dict(tokens=generate(llm, PROMPTS)[0], tokens_odd=generate(llm, PROMPTS[:5])[0])
    finally:
        llm.exit()


def paged_batch(num_cached: list[int], num_new: list[int], block_size: int = 256):
    """Block tables (-1 padded) over shuffled blocks, and the slots of each sequence's new tokens."""
    num_blocks = [-(-(c + n) // block_size) for c, n in zip(num_cached, num_new)]
    ids = torch.randperm(sum(num_blocks) + 3).tolist()
    tables = [[ids.pop() for _ in range(b)] for b in num_blocks]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, c, n in zip(tables, num_cached, num_new) for p in range(c, c + n)]
    padded = [t + [-1] * (max(num_blocks) - len(t)) for t in tables]
    cuda = dict(device="cuda", dtype=torch.int32)
    return torch.tensor(padded, **cuda), torch.tensor(slots, **cuda), sum(num_blocks) + 3


def attention_inputs(num_tokens: int, num_blocks: int, block_size: int = 256):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(num_tokens, 16, 128, **bf16)
    kv = torch.randn(num_tokens, 2 * 8 * 128, **bf16)  # k and v as strided views, as the model makes them
    k, v = (t.view(-1, 8, 128) for t in kv.split(8 * 128, dim=-1))
    caches = [torch.randn(num_blocks, block_size, 8, 128, **bf16) for _ in range(2)]
    return q, k, v, *caches


def assert_matches_float32_torch_backend(q, k, v, k_cache, v_cache, context):
    from nanovllm.kernels.flash_attn import cuda_attention
    from nanovllm.layers.attention_torch import store_kvcache, torch_attention
    store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
    out = cuda_attention(q, k, v, k_cache, v_cache, context, 128**-0.5)
    as_float = (t.float() for t in (q, k, v, k_cache, v_cache))
    ref = torch_attention(*as_float, context, 128**-0.5)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_nothing_compiles_after_start_up(graph_run):
    """Every Triton variant a run needs is built at start-up, and nothing goes through torch.compile.
    First in the file, so no kernel test has built a variant the engine's start-up missed."""
    assert graph_run["triton_variants_at_start"] > 0
    assert graph_run["triton_variants_after_runs"] == graph_run["triton_variants_at_start"]
    assert graph_run["compiled_graphs"] == 0


@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (8, 4)])
def test_prepare_qkv_matches_the_pytorch_layers(num_heads, num_kv_heads):
    """The fused kernel against the model's PyTorch norm and rotary (same bf16 roundings) and a float64
    computation; it writes exactly the mapped cache slots (the others keep their NaN poison)."""
    from nanovllm.kernels.prepare_qkv import prepare_qkv
    from nanovllm.layers.attention_torch import store_kvcache
    from nanovllm.layers.layernorm import RMSNorm
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    num_tokens, d = 300, 128
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * d, **bf16) * 3
    positions = torch.randint(0, 40960, (num_tokens,), device="cuda")
    # Built on the CPU, so their forwards are the PyTorch layers', then moved to the GPU.
    q_norm, k_norm = (RMSNorm(d, 1e-6).to(**bf16) for _ in range(2))
    rotary = RotaryEmbedding(d, 40960, 1e6).cuda()
    for norm in (q_norm, k_norm):
        norm.weight.data.copy_(torch.rand(d, **bf16) + 0.5)
    cos_sin = rotary.cos_sin_cache
    slots = torch.randperm(8 * 256, device="cuda")[:num_tokens].int()
    slots[::7] = -1
    k_cache, v_cache = (torch.full((8, 256, num_kv_heads, d), float("nan"), **bf16) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q, k, v = prepare_qkv(qkv, positions, num_heads, num_kv_heads, (q_norm.weight, k_norm.weight, 1e-6), cos_sin,
                          k_cache, v_cache, slots, keep_kv=True)
    ref_q, ref_k, ref_v = prepare_qkv_reference(qkv, positions, num_heads, num_kv_heads, q_norm, k_norm, rotary)
    store_kvcache(ref_k, ref_v, want_k, want_v, slots)
    for got, want in ((q, ref_q), (k, ref_k), (k_cache, want_k)):
        assert torch.equal(got.isnan(), want.isnan())
        assert ((got.nan_to_num() - want.nan_to_num()).float().norm() / want.nan_to_num().float().norm()) < 2e-3
    assert torch.equal(v, ref_v) and torch.equal(v_cache.nan_to_num(), want_v.nan_to_num())
    x = qkv.double().view(num_tokens, -1, d)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    weights = torch.cat([q_norm.weight.expand(num_heads, d), k_norm.weight.expand(num_kv_heads, d)]).double()
    x1, x2 = (normed[:, :num_heads + num_kv_heads] * weights).chunk(2, dim=-1)
    cos, sin = cos_sin[positions].double().chunk(2, dim=-1)
    exact = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    got = torch.cat((q, k), dim=1).double()
    assert ((got - exact).norm() / exact.norm()).item() < 1e-2


@pytest.mark.parametrize("num_cached, num_new", [([0, 0, 0], [5, 100, 700]), ([256, 300, 0], [5, 100, 700]),
                                                  ([256, 300, 10], [5, 100, 700]), ([256, 300, 0], [1, 1, 1])])
def test_prompt_attention_matches_torch_backend(num_cached, num_new):
    """New prompts, prompts continuing cached keys (first, as the input builder orders them), and both in one step,
    where the first attend over the cache and the others over the step's own keys."""
    from nanovllm.utils.context import prefill_context
    block_tables, slots, num_blocks = paged_batch(num_cached, num_new)
    cu_q = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    lens_k = [c + n for c, n in zip(num_cached, num_new)]
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    num_paged = sum(c > 0 for c in num_cached)
    context = prefill_context(cu_q, cu_k, max(num_new), max(lens_k), slots, block_tables, num_paged,
                              sum(num_new[:num_paged]), max(num_new[:num_paged], default=0))
    assert_matches_float32_torch_backend(*attention_inputs(sum(num_new), num_blocks), context)


def test_prompt_attention_without_cache_attends_to_own_keys():
    from nanovllm.kernels.flash_attn import cuda_attention
    from nanovllm.layers.attention_torch import torch_attention
    from nanovllm.utils.context import Context
    q, k, v, _, _ = attention_inputs(300, 1)
    cu = torch.tensor([0, 100, 300], device="cuda", dtype=torch.int32)
    context = Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200)
    empty = torch.tensor([], device="cuda", dtype=torch.bfloat16)
    out = cuda_attention(q, k, v, empty, empty, context, 128**-0.5)
    ref = torch_attention(q.float(), k.float(), v.float(), empty, empty, context, 128**-0.5)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("num_seqs, extra_blocks",
                         [(1, 4), (4, 4), (16, 4), (17, 4), (40, 4), (120, 4), (1, 160), (17, 160), (120, 160)])
def test_decode_attention_matches_torch_backend(num_seqs, extra_blocks):
    """Up to 16 sequences through the Triton kernel's one-tile splits, more through its 512-key splits and,
    above 384 (sequence, KV head) pairs, its 1,024-key ones; block tables as wide as max_model_len=40960 takes,
    where a sequence's programs take several splits each. The block table is wider than any sequence needs, as
    in a decode graph; a padded row (no keys) gives zeros. The sequences' programs start longest first, as the
    engine orders them."""
    from nanovllm.engine.step_io import longest_first
    from nanovllm.kernels.decode_attention import split_and_tile_keys
    from nanovllm.kernels.flash_attn import cuda_attention
    from nanovllm.utils.context import Context
    assert split_and_tile_keys(16, 8, False, 256) == (64, 64) and split_and_tile_keys(40, 8, False, 256) == (512, 128)
    assert split_and_tile_keys(120, 8, False, 256) == (1024, 128)
    assert split_and_tile_keys(64, 8, True, 128) == (512, 128) and split_and_tile_keys(65, 8, True, 128) == (2048, 128)
    context_lens = ([1, 257, 1000, 4097, 63, 64, 65, 129, 1025, 2049] * 12)[:num_seqs]
    if extra_blocks > 100:  # sequences longer than one round of programs (8,192 keys)
        context_lens = [20000 + 7 * i for i in range(num_seqs)]
    block_tables, slots, num_blocks = paged_batch([n - 1 for n in context_lens], [1] * num_seqs)
    padding = torch.full_like(block_tables[:, :1], -1).expand(-1, extra_blocks)  # past every row's keys
    block_tables = torch.cat([block_tables, padding], dim=1)
    order = torch.from_numpy(longest_first(np.array(context_lens, dtype=np.int32))).cuda()
    context = Context(is_prefill=False, slot_mapping=slots, block_tables=block_tables,
                      context_lens=torch.tensor(context_lens, device="cuda", dtype=torch.int32), seq_order=order)
    assert_matches_float32_torch_backend(*attention_inputs(num_seqs, num_blocks), context)
    q, _, _, k_cache, v_cache = attention_inputs(num_seqs, num_blocks)
    context.context_lens[0] = 0
    out = cuda_attention(q, None, None, k_cache, v_cache, context, 128**-0.5)
    assert not out[0].any() and out.isfinite().all()


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_elementwise_kernels_match_the_pytorch_layers(num_tokens):
    """The residual add with RMSNorm and SiLU-and-multiply in Triton against the CPU path's PyTorch
    functions on CUDA (the same bf16 roundings) and against float64."""
    from nanovllm.kernels.elementwise import residual_rms_norm, silu_and_mul
    from nanovllm.layers import activation, layernorm
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, residual = torch.randn(num_tokens, 1024, **bf16) * 3, torch.randn(num_tokens, 1024, **bf16)
    weight = torch.randn(1024, **bf16)
    out, new_residual = residual_rms_norm(x, residual, weight, 1e-6)
    expected, expected_residual = layernorm.residual_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected)
    alone = residual_rms_norm(x, None, weight, 1e-6)
    torch.testing.assert_close(alone, layernorm.residual_rms_norm(x, None, weight, 1e-6))
    summed = x.double() + residual.double()
    exact = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-2
    gate_up = torch.randn(num_tokens, 2 * 3072, **bf16) * 4
    torch.testing.assert_close(silu_and_mul(gate_up), activation.silu_and_mul(gate_up))
    gate, up = gate_up.double().chunk(2, -1)
    exact = torch.nn.functional.silu(gate) * up
    assert ((silu_and_mul(gate_up).double() - exact).norm() / exact.norm()).item() < 1e-2


def test_engines_one_after_another_give_back_the_gpu(checkpoint):
    """Three engines in turn, with graphs and without, the last released by `del`: each finds the
    same memory free, and the process holds what it held before the first."""
    allocated_before = torch.cuda.memory_allocated()
    num_blocks = []
    for enforce_eager in (False, True, False):
        llm = LLM(checkpoint, **BASE, gpu_memory_utilization=0.5, enforce_eager=enforce_eager)
        num_blocks.append(llm.executor.num_kvcache_blocks)
        assert len(generate(llm, PROMPTS[:2])[0]) == 2
        if enforce_eager:
            llm.exit()
        else:
            del llm
    print(f"\nKV blocks of three engines in turn: {num_blocks}")
    assert max(num_blocks) - min(num_blocks) <= 0.01 * max(num_blocks)
    assert torch.cuda.memory_allocated() == allocated_before


def test_decode_graph_buckets(graph_run):
    assert graph_run["buckets"] == [1, 2, 4, 8, 16, 24]


def test_kv_cache_takes_gpu_memory_utilization(graph_run):
    block_bytes = 2 * 28 * graph_run["block_size"] * 8 * 128 * 2
    assert graph_run["num_blocks"] * block_bytes > 0.3 * torch.cuda.mem_get_info()[1]
    assert graph_run["used_fraction"] < 0.52  # the decode graphs' pool comes on top of the 0.5


def test_prefill_logits_match_float32_reference(graph_run, reference):
    prompts = random_prompts(LOGITS_PROMPT_LENS, seed=2)
    errors = [((logits - ref).norm() / ref.norm()).item()
              for logits, ref in zip(graph_run["logits"], map(reference.logits, prompts))]
    print(f"\nprefill logits, relative error per prompt: {[f'{e:.2e}' for e in errors]}")
    assert max(errors) < 3e-2


def test_greedy_tokens_near_reference_maximum(graph_run, reference):
    deficits = [reference.max_deficit(p, c) for p, c in zip(PROMPTS, graph_run["tokens"])]
    print(f"\ngreedy: largest teacher-forced deficit per sequence: {[f'{d:.3f}' for d in deficits]}")
    assert all(len(c) == 64 for c in graph_run["tokens"])
    assert max(deficits) < TOLERANCE


def test_prefix_cache_hit_gives_same_tokens(graph_run, reference):
    block_size = graph_run["block_size"]
    assert graph_run["prefill_tokens"] == sum(map(len, PROMPTS))
    cached = sum((len(p) - 1) // block_size * block_size for p in PROMPTS)
    assert cached and graph_run["prefill_tokens_hit"] == sum(map(len, PROMPTS)) - cached
    assert_same_greedy(reference, PROMPTS, graph_run["tokens_hit"], graph_run["tokens"], "prefix-cache hit")


def test_graphs_give_same_tokens_as_eager(graph_run, eager_run, reference):
    assert_same_greedy(reference, PROMPTS, graph_run["tokens"], eager_run["tokens"], "graphs vs eager")


def test_decode_batch_off_the_buckets(graph_run, eager_run, reference):
    prompts = PROMPTS[:5]
    assert_same_greedy(reference, prompts, graph_run["tokens_odd"], eager_run["tokens_odd"], "batch of 5, graphs")
    assert max(reference.max_deficit(p, c) for p, c in zip(prompts, graph_run["tokens_odd"])) < TOLERANCE


def test_one_sequence_alone_near_reference_maximum(graph_run, reference):
    prompt, tokens = PROMPTS[0], graph_run["tokens_alone"][0]
    print(f"\none sequence alone: deficit {reference.max_deficit(prompt, tokens):.3f}")
    assert len(tokens) == 64 and reference.max_deficit(prompt, tokens) < TOLERANCE
    assert_same_greedy(reference, [prompt], [tokens], graph_run["tokens"][:1], "one sequence alone vs in a batch")


@pytest.mark.parametrize("n, k, bias", [(4096, 1024, False), (1024, 3072, False), (1030, 1000, True)])
def test_one_row_linear_matches_float64(n, k, bias):
    from nanovllm.kernels.one_row_linear import linear
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    got = linear(x, w, b)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < 1e-2
    batch = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)  # more rows take cuBLAS
    torch.testing.assert_close(linear(batch, w, b), torch.nn.functional.linear(batch, w, b))


@pytest.mark.parametrize("rows", [1, 3])
def test_silu_and_mul_linear_matches_float64_and_the_two_kernels(rows):
    """The down projection on [gate | up]: one kernel for a row, the activation's kernel then cuBLAS for more;
    a row's result equal to the activation's kernel then the one-row matmul, and near float64."""
    from nanovllm.kernels.elementwise import silu_and_mul
    from nanovllm.kernels.one_row_linear import linear, silu_and_mul_linear
    x = torch.randn(rows, 2 * 3072, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) * 3072**-0.5
    gate, up = x.double().chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ w.double().T
    got = silu_and_mul_linear(x, w)
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < 1e-2
    unfused = linear(silu_and_mul(x), w)
    assert torch.equal(got, unfused)


def test_chunked_prefill_gives_same_tokens(checkpoint, graph_run, reference):
    llm = start_engine(checkpoint, max_num_batched_tokens=256, num_kvcache_blocks=64)
    try:
        tokens, _ = generate(llm, PROMPTS)
    finally:
        llm.exit()
    assert_same_greedy(reference, PROMPTS, tokens, graph_run["tokens"], "chunked prefill")


def test_preemption_and_max_model_len(checkpoint, graph_run, reference):
    llm = start_engine(checkpoint, max_model_len=1024, num_kvcache_blocks=6)
    num_preempted = 0
    preempt = llm.scheduler.preempt

    def counting_preempt(seq):
        nonlocal num_preempted
        num_preempted += 1
        preempt(seq)

    llm.scheduler.preempt = counting_preempt
    try:
        tokens, _ = generate(llm, PROMPTS)
        long_prompts = random_prompts([1000, 1024], seed=3)
        long_tokens, _ = generate(llm, long_prompts, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    finally:
        llm.exit()
    assert num_preempted > 0
    assert_same_greedy(reference, PROMPTS, tokens, graph_run["tokens"], "under preemption")
    assert [len(p) + len(c) for p, c in zip(long_prompts, long_tokens)] == [1024, 1025]
    assert reference.max_deficit(long_prompts[0], long_tokens[0]) < TOLERANCE


def test_every_sampling_feature_runs_on_cuda_and_a_seed_repeats(checkpoint):
    """The sampler with every optional input on: filters, seeds, penalties, min_tokens, logprobs."""
    llm = start_engine(checkpoint, num_kvcache_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, seed=1, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.2, logprobs=2, min_tokens=4, max_tokens=16,
                            stop_token_ids=[5])
    try:
        first, second = (llm.generate(PROMPTS[:3], params, use_tqdm=False) for _ in range(2))
    finally:
        llm.exit()
    completions = [c for out in first for c in out.outputs]
    assert [c.token_ids for c in completions] == [c.token_ids for out in second for c in out.outputs]
    assert len({tuple(c.token_ids) for c in completions}) == 9
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids) >= 4
        assert all(c.token_ids[i] in c.logprobs[i] for i in range(len(c.token_ids)))
        assert c.cumulative_logprob < 0 and abs(c.cumulative_logprob) < float("inf")
