"""What a vLLM user's script touches beyond generate(): the LLM's methods, SamplingParams' fields and
checks, the outputs' fields, chat options, and LLMEngine's step loop; against vLLM's documented
behaviour and, for the numbers, transformers' float32 logits."""
import copy
import gc
import json
import shutil
import weakref

import pytest
import torch

from nanovllm import LLM, CompletionOutput, LLMEngine, RequestOutput, RequestOutputKind, SamplingParams

from conftest import reference_logits

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=256, dtype="float32", device="cpu")
PROMPT = [7, 300, 12, 99, 4, 18]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


def greedy(llm, prompt=PROMPT, **kwargs) -> RequestOutput:
    return llm.generate([prompt], SamplingParams(**{**GREEDY, "max_tokens": 8, **kwargs}), use_tqdm=False)[0]


# --- the LLM's methods ---

def test_outputs_are_importable_and_methods_exist(llm):
    out = greedy(llm)
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    assert out.outputs[0].finished() and out.finished
    assert llm.llm_engine is llm and isinstance(llm.llm_engine, LLMEngine)
    assert llm.get_tokenizer() is llm.tokenizer


def test_reset_prefix_cache(llm):
    prompt = list(range(100, 140))  # two full blocks of 16
    greedy(llm, prompt)
    assert greedy(llm, prompt).num_cached_tokens == 32
    assert llm.reset_prefix_cache()
    assert greedy(llm, prompt).num_cached_tokens == 0


def test_generation_config_gives_the_default_sampling_params(tiny_gqa, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_gqa, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.0, top_p=0.7, top_k=20, repetition_penalty=1.3, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(config))
    with LLM(str(model), **ENGINE_ARGS) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == \
            (0.0, 0.7, 20, 1.3)
        # generate() without sampling params uses them: greedy with the repetition penalty.
        out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids
        want = llm.generate([PROMPT], SamplingParams(temperature=0, top_p=0.7, top_k=20, repetition_penalty=1.3),
                            use_tqdm=False)[0].outputs[0].token_ids
        assert out == want


# --- SamplingParams ---

@pytest.mark.parametrize("kwargs, message", [
    (dict(n=2.0), "n must be an integer, got 2.0"),
    (dict(logprobs=True), "logprobs must be an integer, got True"),
    (dict(temperature="hot"), "temperature must be a number, got 'hot'"),
    (dict(ignore_eos=1), "ignore_eos must be True or False, got 1"),
    (dict(stop=5), "stop must be a text or a list of texts, got 5"),
    (dict(max_tokens=0), "max_tokens must be None or >= 1"),
    (dict(prompt_logprobs=-2), r"prompt_logprobs must be None, -1 \(every token\) or >= 0"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be None, -1 or >= 1"),
    (dict(logit_bias={"a": 1}), "logit_bias must map token ids to numbers"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(bad_words=[""]), "bad_words must hold non-empty strings"),
    (dict(stop=["x"], detokenize=False), "stop strings need the text"),
    (dict(logit_bias={5: float("nan")}), "logit_bias must hold finite values .* got nan for token 5"),
    (dict(logit_bias={5: 1.0, 6: -float("inf")}), "logit_bias must hold finite values .* got -inf for token 6"),
    (dict(logit_bias={5: 1e300}), "logit_bias must hold finite values"),  # infinite in float32
    (dict(temperature=float("inf")), "temperature must be a finite number, got inf"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number, got inf"),
    (dict(temperature=10**400), "temperature must be a finite number, got 1000"),  # past a float's range
    (dict(logit_bias={5: -10**400}), "logit_bias must hold finite values .* for token 5"),
])
def test_bad_sampling_values_are_refused_at_once(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [5e-3, 1e-30, 1e-50])
def test_a_temperature_below_001_is_taken_as_001_as_in_vllm(temperature):
    """vLLM's _MAX_TEMP: a positive temperature below 0.01 would scale the logits past float32's range (1e-50 is 0
    in float32), so it becomes 0.01, with a warning."""
    with pytest.warns(UserWarning, match=f"temperature {temperature} is below 0.01"):
        assert SamplingParams(temperature=temperature).temperature == 0.01
    assert SamplingParams(temperature=0.01).temperature == 0.01 and SamplingParams(temperature=0).temperature == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(logprobs=513), "logprobs=513 exceeds the vocabulary's 512 tokens"),
    (dict(prompt_logprobs=600), "prompt_logprobs=600 exceeds the vocabulary's 512 tokens"),
    (dict(allowed_token_ids=[3, 512]), "allowed_token_ids has token id 512 outside the vocabulary"),
    (dict(logit_bias={900: 1.0}), "logit_bias has token id 900 outside the vocabulary"),
    (dict(stop_token_ids=[512]), "stop_token_ids has token id 512 outside the vocabulary"),
    (dict(bad_words=[" ".join(["many numbers"] * 8)]), "bad_words has a word of 16 tokens; at most 8"),
    (dict(bad_words=[f"word{i} x" for i in range(40)]), "bad_words spell .* words of two or more tokens"),
])
def test_values_beyond_the_vocabulary_are_refused_before_any_work(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, [1, 2]], [SamplingParams(), SamplingParams(**kwargs)], use_tqdm=False)
    assert llm.scheduler.is_finished()


