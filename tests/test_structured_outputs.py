"""Structured outputs on the trained SmolLM2 (its GGUF file): every output validates against its constraint by an
independent reader (the `jsonschema` package, `re.fullmatch`, the list of choices), and every emitted token is one
that xgrammar's own matcher, driven token by token outside the engine, accepts; free requests in a batch with
constrained ones are unchanged; preemption, prefix hits, chunked prompts, n > 1 and the sampling options hold."""
import json
import os
import re
import signal

import jsonschema
import pytest
import xgrammar

from nanovllm import LLM, SamplingParams, StructuredOutputsParams

from conftest import smollm2_file

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=128,
                   max_num_seqs=16, enforce_eager=True)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
}, "required": ["name", "age", "color", "tags", "address"]}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"}}, "required": ["ok"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
SUM_GRAMMAR = 'root ::= number (" + " number)* " = " number\nnumber ::= [1-9] [0-9]?'
SUM = r"[1-9][0-9]?( \+ [1-9][0-9]?)* = [1-9][0-9]?"
CHOICES = ["Paris", "London", "New York", 'a "quoted"\nchoice']
MAX_TOKENS = 96


def chat(text: str) -> dict:
    return {"prompt": f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"}


def constrained(temperature=0.0, max_tokens=MAX_TOKENS, **constraint) -> SamplingParams:
    seed = None if temperature == 0 else 7
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def llm():
    with LLM(smollm2_file(), **ENGINE_ARGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def compiler(llm):
    info = xgrammar.TokenizerInfo.from_huggingface(llm.tokenizer, vocab_size=49152,
                                                   stop_token_ids=sorted(llm.eos_token_ids))
    return xgrammar.GrammarCompiler(info, cache_enabled=False)


def assert_tokens_follow(compiler, grammar, completion, eos_token_ids):
    """xgrammar's matcher, outside the engine, accepts each token; a completion that ended on EOS ended where
    the grammar may end."""
    matcher = xgrammar.GrammarMatcher(grammar)
    for i, token_id in enumerate(completion.token_ids):
        assert matcher.accept_token(token_id), f"token {i} ({token_id}) of {completion.text!r} breaks the grammar"
    if completion.finish_reason == "stop" and completion.token_ids and completion.token_ids[-1] in eos_token_ids:
        assert matcher.is_terminated()


def test_json_schemas_validate_and_every_token_follows_the_grammar(llm, compiler):
    schemas = [PERSON, SCORES, FLAG]
    prompts = [chat("Describe a person as JSON."), chat("Give me some scores."), chat("Is it ok?")] * 2
    params = [constrained(json=schema) for schema in schemas] + \
             [constrained(temperature=0.8, json=json.dumps(schema)) for schema in schemas]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, schema in zip(outputs, schemas * 2):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
        assert_tokens_follow(compiler, compiler.compile_json_schema(json.dumps(schema)), completion,
                             llm.eos_token_ids)


def test_regex_choice_grammar_and_json_object(llm, compiler):
    cases = [(dict(regex=PHONE), lambda text: re.fullmatch(PHONE, text)),
             (dict(choice=CHOICES), lambda text: text in CHOICES),
             (dict(grammar=SUM_GRAMMAR), lambda text: re.fullmatch(SUM, text)),
             (dict(json_object=True), lambda text: isinstance(json.loads(text), dict))]
    prompts = [chat("Give a phone number."), chat("Which city is in France?"), chat("Add two numbers."),
               chat("Any JSON object, please.")]
    for temperature in (0.0, 1.0):
        params = [constrained(temperature, **constraint) for constraint, _ in cases]
        for output, (constraint, valid) in zip(llm.generate(prompts, params, use_tqdm=False), cases):
            completion = output.outputs[0]
            assert completion.finish_reason == "stop" and valid(completion.text), (constraint, completion.text)
    regex = llm.generate([prompts[0]], [constrained(regex=PHONE)], use_tqdm=False)[0].outputs[0]
    assert_tokens_follow(compiler, compiler.compile_regex(PHONE), regex, llm.eos_token_ids)


def test_free_requests_beside_constrained_ones_are_unchanged(llm):
    free = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0.9, seed=3, max_tokens=40)]
    free_prompts = [chat("Name three colors."), chat("Write a haiku about the sea.")]
    alone = llm.generate(free_prompts, free, use_tqdm=False)
    mixed = llm.generate(free_prompts + [chat("A person as JSON.")] * 3,
                         free + [constrained(json=PERSON), constrained(1.0, regex=PHONE), constrained(choice=CHOICES)],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), PERSON)


def test_seeded_constrained_sampling_is_reproducible(llm):
    params = constrained(1.0, json=PERSON)
    first, again = (llm.generate([chat("A person.")], [params], use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert first.token_ids == again.token_ids


def test_n_logprobs_penalties_min_tokens_and_stop_strings_under_a_constraint(llm, compiler):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, logprobs=2, presence_penalty=0.5,
                            repetition_penalty=1.2, min_tokens=3, stop=["zzz"],
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    output = llm.generate([chat("Three people as JSON.")], params, use_tqdm=False)[0]
    assert len(output.outputs) == 3
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), PERSON)
        assert len(completion.logprobs) == len(completion.token_ids)
        # log-probabilities are of the masked logits, as vLLM's: the sampled tokens were allowed
        assert all(position[t].logprob > float("-inf") for t, position in zip(completion.token_ids,
                                                                              completion.logprobs))
    stopped = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=['"age"'],
                             structured_outputs=StructuredOutputsParams(json=PERSON))
    text = llm.generate([chat("A person.")], stopped, use_tqdm=False)[0].outputs[0].text
    assert text.startswith("{") and '"age"' not in text


