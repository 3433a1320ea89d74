"""A pooling engine's lines in OpenAI batch files (`python -m nanovllm.run_batch --runner pooling`): OpenAI's
`/v1/embeddings` and vLLM's `/v1/score` and `/v1/rerank`, checked field by field against the shapes of OpenAI's and
vLLM's responses and value by value against transformers' float32 models on the same random checkpoints: an embedding
is the last token's final hidden state, normalised; an embedding engine's score the cosine of two; a one-label
classifier's (a cross-encoder's) score the sigmoid of its logit for the two texts tokenized as a pair."""
import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from nanovllm import LLM
from nanovllm.run_batch import run_batch
from nanovllm.utils.checkpoint import write_random_checkpoint

from conftest import read_jsonl

ENGINE_ARGS = dict(runner="pooling", device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256,
                   max_num_seqs=16, max_model_len=256)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUERY = "the model reads a prompt"
DOCUMENTS = ["keys and values of every earlier token", "a quick brown fox jumps", "the model writes the next token",
             "hello world"]


@pytest.fixture(scope="module")
def embedder_path(tmp_path_factory) -> str:
    """A Matryoshka model: embeddings may be cut to 16 or 32 of its 64 values."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("embedder")), initializer_range=0.1, seed=1,
                                   matryoshka_dimensions=[16, 32])


@pytest.fixture(scope="module")
def cross_encoder_path(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("cross_encoder")), initializer_range=0.1, seed=5,
                                   architecture="Qwen3ForSequenceClassification", num_labels=1)


@pytest.fixture(scope="module")
def embedder(embedder_path):
    with LLM(embedder_path, **ENGINE_ARGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_path):
    with LLM(cross_encoder_path, **ENGINE_ARGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def tokenizer(embedder_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedder_path)  # the cross-encoder's too: both are the small built one


@pytest.fixture(scope="module")
def hidden_state(embedder_path):
    """transformers' final hidden state (after the last norm) at a prompt's last token."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(embedder_path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def hidden_state(token_ids: list[int]) -> torch.Tensor:
        return model.model(torch.tensor([token_ids])).last_hidden_state[0, -1]
    return hidden_state


@pytest.fixture(scope="module")
def pair_logit(cross_encoder_path, tokenizer):
    """transformers' logit of a one-label classifier for two texts tokenized as a pair."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(cross_encoder_path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def pair_logit(first: str, second: str) -> float:
        return model(torch.tensor([tokenizer(first, second)["input_ids"]])).logits[0, 0].item()
    return pair_logit


def line(custom_id, url, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "tiny", **body}}


def serve(llm, tmp_path, requests, chunk_size=64) -> dict:
    """custom_id -> its first output line."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in requests)
    run_batch(llm, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "tiny", chunk_size, use_tqdm=False)
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert len(lines) == len(requests)
    return {line["custom_id"]: line for line in reversed(lines)}


def body_of(line, keys) -> dict:
    assert line["error"] is None, line["error"]
    assert line["id"].startswith("nanovllm-") and line["response"]["status_code"] == 200
    assert line["response"]["request_id"].startswith("nanovllm-batch-")
    body = line["response"]["body"]
    assert set(body) == keys and body["model"] == "tiny"
    return body


def embeddings_of(line) -> list:
    body = body_of(line, {"id", "object", "created", "model", "data", "usage"})
    assert body["id"].startswith("embd-") and body["object"] == "list" and isinstance(body["created"], int)
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "embedding") for i in range(len(body["data"]))]
    assert all(set(d) == {"index", "object", "embedding"} for d in body["data"])
    return [d["embedding"] for d in body["data"]]


def scores_of(line) -> list[float]:
    body = body_of(line, {"id", "object", "created", "model", "data", "usage"})
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(len(body["data"]))]
    return [d["score"] for d in body["data"]]