def test_clone_is_a_deep_copy():
    params = SamplingParams(stop=["a"], logit_bias={3: 1.0})
    clone = params.clone()
    clone.stop.append("b")
    clone.logit_bias[4] = 2.0
    assert params.stop == ["a"] and params.logit_bias == {3: 1.0} and clone == copy.deepcopy(clone)


def test_max_tokens_none_fills_max_model_len(llm):
    out = greedy(llm, max_tokens=None)
    assert len(out.outputs[0].token_ids) == 256 - len(PROMPT) and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="fills max_model_len=256: max_tokens=None leaves no room"):
        greedy(llm, [1] * 256, max_tokens=None)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    out = greedy(llm, list(range(10, 40)), truncate_prompt_tokens=5)
    assert out.prompt_token_ids == list(range(35, 40))
    assert out.outputs[0].token_ids == greedy(llm, list(range(35, 40))).outputs[0].token_ids


def test_detokenize_false_leaves_the_text_empty(llm):
    out = greedy(llm, detokenize=False)
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 8


def test_logit_bias_and_allowed_token_ids_against_transformers(llm, tiny_gqa, hf_model_cache):
    forced = greedy(llm, logit_bias={42: 100.0}).outputs[0].token_ids
    assert forced == [42] * 8
    allowed = [5, 77, 300, 301, 499]
    tokens = greedy(llm, allowed_token_ids=allowed).outputs[0].token_ids
    logits = reference_logits(hf_model_cache, tiny_gqa, PROMPT, tokens)
    for pos, token in enumerate(tokens):  # the best of the allowed tokens, by transformers' logits
        assert token == allowed[logits[pos, allowed].argmax().item()]


def test_bad_words_are_never_generated(llm):
    prompt = llm.tokenizer.encode("the quick brown")
    free = greedy(llm, prompt, max_tokens=12).outputs[0].token_ids
    many, numbers = (llm.tokenizer.encode(word, add_special_tokens=False) for word in ("many", " numbers"))
    assert len(many) == len(numbers) == 1 and [many[0], numbers[0]] in [free[i:i + 2] for i in range(11)]
    one_token = greedy(llm, prompt, max_tokens=12, bad_words=["many"]).outputs[0].token_ids
    assert many[0] not in one_token
    two_tokens = greedy(llm, prompt, max_tokens=12, bad_words=["many numbers"]).outputs[0].token_ids
    assert many[0] in two_tokens and [many[0], numbers[0]] not in [two_tokens[i:i + 2] for i in range(11)]


