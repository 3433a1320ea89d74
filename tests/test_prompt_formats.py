"""vLLM's prompt formats: texts, token ids, {"prompt": text} and {"prompt_token_ids": [...]}, alone or mixed."""
import pytest

from nanovllm import LLM, SamplingParams

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


def test_a_prompt_dict_is_one_prompt_of_that_text(llm):
    want = llm.generate("hello world", GREEDY, use_tqdm=False)[0]
    got = llm.generate({"prompt": "hello world"}, GREEDY, use_tqdm=False)
    assert len(got) == 1
    assert got[0].prompt == "hello world"
    assert got[0].prompt_token_ids == llm.tokenizer.encode("hello world")
    assert got[0].outputs[0].token_ids == want.outputs[0].token_ids


def test_lists_of_prompt_dicts_mixed_with_texts_and_token_ids(llm):
    ids = llm.tokenizer.encode("the quick brown fox")
    prompts = [{"prompt": "hello world"}, {"prompt_token_ids": ids}, "hello world", ids,
               {"prompt_token_ids": ids, "prompt": "the quick brown fox"}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello world", None, "hello world", None, "the quick brown fox"]
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode("hello world"), ids] * 2 + [ids]
    completions = [o.outputs[0].token_ids for o in outs]
    assert completions[0] == completions[2] and completions[1] == completions[3] == completions[4]


def test_a_single_token_ids_dict(llm):
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt_token_ids == [5, 6, 7]
    assert out[0].outputs[0].token_ids == llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("prompts, message", [
    ({"text": "hi"}, r"prompt 0 is a dict with keys \['text'\]: expected 'prompt'"),
    (["ok", {"prompt": "x", "multi_modal_data": {}}], "prompt 1 is a dict with keys"),
    ([{"prompt": 5}], "prompt 0: 'prompt' must be a text, got int"),
    ([3.5], "prompt 0 is a float: expected a text, a list of token ids, or a dict"),
    (["ok", None], "prompt 1 is a NoneType"),
    ([[1, "a"]], "prompt 0 is a list"),
])
def test_other_prompt_types_are_refused_by_name(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.scheduler.is_finished()
