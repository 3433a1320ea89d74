"""Constrained lines in a batch file: OpenAI's `response_format` and vLLM's `structured_outputs` on both urls.
The references are independent of the engine: every output is parsed with `json.loads` and validated with
`jsonschema`, or matched with `re.fullmatch`. The model is random, so the constraints are ones whose every
output is short (enums, bounded integers, fixed-length regexes, choices): an output that ignored its
constraint would not match."""
import json
import re

import jsonschema
import pytest

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.entrypoints.openai_batch import make_request
from nanovllm.run_batch import run_batch

from conftest import read_jsonl

# JSON without whitespace between its tokens: a random model would otherwise wander in it to max_tokens.
ENGINE_ARGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=256,
                   structured_outputs_config=dict(disable_any_whitespace=True))
SCHEMA = {"type": "object", "properties": {"size": {"enum": ["small", "large"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["size", "count"], "additionalProperties": False}
OTHER_SCHEMA = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}
MESSAGES = [{"role": "user", "content": "describe the box"}]


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


def request(custom_id, url="/v1/completions", **body):
    prompt = {"messages": MESSAGES} if url == "/v1/chat/completions" else {"prompt": "describe the box"}
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "tiny", **prompt, "max_tokens": 48, **body}}


def json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "box", "schema": schema, "strict": True}}


def serve(llm, tmp_path, requests) -> dict:
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in requests)
    run_batch(llm, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "tiny", 4, use_tqdm=False)
    return {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}


def texts_of(line, finished=True) -> list[str]:
    """The line's choices' texts; with `finished`, each must have ended of itself, not at max_tokens."""
    assert line["error"] is None, line["error"]
    choices = line["response"]["body"]["choices"]
    assert not finished or all(c["finish_reason"] == "stop" for c in choices), choices
    return [c["text"] if "text" in c else c["message"]["content"] for c in choices]


def generated(llm, line: dict) -> list[str]:
    """What `generate` makes of the request line, through the same prompt and SamplingParams."""
    request = make_request(llm, line)
    output = llm.generate({"prompt_token_ids": request.prompt_token_ids}, request.sampling_params, use_tqdm=False)[0]
    return [c.text for c in output.outputs]


URLS = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("url", URLS)
def test_response_format_json_schema_outputs_validate_against_the_schema(llm, tmp_path, url):
    schemas = [SCHEMA, OTHER_SCHEMA]
    lines = serve(llm, tmp_path, [request(f"s{i}", url, n=2, seed=i, response_format=json_schema_format(schema))
                                  for i, schema in enumerate(schemas)])
    for i, schema in enumerate(schemas):
        for text in texts_of(lines[f"s{i}"]):
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("url", URLS)
def test_json_object_gives_json_objects(llm, tmp_path, url):
    """An object's strings are unbounded, so a random model's output may be cut by max_tokens: those must open
    an object, and every one that ended of itself must be one."""
    lines = serve(llm, tmp_path, [request(f"o{seed}", url, n=3, seed=seed, max_tokens=24,
                                          response_format={"type": "json_object"}) for seed in range(3)])
    choices = [c for line in lines.values() for c in line["response"]["body"]["choices"]]
    texts = [c["text"] if "text" in c else c["message"]["content"] for c in choices]
    assert all(text.startswith("{") for text in texts), texts
    finished = [text for text, c in zip(texts, choices) if c["finish_reason"] == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished), texts


