"""Stop conditions, finish reasons, the RequestOutput fields, chat, and SamplingParams validation."""
import pytest
import torch

from nanovllm import LLM, SamplingParams

from conftest import reference_logits

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=256, dtype="float32", device="cpu")
PROMPT = [7, 300, 12, 99, 4, 18]


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


def greedy(llm, prompt=PROMPT, **kwargs):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 24, "ignore_eos": True, **kwargs})
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_request_output_fields(llm):
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt == "hello world"
    assert out.prompt_token_ids == llm.tokenizer.encode("hello world")
    assert out.finished and out.num_cached_tokens == 0
    completion = out.outputs[0]
    assert (completion.index, completion.finish_reason, completion.stop_reason) == (0, "length", None)
    assert completion.cumulative_logprob is None and completion.logprobs is None
    assert out["text"] == completion.text and out["token_ids"] == completion.token_ids
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert llm.generate([PROMPT], use_tqdm=False)[0].prompt is None


def seeded(llm, seed, **kwargs):
    params = SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 24, "ignore_eos": True, **kwargs})
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def spanning_stop_string(llm) -> tuple[int, str]:
    """A seed and a stop string running from the last character of completion token 4 to the first
    of token 7, found once, first, in the seeded completion's text, whose first 8 tokens decode to
    whole characters (text ending in part of one is held back until the character is whole)."""
    for seed in range(50):
        full = seeded(llm, seed)
        pieces = [llm.tokenizer.decode(full.token_ids[:i]) for i in range(9)]
        grows = all(len(pieces[i]) < len(pieces[i + 1]) for i in range(3, 8))
        if not grows or "\ufffd" in pieces[8] or not all(full.text.startswith(p) for p in pieces):
            continue  # a token split a multi-byte character: offsets are not stable
        start, end = len(pieces[5]) - 1, len(pieces[7]) + 1
        if full.text.find(full.text[start:end]) == start:
            return seed, full.text[start:end]
    raise AssertionError("no completion gave a clean stop string")


def test_stop_string_spanning_tokens(llm):
    seed, stop = spanning_stop_string(llm)
    full = seeded(llm, seed)
    start = full.text.find(stop)
    cut = seeded(llm, seed, stop=[stop, "never appears"])
    assert cut.text == full.text[:start]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == full.token_ids[:8]  # ends with the token that completed the match
    kept = seeded(llm, seed, stop=stop, include_stop_str_in_output=True)
    assert kept.text == full.text[:start + len(stop)]


def test_a_stop_string_outranks_the_length_limit_and_waits_for_min_tokens(llm):
    """The scheduler ends the 8th token on max_tokens=8, the output processor on the string it completes:
    the string wins, as in vLLM. With min_tokens=8 the 8th token may not end the completion."""
    seed, stop = spanning_stop_string(llm)
    full = seeded(llm, seed)
    at_limit = seeded(llm, seed, stop=[stop], max_tokens=8)
    assert (at_limit.finish_reason, at_limit.stop_reason) == ("stop", stop)
    assert at_limit.text == full.text[:full.text.find(stop)] and at_limit.token_ids == full.token_ids[:8]
    held = seeded(llm, seed, stop=[stop], min_tokens=8)
    assert len(held.token_ids) > 8 and held.token_ids[:8] == full.token_ids[:8]


def test_stop_token_ids_and_min_tokens(llm, tiny_gqa, hf_model_cache):
    full = greedy(llm).outputs[0].token_ids
    stop_id = full[4]
    first = full.index(stop_id)
    stopped = greedy(llm, stop_token_ids=[stop_id]).outputs[0]
    assert stopped.token_ids == full[:first + 1]  # the stop id stays in the completion
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_id)
    # min_tokens forbids the stop id (and EOS) for the first 8 tokens: greedy then takes the runner-up.
    held = greedy(llm, stop_token_ids=[stop_id], min_tokens=8, max_tokens=12).outputs[0]
    assert stop_id not in held.token_ids[:8]
    logits = reference_logits(hf_model_cache, tiny_gqa, PROMPT, held.token_ids)
    for pos, token in enumerate(held.token_ids):
        row = logits[pos].clone()
        if pos < 8:
            row[[stop_id, *llm.eos_token_ids]] = -torch.inf
        assert row.max() - row[token] < 1e-4, f"position {pos}"


