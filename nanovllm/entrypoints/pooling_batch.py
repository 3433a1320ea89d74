"""A pooling engine's batch lines, after vLLM's `run_batch`: OpenAI's `/v1/embeddings` and vLLM's `/v1/score` and
`/v1/rerank`, with the bodies and responses of vLLM's EmbeddingRequest, ScoreRequest and RerankRequest.

A line becomes one engine request per prompt it holds (an input, a text of a side, a query-document pair), all made
and checked before any is queued, so a bad line fails whole and alone; the runner queues them with every other
line's and writes the line's response once the last of them is done. On an embedding engine a score is the cosine
of the two texts' embeddings; on a one-label classifier (a cross-encoder) it is the sigmoid of its score of the two
texts tokenized as a pair, as `LLM.score` gives them.
"""
import base64
import dataclasses
import struct
import time
from dataclasses import dataclass, field

from nanovllm.engine.input_processor import check_text
from nanovllm.engine.pooling import cosine_scores, cross_encoder_scores, pair_prompt
from nanovllm.engine.request import Request
from nanovllm.entrypoints.openai_batch import (
    BOOL,
    EMBEDDINGS,
    INT,
    LIST,
    RERANK,
    SCORE,
    TEXT,
    BatchLineError,
    check_known_fields,
)
from nanovllm.entrypoints.openai_responses import new_id
from nanovllm.outputs import PoolingRequestOutput
from nanovllm.pooling_params import PoolingParams

# vLLM's run_batch serves any url ending in /score or /rerank, as its server takes /score and /v1/score, /rerank,
# /v1/rerank and /v2/rerank.
POOLING_URLS = {EMBEDDINGS: EMBEDDINGS, SCORE: SCORE, "/score": SCORE, RERANK: RERANK, "/rerank": RERANK,
                "/v2/rerank": RERANK}
# The two sides of a score, by the names vLLM's ScoreRequest takes them: its newest first, text_1/text_2 its oldest.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
ACTIVATION_FIELDS = {"use_activation": BOOL, "activation": BOOL}  # activation: vLLM's older name
COMMON_FIELDS = {"model": TEXT, "user": TEXT, "truncate_prompt_tokens": INT}
FIELDS = {
    EMBEDDINGS: {"input": (TEXT, LIST), "dimensions": INT, "encoding_format": TEXT, "add_special_tokens": BOOL,
                 "use_activation": BOOL, **COMMON_FIELDS},
    SCORE: {**{name: (TEXT, LIST) for sides in SCORE_SIDES for name in sides}, **ACTIVATION_FIELDS, **COMMON_FIELDS},
    RERANK: {"query": TEXT, "documents": LIST, "top_n": INT, "return_documents": BOOL, **ACTIVATION_FIELDS,
             **COMMON_FIELDS},
}
ENCODING_FORMATS = ("float", "base64")


@dataclass(slots=True)
class PoolingBatchRequest:
    """A pooling line: its engine requests, in the order its response lists them, and their outputs as they come.
    `num_firsts`: how many of the requests embed a score's first side (None: each request is a pair, scored by a
    cross-encoder)."""

    custom_id: str
    url: str
    body: dict
    requests: list[Request]
    num_firsts: int | None = None
    outputs: dict[str, PoolingRequestOutput] = field(default_factory=dict)

    def take(self, output: PoolingRequestOutput) -> bool:
        """Keep one request's output; whether the line is done."""
        self.outputs[output.request_id] = output
        return len(self.outputs) == len(self.requests)

    def ordered_outputs(self) -> list[PoolingRequestOutput]:
        return [self.outputs[request.request_id] for request in self.requests]


def is_pooling_line(request: dict) -> bool:
    return isinstance(request.get("url"), str) and request["url"] in POOLING_URLS


