"""OpenAI's batch format, one JSON object a line: requests in, results or errors out.

A request line is `{"custom_id", "method": "POST", "url", "body"}` with the body of a
`/v1/completions` or `/v1/chat/completions` call; its sampling fields keep OpenAI's names and
defaults (and vLLM's extras), so a file written for OpenAI's or vLLM's batch API runs unchanged. A line may
constrain its output with OpenAI's `response_format` or vLLM's `structured_outputs`. A pooling engine's
endpoints (`/v1/embeddings`, `/v1/score`, `/v1/rerank`) are served by `pooling_batch.py`.
"""
import json
import math
from dataclasses import dataclass

from nanovllm.entrypoints.requests import check_keys, prompt_token_ids, structured_outputs_params
from nanovllm.sampling_params import CONSTRAINTS, SamplingParams, StructuredOutputsParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
EMBEDDINGS, SCORE, RERANK = "/v1/embeddings", "/v1/score", "/v1/rerank"  # a pooling engine's (pooling_batch.py)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's; a chat reply may fill the rest of the context
# OpenAI's bound on a chat request's top_logprobs, and vLLM's (max_logprobs) on a completion's logprobs: every
# position's alternatives are kept and written out, so the whole vocabulary's would fill the memory.
MAX_TOP_LOGPROBS = 20

NUMBER, INT, BOOL, TEXT, LIST, DICT = "a number", "an integer", "a boolean", "a text", "a list", "an object"
# Body fields that map one to one onto SamplingParams, with their JSON types: OpenAI's, then vLLM's extras.
SAMPLING_FIELDS = {
    "n": INT, "temperature": NUMBER, "top_p": NUMBER, "seed": INT, "stop": (TEXT, LIST),
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
    "top_k": INT, "min_p": NUMBER, "repetition_penalty": NUMBER, "min_tokens": INT, "ignore_eos": BOOL,
    "stop_token_ids": LIST, "skip_special_tokens": BOOL, "include_stop_str_in_output": BOOL,
}
# Fields read elsewhere, or accepted and ignored ("model": the engine serves one).
CONSTRAINT_FIELDS = {"response_format": DICT, "structured_outputs": DICT}
OWN_FIELDS = {
    COMPLETIONS: {"prompt": (TEXT, LIST), "max_tokens": INT, "logprobs": INT, **CONSTRAINT_FIELDS},
    CHAT: {"messages": LIST, "max_tokens": INT, "max_completion_tokens": INT, "logprobs": BOOL,
           "top_logprobs": INT, "add_generation_prompt": BOOL, "chat_template_kwargs": DICT, **CONSTRAINT_FIELDS},
}
# OpenAI's response_format types and the keys each takes; vLLM's structural_tag is xgrammar's, passed whole.
RESPONSE_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema")}
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")  # strict: the schema is always enforced
IGNORED_FIELDS = {"model": TEXT, "user": TEXT, "stream": BOOL}


class BatchLineError(ValueError):
    """A line that cannot be served; `code` is its kind, the message names the problem."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class BatchRequest:
    custom_id: str
    url: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


def load_line(line: bytes) -> tuple[dict | None, str | None, BatchLineError | None]:
    """(the request object, its custom_id, the error that makes it unservable or None). Cheap: no
    tokenizing, so a resumed run skips what it already served quickly."""
    request, error = parse_json(line)
    if error:
        return None, None, error
    if not isinstance(request, dict):
        return None, None, BatchLineError(f"the line is a JSON {type(request).__name__}, not an object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str):
        return request, None, BatchLineError(f"custom_id must be a text, got {custom_id!r}")
    return request, custom_id, None


def parse_json(line: bytes) -> tuple[object, BatchLineError | None]:
    """The line's JSON value, or the error that kept it from being read (every one fails this line alone)."""
    try:
        return json.loads(line.decode("utf-8")), None
    except UnicodeDecodeError as e:
        problem = f"the line is not UTF-8 text: {e.reason} at byte {e.start}"
    except json.JSONDecodeError as e:
        problem = f"the line is not JSON: {e}"
    except RecursionError:
        problem = "the line nests arrays or objects too deep to be read"
    except ValueError as e:  # an integer longer than Python's limit; its advice (';' on) is for programmers
        problem = f"the line cannot be read: {str(e).partition(';')[0]}"
    return None, BatchLineError(problem, "invalid_json")


