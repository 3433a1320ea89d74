"""OpenAI batch files: `python -m nanovllm.run_batch`. The reference for what it generates is the same
engine's `generate` / `chat` on the same prompts; the output lines are checked field by field against
OpenAI's `text_completion` and `chat.completion` objects."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.openai_batch import make_request
from nanovllm.run_batch import make_parser, run_batch

from conftest import read_jsonl, texts

ENGINE_ARGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=256)
CLI_ENGINE_ARGS = ["--device", "cpu", "--kvcache-block-size", "16", "--num-kvcache-blocks", "256",
                   "--max-model-len", "256"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


def completion_request(custom_id, prompt, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, **body}}


def chat_request(custom_id, messages, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": messages, **body}}


def write_jsonl(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def serve(llm, tmp_path, requests, chunk_size=4, name="out.jsonl") -> list[dict]:
    out = tmp_path / name
    run_batch(llm, write_jsonl(tmp_path / "in.jsonl", requests), str(out), "tiny", chunk_size, use_tqdm=False)
    return read_jsonl(out)


def by_custom_id(lines) -> dict:
    return {line["custom_id"]: line for line in lines}


def body_of(line) -> dict:
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("nanovllm-") and line["error"] is None
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"}
    assert response["status_code"] == 200 and response["request_id"].startswith("nanovllm-batch-")
    body = response["body"]
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert isinstance(body["created"], int) and body["model"] == "tiny"
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    return body


def assert_completion(line, want):
    """`line` is a text_completion holding RequestOutput `want`."""
    body = body_of(line)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    keys = {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert [set(c) for c in body["choices"]] == [keys] * len(want.outputs)
    assert [(c["index"], c["text"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]] == \
           [(o.index, o.text, o.finish_reason, o.stop_reason) for o in want.outputs]
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in want.outputs)


def assert_chat_completion(line, want):
    body = body_of(line)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    keys = {"index", "message", "logprobs", "finish_reason", "stop_reason"}
    assert [set(c) for c in body["choices"]] == [keys] * len(want.outputs)
    assert [(c["index"], c["message"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]] == \
           [(o.index, {"role": "assistant", "content": o.text}, o.finish_reason, o.stop_reason) for o in want.outputs]
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in want.outputs)


def assert_error(line, custom_id, code, message):
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["custom_id"] == custom_id and line["response"] is None
    assert line["error"]["code"] == code and message in line["error"]["message"], line["error"]


# --- what is generated ---

def test_completions_are_generates_completions(llm, tmp_path):
    prompts = texts(10) + [llm.tokenizer.encode("hello world"), [5, 6, 7]]
    lines = serve(llm, tmp_path, [completion_request(f"r{i}", p, max_tokens=6, temperature=0)
                                  for i, p in enumerate(prompts)])
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert sorted(line["custom_id"] for line in lines) == sorted(f"r{i}" for i in range(len(prompts)))
    for i, line in by_custom_id(lines).items():
        assert_completion(line, want[int(i[1:])])


def test_chat_is_llm_chat(llm, tmp_path):
    conversations = [[{"role": "user", "content": text}] for text in texts(4)]
    conversations.append([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    lines = serve(llm, tmp_path, [chat_request(f"c{i}", m, max_tokens=5, temperature=0)
                                  for i, m in enumerate(conversations + [parts])])
    want = llm.chat(conversations + [[{"role": "user", "content": "hello\nworld"}]],
                    SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    for i, line in by_custom_id(lines).items():
        assert_chat_completion(line, want[int(i[1:])])


def test_a_chat_reply_may_fill_the_context_and_a_completion_gets_16_tokens(llm, tmp_path):
    lines = by_custom_id(serve(llm, tmp_path, [
        chat_request("chat", [{"role": "user", "content": "hello"}], ignore_eos=True),
        completion_request("completion", "hello", ignore_eos=True)]))
    chat = lines["chat"]["response"]["body"]
    assert chat["usage"]["total_tokens"] == 256 and chat["choices"][0]["finish_reason"] == "length"
    assert lines["completion"]["response"]["body"]["usage"]["completion_tokens"] == 16


def test_body_fields_map_to_sampling_params_under_openais_names_and_defaults(llm):
    def params(request):
        return make_request(llm, request).sampling_params

    prompt_len = len(llm.tokenizer.encode("hello"))
    assert params(completion_request("a", "hello")) == SamplingParams(max_tokens=16)
    # a chat reply without max_tokens may run to max_model_len: the engine makes None the room left
    assert params(chat_request("b", [{"role": "user", "content": "hello"}])) == SamplingParams(max_tokens=None)
    fields = dict(n=2, temperature=0.5, top_p=0.9, seed=7, stop=["x", "y"], presence_penalty=0.5,
                  frequency_penalty=-0.5, top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=2, ignore_eos=True,
                  stop_token_ids=[3], skip_special_tokens=False, include_stop_str_in_output=True)
    assert params(completion_request("c", "hello", max_tokens=9, logprobs=3, **fields)) == \
           SamplingParams(max_tokens=9, logprobs=3, **fields)
    assert params(chat_request("d", [{"role": "user", "content": "hi"}], max_completion_tokens=9, logprobs=True,
                               top_logprobs=4, **fields)) == SamplingParams(max_tokens=9, logprobs=4, **fields)
    assert params(completion_request("e", "hello", stop="x", temperature=None, max_tokens=256 - prompt_len)) == \
           SamplingParams(stop=["x"], max_tokens=256 - prompt_len)


def test_n_seeded_completions(llm, tmp_path):
    line = serve(llm, tmp_path, [completion_request("r", "hello world", n=3, seed=11, max_tokens=8)])[0]
    want = llm.generate("hello world", SamplingParams(n=3, seed=11, max_tokens=8), use_tqdm=False)[0]
    assert_completion(line, want)


def test_logprobs_in_openais_shapes(llm, tmp_path):
    lines = by_custom_id(serve(llm, tmp_path, [
        completion_request("completion", "hello world", max_tokens=4, temperature=0, logprobs=2),
        chat_request("chat", [{"role": "user", "content": "hello"}], max_tokens=4, temperature=0,
                     logprobs=True, top_logprobs=2)]))
    want = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=4, logprobs=2),
                        use_tqdm=False)[0].outputs[0]
    logprobs = lines["completion"]["response"]["body"]["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert logprobs["tokens"] == [llm.tokenizer.decode([t]) for t in want.token_ids]
    assert logprobs["token_logprobs"] == pytest.approx([p[t].logprob for t, p in zip(want.token_ids, want.logprobs)],
                                                       abs=1e-4)
    assert all(len(top) >= 2 and set(top) >= {tok} for top, tok in zip(logprobs["top_logprobs"], logprobs["tokens"]))
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(4)]

    content = lines["chat"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert [set(top) for top in entry["top_logprobs"]] == [{"token", "logprob", "bytes"}] * 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the sampled token is the top one


# --- bad lines ---

GOOD = completion_request("good", "hello world", max_tokens=3, temperature=0)


@pytest.mark.parametrize("line, custom_id, code, message", [
    ("{not json", None, "invalid_json", "line 2: the line is not JSON"),
    ("[1, 2]", None, "invalid_request", "the line is a JSON list, not an object"),
    ({**GOOD, "custom_id": 5}, None, "invalid_request", "custom_id must be a text, got 5"),
    ({**GOOD, "custom_id": "x", "method": "GET"}, "x", "invalid_request", "method must be 'POST', got 'GET'"),
    ({**GOOD, "custom_id": "x", "url": "/v1/images"}, "x", "invalid_request", "url '/v1/images' is not served"),
    ({**GOOD, "custom_id": "x", "url": "/v1/embeddings"}, "x", "invalid_request",
     "/v1/embeddings needs an engine made with runner='pooling'; this one has runner='generate'"),
    (completion_request("x", "x " * 300), "x", "invalid_request",
     "the prompt has 600 tokens, longer than max_model_len=256"),
    (completion_request("x", [1] * 250, max_tokens=10), "x", "invalid_request",
     "the prompt's 250 tokens and max_tokens=10 exceed max_model_len=256"),
    (completion_request("x", [1, 512]), "x", "invalid_request", "token id 512 outside the vocabulary [0, 512)"),
    (completion_request("x", ""), "x", "invalid_request", "the prompt is empty"),
    (completion_request("x", ["a", "b"]), "x", "invalid_request", "prompt holds 2 prompts: give each its own line"),
    (completion_request("x", "hi", temperature=-1), "x", "invalid_request", "temperature must be >= 0"),
    (completion_request("x", "hi", n=0), "x", "invalid_request", "n must be >= 1, got 0"),
    (completion_request("x", "hi", max_tokens=0), "x", "invalid_request", "max_tokens must be None or >= 1, got 0"),
    (completion_request("x", "hi", temperature="hot"), "x", "invalid_request",
     "temperature must be a number, got 'hot'"),
    (completion_request("x", "hi", n=True), "x", "invalid_request", "n must be an integer, got True"),
    (completion_request("x", "hi", echo=True, suffix="!"), "x", "invalid_request",
     "unsupported field(s) for /v1/completions: echo, suffix"),
    (completion_request("x", "hi", stream=True), "x", "invalid_request", "stream must be false"),
    (chat_request("x", [{"role": "user", "content": "hi"}], top_logprobs=2), "x", "invalid_request",
     "top_logprobs needs logprobs: true"),
    (chat_request("x", [{"role": "user"}]), "x", "invalid_request",
     "the conversation, message 0 must be a {'role', 'content'} message"),
    (chat_request("x", "hello"), "x", "invalid_request", "messages must be a list, got 'hello'"),
    (chat_request("x", [{"role": "user", "content": [{"type": "image_url"}]}]), "x", "invalid_request",
     "a content part of type 'image_url': this engine serves text only"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions"}, "x", "invalid_request", "body must be"),
    ({**GOOD, "custom_id": "x", "url": ["/v1/completions"]}, "x", "invalid_request", "url ['/v1/completions'] is not"),
    # refused before a sequence is made, as vLLM bounds them, where the engine would run out of memory or overflow
    (completion_request("x", "hi", n=10**9), "x", "invalid_request",
     "n=1000000000 exceeds max_num_seqs=256, the sequences the engine runs at once"),
    (completion_request("x", "hi", n=257), "x", "invalid_request", "n=257 exceeds max_num_seqs=256"),
    (completion_request("x", "hi", max_tokens=10**300), "x", "invalid_request", f"max_tokens={10**300} exceed"),
    (completion_request("x", "hi", logprobs=10**9), "x", "invalid_request", "logprobs must be in [0, 20], got 10000"),
    # every position's whole vocabulary: on a real model's, one such line filled the memory, on every resume
    (completion_request("x", "hi", logprobs=-1), "x", "invalid_request", "logprobs must be in [0, 20], got -1"),
    (completion_request("x", "hi", logprobs=21), "x", "invalid_request", "logprobs must be in [0, 20], got 21"),
    (completion_request("x", "hi", temperature=float("inf")), "x", "invalid_request",
     "temperature must be a number, got inf"),
    (completion_request("x", "hi", repetition_penalty=10**400), "x", "invalid_request",
     "repetition_penalty must be a number, got 1000"),
])
def test_a_bad_line_gets_an_error_naming_the_problem_and_the_others_are_served(llm, tmp_path, line, custom_id,
                                                                               code, message):
    lines = serve(llm, tmp_path, [GOOD, line, {**GOOD, "custom_id": "good2"}])
    assert len(lines) == 3
    good = [line for line in lines if line["error"] is None]
    assert sorted(line["custom_id"] for line in good) == ["good", "good2"]
    assert_error(next(line for line in lines if line["error"] is not None), custom_id, code, message)


def test_a_chat_prompt_that_fills_the_context_leaves_no_room_for_a_reply(llm, tmp_path):
    def num_tokens(content):
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        return len(llm.tokenizer.encode(text, add_special_tokens=False))

    content = next(c for k in range(200) for c in ("x " * k, "x " * k + "x") if num_tokens(c) == 256)
    lines = serve(llm, tmp_path, [chat_request("x", [{"role": "user", "content": content}]), GOOD])
    assert_error(lines[0], "x", "invalid_request", "the prompt has 256 tokens and fills max_model_len=256: "
                                                   "max_tokens=None leaves no room for a completion")
    assert lines[1]["error"] is None


def test_unsupported_fields_at_their_defaults_are_accepted(llm, tmp_path):
    lines = serve(llm, tmp_path, [completion_request("x", "hi", echo=False, logit_bias={}, user="me", stream=False,
                                                     max_tokens=2, best_of=None)])
    assert lines[0]["error"] is None


def test_a_repeated_custom_id_gets_an_error_after_the_first_is_served(llm, tmp_path):
    requests = [GOOD, completion_request("other", "hi", max_tokens=2), {**GOOD, "body": {"prompt": "again"}}]
    lines = serve(llm, tmp_path, requests, chunk_size=8)
    assert sorted(line["custom_id"] for line in lines[:2]) == ["good", "other"]  # served as they finish
    assert all(line["error"] is None for line in lines[:2])
    assert_error(lines[2], "good", "duplicate_custom_id", "line 3: custom_id 'good' was used before")


def test_the_next_chunk_joins_while_the_last_ones_tail_runs(llm, tmp_path, monkeypatch):
    """Chunks of 4 requests, one long and three short each: every chunk after the first is read while
    requests of the one before are still in the engine, and every line is served once with generate's
    tokens."""
    from nanovllm.run_batch import BatchRun
    requests = [completion_request(f"r{i}", [3, 4, 5 + i], max_tokens=24 if i % 4 == 0 else 2, temperature=0,
                                   ignore_eos=True) for i in range(16)]
    in_engine_when_read, add_chunk = [], BatchRun.add_chunk

    def recording_add_chunk(run, lines):
        in_engine_when_read.append(len(run.in_engine))
        add_chunk(run, lines)
    monkeypatch.setattr(BatchRun, "add_chunk", recording_add_chunk)
    lines = by_custom_id(serve(llm, tmp_path, requests, chunk_size=4))
    assert in_engine_when_read[0] == 0 and all(n > 0 for n in in_engine_when_read[1:4])
    want = llm.generate([r["body"]["prompt"] for r in requests],
                        [SamplingParams(temperature=0, max_tokens=r["body"]["max_tokens"], ignore_eos=True)
                         for r in requests], use_tqdm=False)
    assert [body_of(lines[f"r{i}"])["choices"][0]["text"] for i in range(16)] == [o.outputs[0].text for o in want]


def test_a_prompt_the_engine_refuses_fails_alone_and_the_others_come_as_they_finish(llm):
    prompts = [[1, 2, 3], [], [4, 5], [6, 7]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 5, 1)]
    results = list(llm.generate_as_completed(prompts, params))
    assert [i for i, _ in results] == [1, 3, 2, 0]  # the refused one at once, then the shortest first
    assert isinstance(results[0][1], ValueError) and str(results[0][1]) == "the prompt is empty"
    assert [len(out.outputs[0].token_ids) for _, out in results[1:]] == [1, 5, 9]
    assert not llm.requests and llm.scheduler.is_finished()


# --- resuming ---

def greedy_requests(num):
    return [completion_request(f"r{i}", text, max_tokens=8, temperature=0) for i, text in enumerate(texts(num))]


def results(lines) -> dict:
    """custom_id -> what was generated, leaving out the ids and timestamps each run makes anew."""
    return {line["custom_id"]: (line["response"]["body"]["choices"], line["response"]["body"]["usage"])
            for line in lines}


def test_a_second_run_skips_every_line_already_written(llm, tmp_path):
    lines = serve(llm, tmp_path, greedy_requests(6))
    before = (tmp_path / "out.jsonl").read_bytes()
    run = run_batch(llm, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "tiny", use_tqdm=False)
    assert (run.num_served, run.num_failed, run.num_skipped) == (0, 0, 6) and len(lines) == 6
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_a_torn_last_line_is_cut_off_and_served_again(llm, tmp_path):
    requests = greedy_requests(12) + ["{not json"]
    whole = serve(llm, tmp_path, requests, name="whole.jsonl")
    with open(tmp_path / "whole.jsonl", "rb") as f:
        kept = f.read().split(b"\n")[:5]
    (tmp_path / "out.jsonl").write_bytes(b"\n".join(kept[:4]) + b"\n" + kept[4][:len(kept[4]) // 2])
    run = run_batch(llm, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "tiny", 4, use_tqdm=False)
    assert run.output.num_torn_bytes == len(kept[4]) // 2
    assert (run.num_served + run.num_failed, run.num_skipped) == (9, 4)
    resumed = read_jsonl(tmp_path / "out.jsonl")
    assert [line["custom_id"] for line in resumed] == [line["custom_id"] for line in whole]
    assert results(resumed[:-1]) == results(whole[:-1])
    assert_error(resumed[-1], None, "invalid_json", "line 13: the line is not JSON")


def test_an_output_file_of_something_else_is_refused(llm, tmp_path):
    write_jsonl(tmp_path / "out.jsonl", ["not a result"])
    with pytest.raises(ValueError, match="line 1 is not a batch output line"):
        run_batch(llm, write_jsonl(tmp_path / "in.jsonl", greedy_requests(1)), str(tmp_path / "out.jsonl"), "tiny")


def start_cli(tiny_gqa, tmp_path, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "nanovllm.run_batch", "-i", str(tmp_path / "in.jsonl"),
               "-o", str(tmp_path / "out.jsonl"), "--model", tiny_gqa, "--chunk-size", "8", *CLI_ENGINE_ARGS]
    env = {**os.environ, "PYTHONPATH": REPO}
    with open(tmp_path / log, "w") as f:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)


def num_lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_killed_at_any_moment_and_started_again_every_request_is_written_once(llm, tiny_gqa, tmp_path):
    num_requests = 200
    write_jsonl(tmp_path / "in.jsonl", greedy_requests(num_requests))
    first = start_cli(tiny_gqa, tmp_path, "first.log")
    deadline = time.monotonic() + 120
    while num_lines(tmp_path / "out.jsonl") < 24 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    num_before = num_lines(tmp_path / "out.jsonl")
    assert 24 <= num_before < num_requests, "the run was not killed midway: " + (tmp_path / "first.log").read_text()

    second = start_cli(tiny_gqa, tmp_path, "second.log")
    second.wait(timeout=300)
    log = (tmp_path / "second.log").read_text()
    assert second.returncode == 0, log
    assert f"{num_requests - num_before} served, 0 failed, {num_before} already in" in log

    resumed = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(line["custom_id"] for line in resumed) == sorted(f"r{i}" for i in range(num_requests))
    shutil.copy(tmp_path / "in.jsonl", tmp_path / "again.jsonl")
    run_batch(llm, str(tmp_path / "again.jsonl"), str(tmp_path / "whole.jsonl"), "tiny", 8, use_tqdm=False)
    assert results(resumed) == results(read_jsonl(tmp_path / "whole.jsonl"))


def test_engine_options_are_the_engine_args():
    """The flags EngineArgs.add_cli_args adds, as vLLM's run_batch takes them (underscores or dashes)."""
    import dataclasses

    from nanovllm import EngineArgs
    args = vars(make_parser().parse_args(["-i", "a", "-o", "b", "--model", "m", "--tensor_parallel_size", "2",
                                          "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                                          "--max-model-len", "256", "--seed", "3", "--dtype", "half"]))
    given = dict(model="m", tensor_parallel_size=2, enable_prefix_caching=False, gpu_memory_utilization=0.5,
                 max_model_len=256, seed=3, dtype="half")
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert args == dict(input_file="a", output_file="b", served_model_name=None, chunk_size=2048, no_progress=False,
                        **{**defaults, **given})