def test_eos_finishes_with_stop_and_no_reason(llm):
    full = greedy(llm).outputs[0].token_ids
    eos = full[2]
    saved = llm.scheduler.stop_checker.eos_token_ids
    llm.scheduler.stop_checker.eos_token_ids = frozenset({eos})
    try:
        out = greedy(llm, ignore_eos=False).outputs[0]
        ignored = greedy(llm, ignore_eos=True, max_tokens=5).outputs[0]
    finally:
        llm.scheduler.stop_checker.eos_token_ids = saved
    assert out.token_ids == full[:full.index(eos) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert (len(ignored.token_ids), ignored.finish_reason) == (5, "length")


def test_chat_applies_the_template(llm):
    conversation = [{"role": "user", "content": "list all prime numbers within 100"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.chat(conversation, params, use_tqdm=False)[0]
    rendered = "<|im_start|>user\nlist all prime numbers within 100<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.outputs[0].token_ids == llm.generate([out.prompt_token_ids], params, use_tqdm=False)[0]["token_ids"]
    two = llm.chat([conversation, [{"role": "user", "content": "hello"}]], params, use_tqdm=False)
    assert len(two) == 2 and two[0]["token_ids"] == out["token_ids"]
    with pytest.raises(ValueError, match="conversation 0, message 0 must be a {'role', 'content'} message"):
        llm.chat([{"content": "no role"}], params, use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be >= 1"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be -1 or 0"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(max_tokens=0), "max_tokens must be None or >= 1"),
    (dict(min_tokens=-1), "min_tokens must be in"),
    (dict(min_tokens=10, max_tokens=5), r"min_tokens must be in \[0, max_tokens=5\]"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(logprobs=-2), r"logprobs must be None, -1 \(every token\) or >= 0"),
    (dict(stop=[""]), "stop must hold non-empty strings"),
    (dict(stop_token_ids=[-3]), "stop_token_ids must hold non-negative"),
    (dict(seed="abc"), "seed must be an int"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_off_values_are_valid():
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=0).top_k == 0


def test_skip_special_tokens(llm):
    from nanovllm.engine.request import CompletionState
    from nanovllm.engine.sequence import Sequence
    special = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    words = llm.tokenizer.encode("hello world")
    for skip, want in [(True, "hello world"), (False, "hello<|im_start|> world")]:
        seq = Sequence([1, 2], SamplingParams(skip_special_tokens=skip), seq_id=0)
        seq.token_ids += [words[0], special, *words[1:]]
        assert llm.output_processor.text(seq, CompletionState()) == want


def test_flat_logprobs_read_as_a_list_of_position_dicts():
    import pickle

    from nanovllm.outputs import FlatLogprobs, Logprob
    flat = FlatLogprobs()
    flat.append_position([5, 9], [-0.1, -2.5], [1, 2], ["a", "b"])
    flat.append_position([7, 3, 40], [-0.3, -1.0, -6.0], [1, 2, 17], ["c", "d", None])  # the sampled 40: rank 17
    expected = [{5: Logprob(-0.1, 1, "a"), 9: Logprob(-2.5, 2, "b")},
                {7: Logprob(-0.3, 1, "c"), 3: Logprob(-1.0, 2, "d"), 40: Logprob(-6.0, 17, None)}]
    assert len(flat) == 2 and flat[0] == expected[0] and flat[-1] == expected[1] and flat[-2] == expected[0]
    assert list(flat) == expected and flat == expected and flat[1:] == expected[1:]
    assert pickle.loads(pickle.dumps(flat)) == expected
    with pytest.raises(IndexError):
        flat[2]