def assert_error(line, message):
    assert line["response"] is None and line["error"]["code"] == "invalid_request", line
    assert message in line["error"]["message"], line["error"]["message"]


def normalize(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=0)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def close(got, want: torch.Tensor, tolerance=1e-4) -> bool:
    return torch.tensor(got).shape == want.shape and (torch.tensor(got) - want).abs().max().item() < tolerance


def test_embeddings_are_transformers_hidden_states_in_openais_shape(embedder, tokenizer, hidden_state, tmp_path):
    texts = DOCUMENTS[:2]
    ids = [tokenizer.encode(text) for text in texts]
    long = list(range(3, 43))
    lines = serve(embedder, tmp_path, [
        line("text", "/v1/embeddings", input=QUERY),
        line("texts", "/v1/embeddings", input=texts),
        line("ids", "/v1/embeddings", input=ids[0]),
        line("id-lists", "/v1/embeddings", input=ids, encoding_format="float"),
        line("base64", "/v1/embeddings", input=ids, encoding_format="base64"),
        line("cut", "/v1/embeddings", input=texts, dimensions=16),
        line("truncated", "/v1/embeddings", input=long, truncate_prompt_tokens=8),
        line("raw", "/v1/embeddings", input=QUERY, use_activation=False),
    ])
    want = {text: normalize(hidden_state(tokenizer.encode(text))) for text in [QUERY, *texts]}
    assert close(*embeddings_of(lines["text"]), want[QUERY])
    assert all(close(got, want[text]) for got, text in zip(embeddings_of(lines["texts"]), texts, strict=True))
    assert close(*embeddings_of(lines["ids"]), want[texts[0]])
    floats = embeddings_of(lines["id-lists"])
    assert all(close(got, want[text]) for got, text in zip(floats, texts, strict=True))
    assert all(abs(np.linalg.norm(got) - 1) < 1e-6 for got in floats)
    # OpenAI's client decodes base64 as little-endian float32: the float values, rounded to float32
    decoded = [np.frombuffer(base64.b64decode(got), dtype="<f4") for got in embeddings_of(lines["base64"])]
    assert all(np.array_equal(got, np.asarray(values, dtype=np.float32)) for got, values in zip(decoded, floats))
    cut = embeddings_of(lines["cut"])
    assert all(close(got, normalize(hidden_state(tokenizer.encode(text))[:16])) for got, text in zip(cut, texts))
    assert close(*embeddings_of(lines["truncated"]), normalize(hidden_state(long[-8:])))
    assert close(*embeddings_of(lines["raw"]), hidden_state(tokenizer.encode(QUERY)))
    num_tokens = sum(map(len, ids))
    assert lines["id-lists"]["response"]["body"]["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    assert lines["truncated"]["response"]["body"]["usage"] == {"prompt_tokens": 8, "total_tokens": 8}


def test_every_lines_prompts_run_in_the_same_steps(embedder, tmp_path, monkeypatch):
    """Twelve lines of one to three prompts each (24 prompts, max_num_seqs=16): two prefills (four pipelined step()
    calls), not a step a line; a repeated custom_id is refused after its first line is written."""
    num_steps, step = [], embedder.step
    monkeypatch.setattr(embedder, "step", lambda: num_steps.append(1) or step())
    requests = [line(f"e{i}", "/v1/embeddings", input=DOCUMENTS[:1 + i % 3]) for i in range(12)]
    lines = serve(embedder, tmp_path, [*requests, requests[0]])
    assert len(num_steps) <= 4, f"{len(num_steps)} steps for 12 lines"
    assert [len(embeddings_of(lines[f"e{i}"])) for i in range(12)] == [1 + i % 3 for i in range(12)]
    first_and_repeat = [line["error"] for line in read_jsonl(tmp_path / "out.jsonl") if line["custom_id"] == "e0"]
    assert first_and_repeat[0] is None and first_and_repeat[1]["code"] == "duplicate_custom_id"


def test_score_and_rerank_on_an_embedding_engine_are_cosines(embedder, tokenizer, hidden_state, tmp_path):
    lines = serve(embedder, tmp_path, [
        line("one-to-many", "/v1/score", text_1=QUERY, text_2=DOCUMENTS),
        line("pairwise", "/score", data_1=DOCUMENTS[:2], data_2=DOCUMENTS[2:]),
        line("queries", "/v1/score", queries=[QUERY], documents=DOCUMENTS[:1]),
        line("rerank", "/v1/rerank", query=QUERY, documents=DOCUMENTS, top_n=3),
    ])
    hidden = {text: hidden_state(tokenizer.encode(text)) for text in [QUERY, *DOCUMENTS]}
    want = [cosine(hidden[QUERY], hidden[document]) for document in DOCUMENTS]
    assert np.allclose(scores_of(lines["one-to-many"]), want, atol=1e-4)
    assert np.allclose(scores_of(lines["pairwise"]), [cosine(hidden[a], hidden[b]) for a, b in
                                                      zip(DOCUMENTS[:2], DOCUMENTS[2:])], atol=1e-4)
    assert np.allclose(scores_of(lines["queries"]), want[:1], atol=1e-4)
    num_tokens = sum(len(tokenizer.encode(QUERY)) + len(tokenizer.encode(document)) for document in DOCUMENTS)
    assert lines["one-to-many"]["response"]["body"]["usage"] == {"prompt_tokens": num_tokens,
                                                                 "total_tokens": num_tokens}
    results = body_of(lines["rerank"], {"id", "model", "usage", "results"})["results"]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in results] == order
    assert [r["document"] for r in results] == [{"text": DOCUMENTS[i]} for i in order]
    assert np.allclose([r["relevance_score"] for r in results], [want[i] for i in order], atol=1e-4)


