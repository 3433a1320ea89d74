"""Bad input raises ValueError naming the problem before any work starts; the engine keeps serving."""

import pytest

from nanovllm import LLM, SamplingParams

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, device="cpu")
OK = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


@pytest.mark.parametrize("prompts, params, message", [
    ([""], OK, "prompt 0 is empty"),
    ([[1, 2], []], OK, "prompt 1 is empty"),
    ([[1] * 257], OK, "prompt 0 has 257 tokens, longer than max_model_len=256"),
    ([[1, 2, 512]], OK, "prompt 0 has token id 512 outside the vocabulary"),
    ([[1, -1]], OK, "token id -1 outside the vocabulary"),
    ([[1], [2]], [OK], "got 1 sampling params for 2 prompts"),
    ([{"prompt_token_ids": 5}], OK, "prompt 0: 'prompt_token_ids' must be a list of token ids, got int"),
    ([{"prompt_token_ids": None}], OK, "'prompt_token_ids' must be a list of token ids, got NoneType"),
    ([{"prompt_token_ids": {1: 2}}], OK, "'prompt_token_ids' must be a list of token ids, got dict"),
    (["ok", "a \ud800 b"], OK, r"prompt 1 holds '\\ud800' at character 2, a lone surrogate"),
    (None, OK, "prompts must be a prompt .* or a list of them, got NoneType"),
    ((p for p in ["a"]), OK, "prompts must be a prompt .* or a list of them, got generator"),
    (["a"], {"temperature": 0}, "sampling_params must be a SamplingParams or a list of them, .* got dict"),
    (["ok"], SamplingParams(bad_words=["x\udfff"]), "a bad word holds '\\\\udfff' at character 1, a lone surrogate"),
])
def test_bad_prompts(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.is_finished()  # nothing was queued
    assert len(llm.generate([[1, 2, 3]], OK, use_tqdm=False)[0]["token_ids"]) == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(max_tokens=0), "max_tokens must be None or >= 1"),
])
def test_bad_sampling_params(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert llm.generate("hello", OK, use_tqdm=False)[0]["token_ids"]


def interrupt_call(llm, monkeypatch, method: str, call_number: int, error: BaseException = KeyboardInterrupt()):
    """Make the executor's call_number-th call of `method` raise `error` instead."""
    real_call, num_calls = getattr(llm.executor, method), 0

    def interrupted(*args):
        nonlocal num_calls
        num_calls += 1
        if num_calls == call_number:
            raise error
        return real_call(*args)

    monkeypatch.setattr(llm.executor, method, interrupted)


def fresh_tokens(tiny_gqa, prompts, params) -> list[list[int]]:
    with LLM(tiny_gqa, **ENGINE_ARGS) as fresh:
        return [out.outputs[0].token_ids for out in fresh.generate(prompts, params, use_tqdm=False)]


# Where a Ctrl-C lands: launching a step (held back until the step is launched, but raised there in
# these tests) or, as it usually does, while waiting for a step's tokens.
@pytest.mark.parametrize("method, call_number", [("execute_model", 1), ("execute_model", 3), ("wait", 2)])
def test_an_interrupted_generate_leaves_the_engine_usable(llm, tiny_gqa, monkeypatch, method, call_number):
    # 40-token prompts fill 2 blocks of 16 each: the first step registers them in the prefix cache.
    prompts = [list(range(100 + i, 140 + i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    interrupt_call(llm, monkeypatch, method, call_number)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert llm.scheduler.is_finished()
    assert llm.scheduler.block_manager.num_free_blocks == ENGINE_ARGS["num_kvcache_blocks"]
    llm.scheduler.block_manager.check_integrity()
    # Blocks of a step that never ran are not served from the cache: the tokens match a fresh engine's.
    again = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert again == fresh_tokens(tiny_gqa, prompts, params)
    llm.reset_prefix_cache()


def test_a_step_that_fails_to_launch_aborts_its_requests_and_spares_the_rest(llm, tiny_gqa, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.add_request("a", [1, 2, 3], params)
    llm.step()
    llm.step()  # "a" is decoding, with a token in flight
    interrupt_call(llm, monkeypatch, "execute_model", 1, RuntimeError("injected launch failure"))
    llm.add_request("b", [4, 5, 6], params)
    with pytest.raises(RuntimeError, match="injected launch failure"):
        llm.step()
    monkeypatch.undo()
    assert not llm.requests  # both were in the failed step
    while llm.has_unfinished_requests():
        llm.step()  # the step in flight is processed; its tokens go to no one
    assert llm.scheduler.is_finished()
    llm.scheduler.block_manager.check_integrity()
    prompts = [[1, 2, 3], [4, 5, 6]]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == \
        fresh_tokens(tiny_gqa, prompts, params)


@pytest.mark.parametrize("top_k", [512, 513, 10**30])  # the tiny model's vocabulary holds 512 tokens
def test_a_top_k_that_keeps_the_whole_vocabulary_samples_as_no_top_k(llm, top_k):
    """vLLM keeps every token under a top_k at or past the vocabulary's size: the same draws as top_k off."""
    def draw(k):
        params = SamplingParams(temperature=1.0, top_k=k, seed=7, max_tokens=8, ignore_eos=True)
        return llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]["token_ids"]
    assert draw(top_k) == draw(0)


@pytest.mark.parametrize("messages", [None, "hello", {"role": "user", "content": "hi"}])
def test_chat_takes_conversations_only(llm, messages):
    with pytest.raises(ValueError, match="messages must be a conversation .* or a list of them"):
        llm.chat(messages, OK, use_tqdm=False)


def test_a_lone_surrogate_fails_its_own_prompt_in_chat_and_as_completed(llm):
    """A text the tokenizer cannot take is that prompt's ValueError, not a TypeError from inside the tokenizer."""
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.chat([{"role": "user", "content": "\udcff"}], OK, use_tqdm=False)
    results = dict(llm.generate_as_completed(["hello", "\ud800", "world"], OK))
    assert isinstance(results[1], ValueError) and "lone surrogate" in str(results[1])
    assert [len(results[i].outputs[0].token_ids) for i in (0, 2)] == [4, 4]
    assert not llm.requests and llm.scheduler.is_finished()


def test_an_interrupt_while_queueing_as_completed_leaves_nothing_queued(llm, monkeypatch):
    real, calls = llm.input_processor.make_request, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.input_processor, "make_request", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(llm.generate_as_completed(["a", "b", "c", "d"], OK))
    assert not llm.requests and llm.scheduler.is_finished()