def make_pooling_request(llm, request: dict, request_id: str) -> PoolingBatchRequest:
    """Check a pooling line and make its engine requests (`request_id`-0, -1, ...), none queued; raises
    BatchLineError."""
    url, body = POOLING_URLS[request["url"]], request.get("body")
    if request.get("method") != "POST":
        raise BatchLineError(f"method must be 'POST', got {request.get('method')!r}")
    check_engine(llm, url)
    if not isinstance(body, dict):
        raise BatchLineError("body must be a JSON object")
    body = {name: value for name, value in body.items() if value is not None}  # null is the default
    check_known_fields(url, body, FIELDS[url])
    try:
        params = PoolingParams(body.get("dimensions"), use_activation(body), body.get("truncate_prompt_tokens"))
        if url == EMBEDDINGS:
            return embeddings_request(llm, request["custom_id"], body, params, request_id)
        return score_request(llm, request["custom_id"], url, body, params, request_id)
    except (TypeError, ValueError) as e:  # TypeError: a value of a type the checks above let through
        raise BatchLineError(str(e)) from e


def check_engine(llm, url: str):
    config = llm.config
    if config.runner != "pooling":
        raise BatchLineError(f"{url} needs an engine made with runner='pooling'; this one has runner={config.runner!r}"
                             f", for /v1/completions and /v1/chat/completions: run this line with --runner pooling")
    if url == EMBEDDINGS and config.convert != "embed":
        raise BatchLineError(f"{url} needs an embedding model; this engine has convert={config.convert!r} (a "
                             f"*ForSequenceClassification checkpoint), which serves {SCORE} and {RERANK}")
    if url != EMBEDDINGS and config.convert == "classify" and config.hf_config.num_labels != 1:
        raise BatchLineError(f"{url} needs an embedding model or a classifier of one label (a cross-encoder); this "
                             f"model's classifier has {config.hf_config.num_labels} labels")


def embeddings_request(llm, custom_id: str, body: dict, params: PoolingParams, request_id: str) -> PoolingBatchRequest:
    if body.get("encoding_format", "float") not in ENCODING_FORMATS:
        raise ValueError(f"encoding_format must be 'float' or 'base64', got {body['encoding_format']!r}")
    add_special_tokens = body.get("add_special_tokens", True)
    requests = [engine_request(llm, f"{request_id}-{i}", name, prompt, params, add_special_tokens)
                for i, (name, prompt) in enumerate(embedding_inputs(body.get("input")))]
    return PoolingBatchRequest(custom_id, EMBEDDINGS, body, requests)


def embedding_inputs(value) -> list[tuple[str, str | list[int]]]:
    """(name, prompt) of each prompt of OpenAI's input: a text, a list of texts, a list of token ids, or a list of
    lists of token ids."""
    if value is None:
        raise ValueError("the body has no input")
    if isinstance(value, str) or (value and is_token_ids(value)):
        return [("input", value)]
    if not value:
        raise ValueError("input is empty: give a text, a list of texts, or token ids")
    if all(isinstance(item, str) for item in value) or all(is_token_ids(item) for item in value):
        return [(f"input[{i}]", item) for i, item in enumerate(value)]
    raise ValueError("input must be a text, a list of texts, a list of token ids or a list of lists of token ids")


def is_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def score_request(llm, custom_id: str, url: str, body: dict, params: PoolingParams,
                  request_id: str) -> PoolingBatchRequest:
    """A score's or a rerank's requests: each text embedded on an embedding engine, each pair on a cross-encoder."""
    (first_name, firsts), (second_name, seconds) = score_sides(body) if url == SCORE else rerank_sides(body)
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise ValueError(f"{first_name} holds {len(firsts)} texts and {second_name} {len(seconds)}: give one "
                         f"{first_name} for every {second_name}, or one for each")
    if llm.config.convert == "embed":
        prompts = firsts + seconds
        requests = [engine_request(llm, f"{request_id}-{i}", name, text, params)
                    for i, (name, text) in enumerate(prompts)]
        return PoolingBatchRequest(custom_id, url, body, requests, num_firsts=len(firsts))
    firsts = firsts * len(seconds) if len(firsts) == 1 else firsts
    raw = dataclasses.replace(params, use_activation=False)  # the sigmoid, where asked, once the score is back
    requests = []
    for i, ((name_1, text_1), (name_2, text_2)) in enumerate(zip(firsts, seconds)):
        check_text(name_1, text_1)
        check_text(name_2, text_2)
        pair = pair_prompt(llm.tokenizer, text_1, text_2)
        requests.append(engine_request(llm, f"{request_id}-{i}", f"the pair of {name_1} and {name_2}", pair, raw))
    return PoolingBatchRequest(custom_id, url, body, requests)