def test_prompt_logprobs_match_transformers(llm, tiny_gqa, hf_model_cache):
    prompt = list(range(100, 120))
    greedy(llm, prompt)  # the prefix cache holds its first block now: prompt_logprobs must not use it
    out = greedy(llm, prompt, prompt_logprobs=2, max_tokens=1)
    assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    logits = reference_logits(hf_model_cache, tiny_gqa, prompt[:1], prompt[1:])  # scoring prompt[1:]
    reference = torch.log_softmax(logits.double(), dim=-1)
    for position in range(1, len(prompt)):
        row, token = reference[position - 1], prompt[position]
        logprobs = out.prompt_logprobs[position]
        assert abs(logprobs[token].logprob - row[token].item()) < 1e-4
        assert logprobs[token].rank == 1 + (row > row[token]).sum().item()
        for rank, top in enumerate(row.topk(2).indices.tolist(), start=1):
            assert logprobs[top].rank == rank
    assert greedy(llm, prompt).prompt_logprobs is None


def test_a_request_aborted_while_its_prompt_is_scored_leaves_the_engine_usable(tiny_gqa):
    """Its scored positions are still on the device when it is aborted; processing them drops them."""
    with LLM(tiny_gqa, **{**ENGINE_ARGS, "max_num_batched_tokens": 32}) as engine:
        engine.add_request("scored", list(range(100, 200)), SamplingParams(prompt_logprobs=1, max_tokens=4))
        assert engine.step() == []  # its first chunk is launched, not yet processed
        engine.abort_request("scored")
        while engine.has_unfinished_requests():
            assert engine.step() == []
        assert greedy(engine).outputs[0].token_ids == greedy(engine).outputs[0].token_ids


def test_metrics_follow_the_request(llm):
    metrics = greedy(llm).metrics
    times = [metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time,
             metrics.last_token_time, metrics.finished_time]
    assert None not in times and times == sorted(times)


# --- chat ---

def test_chat_content_parts_and_options(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "hello\nworld"}]
    assert llm.chat(parts, params, use_tqdm=False)[0].prompt == llm.chat(joined, params, use_tqdm=False)[0].prompt
    with pytest.raises(ValueError, match="a content part of type 'image_url': this engine serves text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if tools %}tools: {{ tools | map(attribute='name') | join(',') }}\n{% endif %}")
    out = llm.chat(joined, params, use_tqdm=False, chat_template=template, add_generation_prompt=False,
                   tools=[{"name": "search"}, {"name": "calc"}])[0]
    assert out.prompt == "[user] hello\nworld\ntools: search,calc\n"
    continued = llm.chat(joined + [{"role": "assistant", "content": "the answer is"}], params, use_tqdm=False,
                         add_generation_prompt=False, continue_final_message=True)[0]
    assert continued.prompt.endswith("<|im_start|>assistant\nthe answer is")
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(joined, params, continue_final_message=True)


# --- the step loop ---

def test_the_step_loop_with_every_output_kind(llm):
    kinds = {"cumulative": RequestOutputKind.CUMULATIVE, "delta": RequestOutputKind.DELTA,
             "final": RequestOutputKind.FINAL_ONLY}
    for request_id, kind in kinds.items():
        llm.add_request(request_id, PROMPT, SamplingParams(**GREEDY, max_tokens=5, output_kind=kind))
    llm.add_request("aborted", {"prompt": "hello"}, SamplingParams(**GREEDY, max_tokens=50))
    with pytest.raises(ValueError, match="request id 'delta' is already queued"):
        llm.add_request("delta", PROMPT)
    seen = {request_id: [] for request_id in [*kinds, "aborted"]}
    steps = 0
    while llm.has_unfinished_requests():
        for output in llm.step():
            seen[output.request_id].append(output)
        steps += 1
        if steps == 2:
            llm.abort_request("aborted")
    want = greedy(llm, max_tokens=5).outputs[0].token_ids
    assert [len(o.outputs[0].token_ids) for o in seen["cumulative"]] == [1, 2, 3, 4, 5]
    assert seen["cumulative"][-1].outputs[0].token_ids == want and seen["cumulative"][-1].finished
    assert sum((o.outputs[0].token_ids for o in seen["delta"]), []) == want
    assert "".join(o.outputs[0].text for o in seen["delta"]) == seen["cumulative"][-1].outputs[0].text
    assert len(seen["final"]) == 1 and seen["final"][0].outputs[0].token_ids == want
    assert len(seen["aborted"]) <= 2 and not any(o.finished for o in seen["aborted"])
    assert llm.get_num_unfinished_requests() == 0 and llm.scheduler.is_finished()