def make_request(llm, request: dict) -> BatchRequest:
    """Check a loaded request line and turn it into token ids and SamplingParams; raises BatchLineError."""
    url, body = request.get("url"), request.get("body")
    if request.get("method") != "POST":
        raise BatchLineError(f"method must be 'POST', got {request.get('method')!r}")
    if not isinstance(url, str) or url not in OWN_FIELDS:
        served = ", ".join(map(repr, (COMPLETIONS, CHAT, EMBEDDINGS, SCORE)))
        raise BatchLineError(f"url {url!r} is not served: use {served} or {RERANK!r}")
    if llm.config.runner != "generate":
        raise BatchLineError(f"{url} needs an engine made with runner='generate'; this one has runner="
                             f"{llm.config.runner!r}, for {EMBEDDINGS}, {SCORE} and {RERANK}: run this line with "
                             f"--runner generate")
    if not isinstance(body, dict):
        raise BatchLineError("body must be a JSON object")
    body = {name: value for name, value in body.items() if value is not None}  # null is the default
    check_fields(url, body)
    check_n(body, llm.config.max_num_seqs)
    try:
        if url == COMPLETIONS:
            token_ids = prompt_token_ids(llm, prompt=single_prompt(body.get("prompt")))
        else:
            token_ids = prompt_token_ids(llm, messages=body.get("messages"),
                                         add_generation_prompt=body.get("add_generation_prompt", True),
                                         chat_template_kwargs=body.get("chat_template_kwargs"))
        params = SamplingParams(**sampling_kwargs(url, body, len(token_ids), llm.config.max_model_len))
    except (TypeError, ValueError) as e:  # TypeError: a value of a type the checks above let through
        raise BatchLineError(str(e)) from e
    return BatchRequest(request["custom_id"], url, token_ids, params)


def check_fields(url: str, body: dict):
    check_known_fields(url, body, {**SAMPLING_FIELDS, **OWN_FIELDS[url], **IGNORED_FIELDS})
    if body.get("stream"):
        raise BatchLineError("stream must be false in a batch file")


def check_known_fields(url: str, body: dict, known: dict):
    """Every field of the body one of `known` (name -> JSON type), of its type; an unknown one is refused unless
    it is at an empty default."""
    unsupported = sorted(name for name, value in body.items() if name not in known and value not in (False, {}, []))
    if unsupported:
        raise BatchLineError(f"unsupported field(s) for {url}: {', '.join(unsupported)}")
    for name, value in body.items():
        if name in known and not has_type(value, known[name]):
            kinds = known[name] if isinstance(known[name], tuple) else (known[name],)
            raise BatchLineError(f"{name} must be {' or '.join(kinds)}, got {value!r}")


def check_n(body: dict, max_num_seqs: int):
    """n bounded by the sequences the engine runs at once, checked before a sequence is made: a huge n would
    fill the memory with them."""
    n = body.get("n", 1)
    if n > max_num_seqs:
        raise BatchLineError(f"n={n} exceeds max_num_seqs={max_num_seqs}, the sequences the engine runs at once")


def has_type(value, kinds) -> bool:
    if isinstance(kinds, tuple):
        return any(has_type(value, kind) for kind in kinds)
    if isinstance(value, bool):
        return kinds == BOOL
    python_types = {NUMBER: (int, float), INT: int, BOOL: bool, TEXT: str, LIST: list, DICT: dict}
    return isinstance(value, python_types[kinds]) and (kinds != NUMBER or is_finite(value))