STRUCTURED = [  # (structured_outputs, whether an output text satisfies it)
    ({"regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text)),
    ({"regex": "(yes|no), [a-c]{2}"}, lambda text: re.fullmatch("(yes|no), [a-c]{2}", text)),
    ({"choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"grammar": 'root ::= ("a" | "b") ("c" | "d") "!"'}, lambda text: re.fullmatch("[ab][cd]!", text)),
    ({"json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"json": json.dumps(OTHER_SCHEMA)}, lambda text: jsonschema.validate(json.loads(text), OTHER_SCHEMA) is None),
    ({"json": SCHEMA, "disable_any_whitespace": True, "regex": None},  # null: the default
     lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
]


@pytest.mark.parametrize("url", URLS)
def test_structured_outputs_lines_are_constrained_and_their_neighbours_are_not(llm, tmp_path, url):
    """Each constrained line's outputs satisfy its constraint; a line of response_format "text" between them is
    `generate`'s unconstrained output."""
    requests = [request(f"c{i}", url, n=2, seed=i, structured_outputs=constraint)
                for i, (constraint, _) in enumerate(STRUCTURED)]
    free = dict(seed=9, max_tokens=6, ignore_eos=True)
    lines = serve(llm, tmp_path, [*requests[:3], request("free", url, **free, response_format={"type": "text"}),
                                  *requests[3:]])
    for i, (constraint, satisfies) in enumerate(STRUCTURED):
        assert all(satisfies(text) for text in texts_of(lines[f"c{i}"])), (constraint, texts_of(lines[f"c{i}"]))
    assert texts_of(lines["free"], finished=False) == generated(llm, request("free", url, **free))


def test_the_body_fields_become_structured_outputs_params(llm):
    def constraint(**body):
        return make_request(llm, request("x", **body)).sampling_params.structured_outputs

    assert constraint() is None and constraint(response_format={"type": "text"}) is None
    assert constraint(response_format=json_schema_format(SCHEMA)) == StructuredOutputsParams(json=SCHEMA)
    assert constraint(response_format={"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    assert constraint(structured_outputs={"choice": ["a", "b"]}) == StructuredOutputsParams(choice=["a", "b"])
    # vLLM's: a response_format's constraint with structured_outputs' options
    assert constraint(response_format=json_schema_format(SCHEMA), structured_outputs={"disable_any_whitespace": True}) \
           == StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert constraint(response_format={"type": "text"}, structured_outputs={"regex": "a+"}) == \
           StructuredOutputsParams(regex="a+")
    tag = {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}],
           "triggers": ["<a>"]}
    assert constraint(response_format=tag) == StructuredOutputsParams(structural_tag=json.dumps(tag))
    assert make_request(llm, request("x", response_format=json_schema_format(SCHEMA), temperature=0)).sampling_params \
           == SamplingParams(max_tokens=48, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))


GOOD = request("good", max_tokens=3, temperature=0)
CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("body, message", [
    (dict(response_format="json"), "response_format must be an object, got 'json'"),
    (dict(response_format={"type": "xml"}), "response_format type 'xml' is not served: use 'text', 'json_object', "
                                            "'json_schema' or 'structural_tag'"),
    (dict(response_format={"type": ["json_object"]}), "response_format type ['json_object'] is not served"),
    (dict(response_format={"json_schema": {"schema": SCHEMA}}), "response_format type None is not served"),
    (dict(response_format={"type": "json_schema"}),
     "response_format json_schema must be an object holding the schema, got None"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "box"}}),
     "response_format's json_schema has no schema"),
    (dict(response_format=json_schema_format("object")),
     "response_format's json_schema.schema must be an object, got 'object'"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "box", "schema": SCHEMA, "format": 1}}),
     "response_format's json_schema has no 'format'; it takes"),
    (dict(response_format={"type": "json_object", "schema": SCHEMA}),
     "response_format of type 'json_object' has no 'schema'; it takes type"),
    (dict(structured_outputs="[0-9]+"), "structured_outputs must be an object, got '[0-9]+'"),
    (dict(structured_outputs={"regexp": "[0-9]+"}), "structured_outputs has no 'regexp'; it takes json, regex"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}),
     "structured outputs take exactly one constraint of json, regex, choice, grammar, json_object, structural_tag; "
     "got regex and choice"),
    (dict(structured_outputs={}), "structured outputs take exactly one constraint"),
    (dict(structured_outputs={"disable_any_whitespace": True}), "got none"),
    (dict(structured_outputs={"choice": []}), "choice must be a non-empty list of strings, got []"),
    (dict(structured_outputs={"choice": "red"}), "choice must be list or tuple, got str"),
    (dict(structured_outputs={"json": 5}), "json must be str or dict, got int"),
    (dict(structured_outputs={"regex": "[0-9]+", "whitespace_pattern": " "}), "whitespace_pattern is not supported"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "[0-9]+"}),
     "response_format and structured_outputs' regex both constrain the output: give one"),
    (dict(response_format=json_schema_format(SCHEMA), structured_outputs={"json": SCHEMA}),
     "response_format and structured_outputs' json both constrain the output"),
    # refused by the engine when the line is added: the constraint does not compile
    (dict(structured_outputs={"regex": "[0-9"}), "structured outputs regex cannot be compiled"),
    (dict(structured_outputs={"grammar": "root ::= undefined_rule"}), "structured outputs grammar cannot be compiled"),
    (dict(structured_outputs={"json": "{not json"}), "structured outputs json cannot be compiled"),
    (dict(response_format=json_schema_format({"type": "nonsense"})), "structured outputs json cannot be compiled"),
    (dict(url=CHAT, response_format={"type": "json_schema", "json_schema": {"name": "box"}}),
     "response_format's json_schema has no schema"),
    (dict(url=CHAT, structured_outputs={"regex": "(unclosed"}), "structured outputs regex cannot be compiled"),
])
def test_a_bad_constraint_fails_its_line_alone(llm, tmp_path, body, message):
    lines = serve(llm, tmp_path, [GOOD, request("bad", **body), {**GOOD, "custom_id": "good2"}])
    assert lines["good"]["error"] is None and lines["good2"]["error"] is None
    bad = lines["bad"]
    assert bad["response"] is None and bad["error"]["code"] == "invalid_request"
    assert bad["error"]["message"].startswith("line 2: ") and message in bad["error"]["message"], bad["error"]