def test_a_cross_encoder_scores_and_reranks_pairs_by_the_sigmoid_of_its_logit(cross_encoder, pair_logit, tmp_path):
    lines = serve(cross_encoder, tmp_path, [
        line("score", "/v1/score", text_1=QUERY, text_2=DOCUMENTS),
        line("raw", "/v1/score", data_1=DOCUMENTS[:2], data_2=DOCUMENTS[2:], use_activation=False),
        line("rerank", "/v1/rerank", query=QUERY, documents=DOCUMENTS, top_n=2),
        line("all", "/rerank", query=QUERY, documents=DOCUMENTS, return_documents=False),
    ])
    logits = [pair_logit(QUERY, document) for document in DOCUMENTS]
    want = torch.sigmoid(torch.tensor(logits)).tolist()
    assert np.allclose(scores_of(lines["score"]), want, atol=1e-5)
    assert np.allclose(scores_of(lines["raw"]), [pair_logit(a, b) for a, b in zip(DOCUMENTS[:2], DOCUMENTS[2:])],
                       atol=1e-4)
    rerank = body_of(lines["rerank"], {"id", "model", "usage", "results"})
    assert rerank["id"].startswith("rerank-") and set(rerank["usage"]) == {"prompt_tokens", "total_tokens"}
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert [(r["index"], r["document"]["text"]) for r in rerank["results"]] == [(i, DOCUMENTS[i]) for i in order[:2]]
    assert np.allclose([r["relevance_score"] for r in rerank["results"]], [want[i] for i in order[:2]], atol=1e-5)
    everything = body_of(lines["all"], {"id", "model", "usage", "results"})["results"]
    assert [set(r) for r in everything] == [{"index", "relevance_score"}] * len(DOCUMENTS)
    assert [r["index"] for r in everything] == order


GOOD = line("good", "/v1/embeddings", input=QUERY)