def test_add_request_and_step_with_a_constraint(llm):
    llm.add_request("json", chat("A person as JSON."), constrained(json=PERSON))
    llm.add_request("free", chat("Hello"), SamplingParams(temperature=0, max_tokens=8))
    finished = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].text
    jsonschema.validate(json.loads(finished["json"]), PERSON)
    assert set(finished) == {"json", "free"}


def test_preemption_prefix_hits_and_chunked_prompts_mid_constraint(compiler):
    """A cache of 10 blocks of 16 tokens for 8 sequences: they are preempted and computed again from their tokens
    while constrained; prompts are chunked at 32 tokens; the second half repeats the first half's prompts."""
    prompts = [chat(f"Person number {i}: describe them as JSON with all fields filled in.") for i in range(4)] * 2
    params = [constrained(json=PERSON, max_tokens=56)] * 4 + [constrained(0.8, json=PERSON, max_tokens=56)] * 4
    args = ENGINE_ARGS | dict(num_kvcache_blocks=10, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=160)
    with LLM(smollm2_file(), **args) as small:
        outputs = small.generate(prompts, params, use_tqdm=False)
        assert small.scheduler.num_preemptions > 0
        assert any(output.num_cached_tokens for output in outputs)
        grammar = compiler.compile_json_schema(json.dumps(PERSON))
        for output in outputs:
            completion = output.outputs[0]
            assert_tokens_follow(compiler, grammar, completion, small.eos_token_ids)
            if completion.finish_reason == "stop":
                jsonschema.validate(json.loads(completion.text), PERSON)


@pytest.mark.parametrize("constraint, message", [
    (dict(), "exactly one constraint"),
    (dict(json=PERSON, regex="a+"), "got json and regex"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a", 1]), "choice must be a non-empty list"),
    (dict(regex=5), "regex must be str"),
    (dict(json=PERSON, whitespace_pattern=" "), "whitespace_pattern"),
])
def test_a_constraint_that_is_not_one_is_refused(constraint, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**constraint)


@pytest.mark.parametrize("constraint", [
    dict(regex="(unclosed"), dict(grammar="root ::= undefined_rule"), dict(json='{"type": '),
    dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), dict(structural_tag="not json"),
])
def test_a_constraint_that_cannot_compile_is_refused_and_the_others_are_served(llm, constraint):
    good = [chat("Yes or no?"), constrained(choice=["yes", "no"])]
    with pytest.raises(ValueError, match=f"prompt 1's structured outputs {next(iter(constraint))} cannot be compiled"):
        llm.generate([good[0], chat("x")], [good[1], constrained(**constraint)], use_tqdm=False)
    assert llm.get_num_unfinished_requests() == 0
    assert llm.generate([good[0]], [good[1]], use_tqdm=False)[0].outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("config, message", [
    ({"backend": "guidance"}, "backend 'guidance' is not available here"),
    ({"backend": "xgrammar", "reasoning": 1}, "has no 'reasoning'"),
])
def test_structured_outputs_config_takes_vllms_names(config, message):
    with pytest.raises(ValueError, match=message):
        LLM(smollm2_file(), **ENGINE_ARGS, structured_outputs_config=config)


def test_two_ranks_constrain_as_one(tiny_gqa):
    """Masks go to rank 0 through the workers' channel; the other rank samples nothing but keeps the tokens."""
    params = [constrained(max_tokens=12, regex=r"[0-9]{2,4}-[a-c]+"), constrained(0.9, max_tokens=12, choice=CHOICES),
              SamplingParams(temperature=0, max_tokens=12)]
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    outputs = []
    for tensor_parallel_size in (1, 2):
        with LLM(tiny_gqa, device="cpu", tensor_parallel_size=tensor_parallel_size, max_num_seqs=4,
                 kvcache_block_size=16, num_kvcache_blocks=64) as engine:
            outputs.append([o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("where", ["waiting for a step", "launching a step"])
def test_an_interrupt_leaves_every_constraint_whole(tiny_gqa, monkeypatch, where):
    """A Ctrl-C while the engine waits for a step's tokens, or one that lands while a constrained step is launched
    (held back until the step is recorded, then raised), leaves no step unsampled and no grammar behind its
    tokens: the requests, stepped on, all match."""
    pattern = r"x[0-9]{12}y"
    with LLM(tiny_gqa, device="cpu", max_num_seqs=4, kvcache_block_size=16, num_kvcache_blocks=64) as engine:
        for i in range(4):
            engine.add_request(str(i), [3 + i, 4, 5], constrained(1.0, max_tokens=30, regex=pattern))
        method = "wait" if where == "waiting for a step" else "execute_model"
        real, calls = getattr(engine.executor, method), []

        def interrupted(*args):
            calls.append(1)
            if len(calls) == 3 and method == "wait":
                raise KeyboardInterrupt
            result = real(*args)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGINT)  # lands inside the launch, which holds it back
            return result

        monkeypatch.setattr(engine.executor, method, interrupted)
        texts, interrupts = {}, 0
        while engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except KeyboardInterrupt:
                interrupts += 1
                continue
            texts.update({o.request_id: o.outputs[0].text for o in outputs if o.finished})
        assert interrupts == 1 and len(texts) == 4
        assert all(re.fullmatch(pattern, text) for text in texts.values()), texts