def score_sides(body: dict) -> tuple[tuple[str, list], tuple[str, list]]:
    """The (name, text) pairs of each side of a score, from the one pair of vLLM's field names the body uses."""
    given = sorted({name for sides in SCORE_SIDES for name in sides if name in body})
    used = [sides for sides in SCORE_SIDES if set(sides) == set(given)]
    if not used:
        pairs = ", ".join(f"{first}/{second}" for first, second in SCORE_SIDES)
        raise ValueError(f"a score needs the two sides as one of {pairs}; the body has {given or 'neither'}")
    return tuple((name, named_texts(name, body[name])) for name in used[0])


def rerank_sides(body: dict) -> tuple[tuple[str, list], tuple[str, list]]:
    for name in ("query", "documents"):
        if name not in body:
            raise ValueError(f"a rerank needs a query and documents; the body has no {name}")
    return ("query", named_texts("query", body["query"])), ("documents", named_texts("documents", body["documents"]))


def named_texts(name: str, value) -> list[tuple[str, str]]:
    """(name, text) of each text of a side: a text alone, or a list of texts."""
    if isinstance(value, str):
        return [(name, value)]
    if not value:
        raise ValueError(f"{name} is empty")
    if not all(isinstance(text, str) for text in value):
        raise ValueError(f"{name} must be a text or a list of texts, got {value!r}")
    return [(f"{name}[{i}]", text) for i, text in enumerate(value)]


def engine_request(llm, request_id: str, name: str, prompt, params: PoolingParams,
                   add_special_tokens: bool = True) -> Request:
    """A checked engine request, errors naming the prompt by its field."""
    try:
        return llm.input_processor.make_request(request_id, prompt, params, add_special_tokens=add_special_tokens)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def pooling_result_line(request: PoolingBatchRequest, model: str) -> dict:
    """The batch envelope of a finished line, as `openai_responses.result_line` writes a generated one."""
    outputs = request.ordered_outputs()
    if request.url == EMBEDDINGS:
        body = embeddings_response(outputs, request.body.get("encoding_format", "float"), model)
    elif request.url == SCORE:
        body = score_response(scores(request, outputs), model)
    else:
        body = rerank_response(scores(request, outputs), request.body, model)
    return {"id": new_id("nanovllm"), "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": new_id("nanovllm-batch"), "body": body}, "error": None}


def scores(request: PoolingBatchRequest, outputs: list[PoolingRequestOutput]) -> list:
    """ScoringRequestOutputs, pair by pair, whose prompt_token_ids are the pair's (vLLM counts their usage so)."""
    if request.num_firsts is None:
        return cross_encoder_scores(outputs, use_activation(request.body) is not False)
    return cosine_scores(outputs[:request.num_firsts], outputs[request.num_firsts:])


def use_activation(body: dict) -> bool | None:
    return body.get("use_activation", body.get("activation"))


def embeddings_response(outputs: list[PoolingRequestOutput], encoding_format: str, model: str) -> dict:
    data = [{"index": i, "object": "embedding", "embedding": encode(output.outputs.embedding, encoding_format)}
            for i, output in enumerate(outputs)]
    return {"id": new_id("embd"), "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": usage(outputs)}


def encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the float32 values' little-endian bytes, as its client decodes them."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


def score_response(outputs: list, model: str) -> dict:
    data = [{"index": i, "object": "score", "score": output.outputs.score} for i, output in enumerate(outputs)]
    return {"id": new_id("score"), "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": usage(outputs)}


def rerank_response(outputs: list, body: dict, model: str) -> dict:
    """Jina's and Cohere's shape, as vLLM gives it: the documents by relevance, most relevant first, the top_n of
    them where top_n > 0; return_documents=false (Jina's and Cohere's option) leaves their texts out."""
    results = [{"index": i, "document": {"text": document}, "relevance_score": output.outputs.score}
               for i, (document, output) in enumerate(zip(body["documents"], outputs))]
    if not body.get("return_documents", True):
        results = [{key: value for key, value in result.items() if key != "document"} for result in results]
    results.sort(key=lambda result: result["relevance_score"], reverse=True)
    top_n = body.get("top_n", 0)
    return {"id": new_id("rerank"), "model": model, "usage": usage(outputs),
            "results": results[:top_n] if top_n > 0 else results}


def usage(outputs: list) -> dict:
    num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}