@pytest.mark.parametrize("bad, message", [
    (line("x", "/v1/embeddings", input=QUERY, dimensions=24),
     "dimensions=24: the model does not support Matryoshka embeddings of that size"),
    (line("x", "/v1/embeddings", input=QUERY, dimensions=0), "dimensions must be >= 1, got 0"),
    (line("x", "/v1/embeddings", input=QUERY, dimensions="16"), "dimensions must be an integer, got '16'"),
    (line("x", "/v1/embeddings", input=[]), "input is empty"),
    (line("x", "/v1/embeddings"), "the body has no input"),
    (line("x", "/v1/embeddings", input=5), "input must be a text or a list, got 5"),
    (line("x", "/v1/embeddings", input=[1, "a"]), "input must be a text, a list of texts, a list of token ids or"),
    (line("x", "/v1/embeddings", input=[[1, 2], []]), "input[1]: the prompt is empty"),
    (line("x", "/v1/embeddings", input=["a", ""]), "input[1]: the prompt is empty"),
    (line("x", "/v1/embeddings", input=[5, 512]), "input: the prompt has token id 512 outside the vocabulary"),
    (line("x", "/v1/embeddings", input=[5] * 257), "the prompt has 257 tokens, longer than max_model_len=256"),
    (line("x", "/v1/embeddings", input=QUERY, encoding_format="bytes"),
     "encoding_format must be 'float' or 'base64', got 'bytes'"),
    (line("x", "/v1/embeddings", input=QUERY, truncate_prompt_tokens=0),
     "truncate_prompt_tokens must be None, -1 or >= 1, got 0"),
    (line("x", "/v1/embeddings", input=QUERY, echo=True), "unsupported field(s) for /v1/embeddings: echo"),
    (line("x", "/v1/score", text_1=QUERY), "a score needs the two sides as one of queries/documents, queries/items, "
                                           "data_1/data_2, text_1/text_2; the body has ['text_1']"),
    (line("x", "/v1/score", text_1=QUERY, data_2=QUERY), "the body has ['data_2', 'text_1']"),
    (line("x", "/v1/score", queries=QUERY, documents=[QUERY], items=[QUERY]),
     "the body has ['documents', 'items', 'queries']"),
    (line("x", "/v1/score", text_1=["a", "b"], text_2=["c", "d", "e"]),
     "text_1 holds 2 texts and text_2 3: give one text_1 for every text_2, or one for each"),
    (line("x", "/v1/score", text_1=QUERY, text_2=[]), "text_2 is empty"),
    (line("x", "/v1/score", text_1=[1, 2], text_2=QUERY), "text_1 must be a text or a list of texts, got [1, 2]"),
    (line("x", "/v1/score", text_1=QUERY, text_2=QUERY, dimensions=16), "unsupported field(s) for /v1/score"),
    (line("x", "/v1/rerank", documents=DOCUMENTS), "a rerank needs a query and documents; the body has no query"),
    (line("x", "/v1/rerank", query=QUERY, documents=QUERY), "documents must be a list, got"),
    (line("x", "/v1/rerank", query=QUERY, documents=DOCUMENTS, top_n="2"), "top_n must be an integer, got '2'"),
    (line("x", "/v1/rerank", query=QUERY, documents=["a", ""]), "documents[1]: the prompt is empty"),
    (line("x", "/v1/rerank", query=QUERY, documents=DOCUMENTS, use_activation="yes"),
     "use_activation must be a boolean, got 'yes'"),
    ({**GOOD, "custom_id": "x", "method": "GET"}, "method must be 'POST', got 'GET'"),
    ({**GOOD, "custom_id": "x", "body": [QUERY]}, "body must be a JSON object"),
])
def test_a_bad_pooling_line_gets_an_error_naming_the_problem_and_the_others_are_served(embedder, tmp_path, bad,
                                                                                       message):
    lines = serve(embedder, tmp_path, [GOOD, bad, line("good2", "/v1/score", text_1=QUERY, text_2=DOCUMENTS)])
    assert_error(lines["x"], message)
    assert lines["good"]["error"] is None and lines["good2"]["error"] is None


