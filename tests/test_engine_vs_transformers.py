"""Greedy decoding through the whole engine against transformers' Qwen3 in float32 on the same weights."""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler

from conftest import assert_greedy_matches_transformers, mixed_prompts, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
SMALL_BLOCKS = dict(kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=512, dtype="float32",
                    device="cpu")


@pytest.fixture
def spy(monkeypatch):
    """Counts prefix-cache hits (tokens) and preemptions while an engine runs."""
    counts = {"cache_hit_tokens": 0, "preempted": 0}
    allocate, preempt = BlockManager.allocate, Scheduler.preempt

    def counting_allocate(self, seq):
        allocate(self, seq)
        counts["cache_hit_tokens"] += seq.num_computed_tokens

    def counting_preempt(self, seq):
        counts["preempted"] += 1
        preempt(self, seq)

    monkeypatch.setattr(BlockManager, "allocate", counting_allocate)
    monkeypatch.setattr(Scheduler, "preempt", counting_preempt)
    return counts


def generate(path, prompts, **engine_args) -> list[list[int]]:
    with LLM(path, **{**SMALL_BLOCKS, **engine_args}) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [out["token_ids"] for out in outputs]


@pytest.mark.parametrize("checkpoint", ["tiny_gqa", "tiny_mha"])
def test_greedy_matches_transformers_with_prefix_hits(request, checkpoint, spy, hf_model_cache):
    path = request.getfixturevalue(checkpoint)
    prompts = mixed_prompts()
    completions = generate(path, prompts)
    assert all(len(c) == GREEDY.max_tokens for c in completions)
    # Prompt 8 shares 12 blocks with prompt 7; the block-aligned prompts 9 and 10 are cached whole
    # but their last block, which holds the token to be recomputed.
    assert spy["cache_hit_tokens"] >= 12 * 16 + 2 * 48
    assert completions[9] == completions[10]
    assert_greedy_matches_transformers(hf_model_cache, path, prompts, completions)


def test_chunked_prefill(tiny_gqa, spy, hf_model_cache):
    prompts = mixed_prompts()
    completions = generate(tiny_gqa, prompts, max_num_batched_tokens=40)
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, prompts, completions)


def test_prompt_steps_padded_as_on_cuda(tiny_gqa, hf_model_cache, monkeypatch):
    """Prompt steps padded to a multiple of 7 tokens with a sequence of zeros (`padded_to_multiple`, which engines
    on CUDA take), through prefix hits and chunks: still transformers' tokens."""
    from nanovllm.engine import input_builder, llm_engine
    padded, pad = [], input_builder.padded_to_multiple

    def noting_pad(prefill, multiple):
        result = pad(prefill, multiple)
        padded.append(prefill.num_paged_seqs > 0 and len(result.token_ids) > len(prefill.token_ids))
        return result

    monkeypatch.setattr(llm_engine, "prompt_tokens_multiple", lambda config: 7)
    monkeypatch.setattr(input_builder, "padded_to_multiple", noting_pad)
    prompts = mixed_prompts()
    completions = generate(tiny_gqa, prompts, max_num_batched_tokens=40)
    assert any(padded), "no step beside a cached chunk was padded"
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, prompts, completions)


def test_preemption(tiny_gqa, spy, hf_model_cache):
    prompts = mixed_prompts()
    completions = generate(tiny_gqa, prompts, num_kvcache_blocks=32)
    assert spy["preempted"] > 0
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, prompts, completions)


def test_prefix_caching_off(tiny_mha, spy, hf_model_cache):
    prompts = mixed_prompts()
    completions = generate(tiny_mha, prompts, enable_prefix_caching=False)
    assert spy["cache_hit_tokens"] == 0
    assert_greedy_matches_transformers(hf_model_cache, tiny_mha, prompts, completions)


def test_a_later_identical_prompt_hits_the_cache(tiny_gqa, spy, hf_model_cache):
    prompts = mixed_prompts()[:8]
    with LLM(tiny_gqa, **SMALL_BLOCKS) as llm:
        first = [out["token_ids"] for out in llm.generate(prompts, GREEDY, use_tqdm=False)]
        hits_after_first = spy["cache_hit_tokens"]
        second = [out["token_ids"] for out in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert second == first
    # Every full block but the one holding each prompt's last token is reused.
    assert spy["cache_hit_tokens"] - hits_after_first == sum((len(p) - 1) // 16 * 16 for p in prompts)


def test_string_prompts_eos_and_text(tiny_gqa):
    with LLM(tiny_gqa, **SMALL_BLOCKS) as llm:
        out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
        # The whole decode, but for an unfinished last character, which vLLM leaves out too.
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True).rstrip("\ufffd")
        eos = llm.eos_token_ids
        assert not any(t in eos for t in out["token_ids"][:-1])  # generation stops at the first EOS
        assert len(out["token_ids"]) == 20 or out["token_ids"][-1] in eos


def test_sampling_at_temperature_runs(tiny_gqa):
    with LLM(tiny_gqa, **SMALL_BLOCKS) as llm:
        outs = llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    assert all(len(o["token_ids"]) == 16 for o in outs)
    assert len({tuple(o["token_ids"]) for o in outs}) > 1  # random draws differ


def test_a_prompt_that_hits_blocks_computed_in_the_same_step(tiny_gqa, hf_model_cache):
    """The second prompt is the first's first 16 tokens plus one: admitted in the same step, it reuses
    the block the first fills in that step, and computes only its last token."""
    first = random_prompts([40], seed=11)[0]
    prompts = [first, first[:17], first[:33]]
    completions = generate(tiny_gqa, prompts)
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, prompts, completions)


def test_a_lone_prompt_longer_than_the_token_budget(tiny_gqa, hf_model_cache):
    """Its first chunks' steps sample nothing."""
    prompts = random_prompts([200], seed=12)
    completions = generate(tiny_gqa, prompts, max_num_batched_tokens=64)
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, prompts, completions)