def is_finite(number: int | float) -> bool:
    """Not NaN or infinite, nor an integer past a float's range: Python's JSON reader lets these through."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def single_prompt(prompt) -> str | list[int]:
    """A text or token ids; OpenAI's list of one prompt counts as that prompt."""
    if prompt is None:
        raise ValueError("the body has no prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        raise ValueError(f"prompt holds {len(prompt)} prompts: give each its own line")
    return prompt


def sampling_kwargs(url: str, body: dict, num_prompt_tokens: int, max_model_len: int) -> dict:
    """SamplingParams' arguments. A chat reply without max_tokens may run to max_model_len
    (max_tokens=None, which the engine checks); an explicit max_tokens that would run past it is
    refused, as OpenAI does (the engine itself would stop the reply there)."""
    kwargs = {name: body[name] for name in SAMPLING_FIELDS if name in body}
    if url == COMPLETIONS:
        max_tokens = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        kwargs["logprobs"] = body.get("logprobs")
        if kwargs["logprobs"] is not None and not 0 <= kwargs["logprobs"] <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {kwargs['logprobs']}")
    else:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        kwargs["logprobs"] = chat_logprobs(body)
    if max_tokens is not None and num_prompt_tokens <= max_model_len < num_prompt_tokens + max_tokens:
        raise ValueError(f"the prompt's {num_prompt_tokens} tokens and max_tokens={max_tokens} exceed "
                         f"max_model_len={max_model_len}: shorten the prompt or lower max_tokens")
    return {**kwargs, "max_tokens": max_tokens, "structured_outputs": structured_outputs(body)}


def chat_logprobs(body: dict) -> int | None:
    """SamplingParams.logprobs from a chat body's `logprobs` (a flag) and `top_logprobs` (how many)."""
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise ValueError("top_logprobs needs logprobs: true")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return (top or 0) if body.get("logprobs") else None


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """vLLM's: the body's `structured_outputs` (StructuredOutputsParams' fields), whose constraint may come from
    OpenAI's `response_format` instead (its options, such as disable_any_whitespace, then still apply); both
    giving a constraint is refused. Whether the constraint compiles is the engine's to say when the line is added."""
    fields = {name: value for name, value in body.get("structured_outputs", {}).items() if value is not None}
    constraint = response_format_constraint(body.get("response_format"))
    given = [name for name in CONSTRAINTS if fields.get(name) not in (None, False)]
    if constraint and given:
        raise ValueError(f"response_format and structured_outputs' {given[0]} both constrain the output: give one")
    if "structured_outputs" not in body and not constraint:
        return None
    return structured_outputs_params({**fields, **constraint})


def response_format_constraint(response_format: dict | None) -> dict:
    """StructuredOutputsParams' constraint of OpenAI's response_format, as vLLM maps it: {} for none or "text"."""
    if response_format is None:
        return {}
    kind = response_format.get("type")
    if kind == "structural_tag":
        return dict(structural_tag=json.dumps(response_format))
    if not isinstance(kind, str) or kind not in RESPONSE_FORMAT_KEYS:
        raise ValueError(f"response_format type {kind!r} is not served: use "
                         f"{', '.join(map(repr, RESPONSE_FORMAT_KEYS))} or 'structural_tag'")
    check_keys(f"response_format of type {kind!r}", response_format, RESPONSE_FORMAT_KEYS[kind])
    if kind != "json_schema":
        return dict(json_object=True) if kind == "json_object" else {}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError(f"response_format json_schema must be an object holding the schema, got {spec!r}")
    check_keys("response_format's json_schema", spec, JSON_SCHEMA_KEYS)
    if spec.get("schema") is None:
        raise ValueError("response_format's json_schema has no schema")
    if not isinstance(spec["schema"], dict):
        raise ValueError(f"response_format's json_schema.schema must be an object, got {spec['schema']!r}")
    return dict(json=spec["schema"])