def test_a_line_the_engine_does_not_serve_gets_an_error_naming_the_runner_it_needs(embedder, cross_encoder, tiny_gqa,
                                                                                    tmp_path):
    chat = line("chat", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    completion = line("completion", "/v1/completions", prompt="hello", max_tokens=2)
    embeddings, rerank = line("embed", "/v1/embeddings", input=QUERY), line("rerank", "/rerank", query="a",
                                                                            documents=["b"])
    lines = serve(embedder, tmp_path, [chat, completion, embeddings])
    for custom_id in ("chat", "completion"):
        assert_error(lines[custom_id], "needs an engine made with runner='generate'; this one has runner='pooling', "
                                       "for /v1/embeddings, /v1/score and /v1/rerank: run this line with --runner "
                                       "generate")
    assert len(embeddings_of(lines["embed"])) == 1
    lines = serve(cross_encoder, tmp_path / "cross-encoder", [embeddings, rerank])
    assert_error(lines["embed"], "/v1/embeddings needs an embedding model; this engine has convert='classify'")
    assert lines["rerank"]["error"] is None
    with LLM(tiny_gqa, device="cpu", num_kvcache_blocks=64, max_model_len=256) as generator:
        lines = serve(generator, tmp_path / "generate", [embeddings, rerank, completion])
    for custom_id, url in (("embed", "/v1/embeddings"), ("rerank", "/v1/rerank")):
        assert_error(lines[custom_id], f"{url} needs an engine made with runner='pooling'; this one has runner="
                                       f"'generate', for /v1/completions and /v1/chat/completions: run this line "
                                       f"with --runner pooling")
    assert lines["completion"]["error"] is None


def test_a_classifier_of_several_labels_serves_no_scores(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "classifier"), seed=4, architecture="Qwen3ForSequenceClassification",
                                   num_labels=3)
    with LLM(path, **ENGINE_ARGS) as llm:
        lines = serve(llm, tmp_path, [line("x", "/v1/score", text_1="a", text_2="b")])
    assert_error(lines["x"], "/v1/score needs an embedding model or a classifier of one label (a cross-encoder); this "
                             "model's classifier has 3 labels")


def test_the_command_line_serves_pooling_lines(embedder_path, embedder, tmp_path):
    requests = [line("embed", "/v1/embeddings", input=DOCUMENTS), line("chat", "/v1/chat/completions", messages=[])]
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in requests)
    command = [sys.executable, "-m", "nanovllm.run_batch", "-i", str(tmp_path / "in.jsonl"), "-o",
               str(tmp_path / "out.jsonl"), "--model", embedder_path, "--served-model-name", "tiny", "--runner",
               "pooling", "--device", "cpu", "--dtype", "float32", "--num-kvcache-blocks", "64", "--no-progress"]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "1 served, 1 failed" in done.stderr, done.stderr
    lines = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    assert_error(lines["chat"], "needs an engine made with runner='generate'")
    want = [output.outputs.embedding for output in embedder.embed(DOCUMENTS, use_tqdm=False)]
    assert np.allclose(embeddings_of(lines["embed"]), want, atol=1e-6)


def test_the_summary_counts_pooled_prompt_tokens(embedder, tokenizer, tmp_path):
    """A chunk counts lines, not the prompts they fan out to; the summary counts the prompt tokens pooled."""
    requests = [line(f"e{i}", "/v1/embeddings", input=DOCUMENTS[:3]) for i in range(5)]
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in requests)
    run = run_batch(embedder, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "tiny", 2, use_tqdm=False)
    num_tokens = 5 * sum(len(tokenizer(text)["input_ids"]) for text in DOCUMENTS[:3])
    assert run.lines_in_engine == 0 and run.num_served == 5
    assert f"0 tokens generated, {num_tokens} prompt tokens pooled" in run.summary()