def test_engines_live_side_by_side_and_del_frees_one(tiny_gqa):
    first = LLM(tiny_gqa, **ENGINE_ARGS)
    second = LLM(tiny_gqa, **ENGINE_ARGS)  # re-running a notebook cell: the first is still alive
    assert greedy(first).outputs[0].token_ids == greedy(second).outputs[0].token_ids
    executor, alive = first.executor, weakref.ref(first)
    del first
    gc.collect()
    assert alive() is None and executor.model_runner is None  # its engine was stopped
    assert greedy(second).outputs[0].token_ids
    second.exit()


def test_an_engine_keeps_its_own_numbering_and_leaves_torchs_random_state_alone(tiny_gqa):
    """Request ids count from "0" in each engine (vLLM's LLM), and starting an engine neither reseeds nor
    draws from the caller's torch generator: its sampling has a generator of its own."""
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    with LLM(tiny_gqa, **ENGINE_ARGS) as first, LLM(tiny_gqa, **ENGINE_ARGS) as second:
        assert torch.equal(torch.rand(3), want)
        assert [greedy(engine).request_id for engine in (first, second, first)] == ["0", "0", "1"]


def unseeded_samples(path, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # no seed of its own
    with LLM(path, **{**ENGINE_ARGS, **kwargs}) as llm:
        return [out.outputs[0].token_ids for out in llm.generate([PROMPT] * 4, params, use_tqdm=False)]


def test_the_engine_seed_makes_unseeded_sampling_repeat(tiny_gqa):
    """As a script run twice: a new engine each time, with vLLM's default seed 0, then another seed."""
    first, again = unseeded_samples(tiny_gqa), unseeded_samples(tiny_gqa)
    assert first == again and len({tuple(s) for s in first}) > 1  # the same draws; the four rows differ
    assert unseeded_samples(tiny_gqa, seed=1) != first


def stream(llm, prompt, kind: RequestOutputKind, **kwargs) -> list[RequestOutput]:
    llm.add_request("streamed", prompt, SamplingParams(**GREEDY, max_tokens=24, output_kind=kind, **kwargs))
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    return outputs


def test_streamed_text_never_shows_what_a_stop_string_will_cut(llm):
    prompt = llm.tokenizer.encode("the quick brown")
    full = greedy(llm, prompt, max_tokens=24).outputs[0].text
    stop = full[8:20]  # spans several tokens; its start appears in the text before the match completes
    final = greedy(llm, prompt, max_tokens=24, stop=[stop]).outputs[0].text
    assert final == full[:full.find(stop)]
    cumulative = [out.outputs[0].text for out in stream(llm, prompt, RequestOutputKind.CUMULATIVE, stop=[stop])]
    assert all(final.startswith(text) for text in cumulative) and cumulative[-1] == final
    delta = [out.outputs[0].text for out in stream(llm, prompt, RequestOutputKind.DELTA, stop=[stop])]
    assert "".join(delta) == final


def test_stopping_early_leaves_no_request_queued(llm):
    results = llm.generate_as_completed([[1, 2, 3], [], [4, 5]], SamplingParams(**GREEDY, max_tokens=4))
    assert isinstance(next(results)[1], ValueError)
    results.close()  # as `break` does
    assert not llm.requests and llm.scheduler.is_finished()


def test_request_ids_are_texts(llm):
    llm.add_request(5, PROMPT, SamplingParams(**GREEDY, max_tokens=4))
    with pytest.raises(ValueError, match="request id '5' is already queued"):
        llm.add_request("5", PROMPT)
    llm.abort_request([5])
    assert not llm.requests and not llm.scheduler.waiting
    while llm.has_unfinished_requests():
        llm.step()
