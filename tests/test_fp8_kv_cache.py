"""The FP8 KV cache (`kv_cache_dtype="fp8"`) on a CPU: its format against e4m3's published bounds (3 mantissa bits:
a normal value rounds within 2^-4 of itself, a subnormal within 2^-10 of the scale; 448 the largest), and an
engine that keeps its cache so against transformers' float32, through prefix hits, chunks and two ranks."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.fp8_kv import FP8_KV, dequantize_kv, quantize_kv

from conftest import fp8_value_group, mixed_prompts, reference_logits

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=512, dtype="float32", device="cpu",
                   kv_cache_dtype="fp8")
# Teacher-forced: how far below transformers' best logit a chosen token may lie. The keys' and values' e4m3
# rounding moves a tiny random model's logits by up to about 0.08 here; near-ties under this margin may flip.
FP8_KV_MARGIN = 0.15


def test_each_head_is_scaled_to_e4m3s_range_and_rounds_within_its_bounds():
    torch.manual_seed(0)
    x = torch.randn(50, 4, 64, dtype=torch.float64) * torch.logspace(-3, 3, 4, dtype=torch.float64)[:, None]
    x[7, 2] = 0  # a head of zeros
    quantized, scales = quantize_kv(x)
    assert quantized.dtype == FP8_KV and scales.dtype == torch.float32 and scales.shape == (50, 4)
    amax = x.abs().amax(-1)
    nonzero = amax > 0
    assert torch.allclose(scales.double()[nonzero], amax[nonzero] / 448, rtol=1e-6)
    e4m3 = quantized.double()
    assert (e4m3.abs().amax(-1)[nonzero] == 448).all()  # the head's largest value takes e4m3's largest
    bound = torch.maximum(x.abs() / scales.double()[..., None] * 2**-4, torch.tensor(2.0**-10))
    assert (e4m3 - x / scales.double()[..., None]).abs().le(bound * (1 + 1e-6)).all()
    back = dequantize_kv(quantized, scales, torch.float64)
    assert torch.equal(back[7, 2], torch.zeros(64, dtype=torch.float64))
    assert ((back - x).abs() <= bound * scales.double()[..., None] * (1 + 1e-6)).all()


@pytest.mark.parametrize("block_size", [16, 48, 96, 128])
def test_the_cpu_store_lays_the_cache_out_as_documented(block_size):
    """Keys [block, slot, kv head, dim], values [block, kv head, slot // group, dim, slot % group] in groups of 64
    slots (32 or 16 where 64 does not divide the block), scales [block, kv head, slot] (`utils/fp8_kv.py`): each
    head over its largest magnitude / 448, rounded to e4m3 as torch rounds; slot -1 and the slots not written keep
    their zeros."""
    from nanovllm.layers.attention_torch import store_kvcache
    torch.manual_seed(0)
    k, v = torch.randn(2, 5, 2, 8)  # 5 tokens, 2 KV heads of 8 dims
    slots = torch.tensor([3, -1, block_size, 2 * block_size - 1, 33 % block_size])
    group = fp8_value_group(block_size)
    k_cache = torch.zeros(2, block_size, 2, 8, dtype=FP8_KV)
    v_cache = torch.zeros(2, 2, block_size // group, 8, group, dtype=FP8_KV)
    k_scales, v_scales = torch.zeros(2, 2, block_size), torch.zeros(2, 2, block_size)
    store_kvcache(k, v, k_cache, v_cache, slots, (k_scales, v_scales))
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, within = divmod(slot, block_size)
            stored_value = v_cache[block, :, within // group, :, within % group]
            for x, stored, scale in ((k, k_cache[block, within], k_scales[block, :, within]),
                                     (v, stored_value, v_scales[block, :, within])):
                assert torch.allclose(scale, x[token].abs().amax(-1) / 448)
                assert torch.equal(stored.float(), (x[token] / scale[:, None]).to(FP8_KV).float())
    assert k_scales.count_nonzero() == v_scales.count_nonzero() == 4 * 2
    assert k_cache.float().count_nonzero() == v_cache.float().count_nonzero() == 4 * 2 * 8


def fp8_greedy(path, prompts, **engine_args) -> list[list[int]]:
    with LLM(path, **{**ENGINE_ARGS, **engine_args}) as llm:
        if llm.config.tensor_parallel_size == 1:  # the ranks' caches are in their processes
            from nanovllm.layers.attention import Attention
            layers = [m for m in llm.executor.model_runner.model.modules() if isinstance(m, Attention)]
            blocks, block_size, kv_heads, head_dim = layers[0].k_cache.shape  # laid out as `utils/fp8_kv.py` says
            group = fp8_value_group(block_size)
            assert all(layer.k_cache.dtype == layer.v_cache.dtype == FP8_KV
                       and layer.v_cache.shape == (blocks, kv_heads, block_size // group, head_dim, group)
                       and all(s.dtype == torch.float32 and s.shape == (blocks, kv_heads, block_size)
                               for s in layer.kv_scales) for layer in layers)
        completions = [out["token_ids"] for out in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.scheduler.num_preemptions > 0 or "num_kvcache_blocks" not in engine_args
    return completions


@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_batched_tokens=40), dict(num_kvcache_blocks=32),
                                         dict(tensor_parallel_size=2)],
                         ids=["prefix-hits", "chunked", "preempted", "two-ranks"])
def test_greedy_tokens_within_the_margin_of_transformers(tiny_gqa, hf_model_cache, engine_args):
    prompts = mixed_prompts()
    completions = fp8_greedy(tiny_gqa, prompts, **engine_args)
    worst = 0.0
    for prompt, completion in zip(prompts, completions):
        logits = reference_logits(hf_model_cache, tiny_gqa, prompt, completion)
        chosen = logits[torch.arange(len(completion)), torch.tensor(completion)]
        worst = max(worst, (logits.max(-1).values - chosen).max().item())
    assert worst < FP8_KV_MARGIN, f"a chosen token {worst:.3f} below transformers' best"


def test_the_same_memory_holds_about_twice_the_tokens(tiny_gqa):
    """A block of 16 tokens, 2 layers, 2 KV heads of 16 dims: K and V at 16 bytes and a 4-byte scale a head in
    e4m3, 32 bytes in bfloat16."""
    from nanovllm.engine.config_builder import build_config
    from nanovllm.engine.kv_cache import block_bytes
    fp8 = build_config(tiny_gqa, device="cpu", kvcache_block_size=16, kv_cache_dtype="fp8", dtype="bfloat16")
    bf16 = build_config(tiny_gqa, device="cpu", kvcache_block_size=16, dtype="bfloat16")
    assert block_bytes(fp8) == 2 * 2 * 16 * 2 * (16 + 4) and block_bytes(bf16) == 2 * 2 * 16 * 2 * 32


def test_other_cache_dtypes_are_refused_by_name(tiny_gqa):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' is not supported; supported: auto, fp8"):
        LLM(tiny_gqa, device="cpu", kv_cache_dtype="fp8_e5m2")
