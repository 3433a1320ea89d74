"""Ray Data: `nanovllm.ray`'s processor on a local Ray cluster of 2 CPUs. The reference is one engine's
`generate` / `chat` on the same prompts, greedy."""
import asyncio
import json
import re

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.ray import GENERATED_COLUMNS, NanoVLLMProcessorConfig, NanoVLLMReplica, build_llm_processor

from conftest import texts

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")

ENGINE_ARGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def cluster():
    # address="local": a new cluster of this process's own, even where another one runs.
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def replica(tiny_gqa):
    """A replica built here, called the way Ray calls it; its engine is also the tests' reference (a process
    holds one engine at a time)."""
    replica = NanoVLLMReplica(tiny_gqa, ENGINE_ARGS)
    yield replica
    replica.llm.exit()


@pytest.fixture(scope="module")
def llm(replica) -> LLM:
    return replica.llm


def config(tiny_gqa, **kwargs):
    # Half a CPU each leaves one of the cluster's two for the tasks that read and map rows.
    return NanoVLLMProcessorConfig(model_source=tiny_gqa, engine_kwargs=ENGINE_ARGS, num_cpus_per_replica=0.5,
                                   **kwargs)


def test_two_replicas_give_one_engines_greedy_tokens(cluster, llm, tiny_gqa):
    prompts = texts(300)
    rows = [{"id": i, "prompt": p, "sampling_params": {"temperature": 0, "max_tokens": 4 + i % 5}}
            for i, p in enumerate(prompts)]
    processor = build_llm_processor(config(tiny_gqa, concurrency=2, batch_size=16))
    got = sorted(processor(ray.data.from_items(rows)).take_all(), key=lambda row: row["id"])

    want = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=4 + i % 5) for i in range(300)],
                        use_tqdm=False)
    assert [row["id"] for row in got] == list(range(300))
    assert all(row["prompt"] == p for row, p in zip(got, prompts))  # the input columns are kept
    assert [list(row["generated_tokens"]) for row in got] == [o.outputs[0].token_ids for o in want]
    assert [row["generated_text"] for row in got] == [o.outputs[0].text for o in want]
    assert [row["num_input_tokens"] for row in got] == [len(o.prompt_token_ids) for o in want]
    assert [row["num_generated_tokens"] for row in got] == [len(o.outputs[0].token_ids) for o in want]
    assert all(row["error"] is None for row in got)


def test_chat_rows_through_preprocess_and_postprocess_and_a_bad_row(cluster, llm, tiny_gqa):
    questions = texts(12) + ["x " * 300]  # the last one is longer than max_model_len
    processor = build_llm_processor(
        config(tiny_gqa, batch_size=4),
        preprocess=lambda row: {"question": row["item"], "messages": [{"role": "user", "content": row["item"]}],
                                "sampling_params": {"temperature": 0, "max_tokens": 6}},
        postprocess=lambda row: {"question": row["question"], "answer": row["generated_text"], "error": row["error"]})
    got = {row["question"]: row for row in processor(ray.data.from_items(questions)).take_all()}

    want = llm.chat([[{"role": "user", "content": q}] for q in questions[:-1]],
                    SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [got[q]["answer"] for q in questions[:-1]] == [o.outputs[0].text for o in want]
    assert all(got[q]["error"] is None for q in questions[:-1])
    bad = got[questions[-1]]
    assert bad["answer"] is None and bad["error"].endswith("tokens, longer than max_model_len=256")


# --- one replica, called the way Ray calls it ---

GREEDY = {"temperature": 0, "max_tokens": 3}


def table(rows: list[dict]):
    """A batch as Ray hands it over: every row has every column, None where it had no value."""
    columns = dict.fromkeys(key for row in rows for key in row)
    return pa.Table.from_pylist([{**columns, **row} for row in rows])


def call(replica, *batches: list[dict]) -> list[dict]:
    """The replica's output rows for batches handed to it at once, as Ray's event loop calls it."""
    async def together():
        return await asyncio.gather(*(replica(table(rows)) for rows in batches))
    return [row for out in asyncio.run(together()) for row in out.to_pylist()]


@pytest.mark.parametrize("row, message", [
    ({"prompt": [1] * 300}, "the prompt has 300 tokens, longer than max_model_len=256"),
    ({"prompt": [1, 512]}, "token id 512 outside the vocabulary"),
    ({"prompt": None}, "a row needs either 'prompt' (a text or token ids) or 'messages'"),
    ({"prompt": [1], "sampling_params": {"temperature": -1}}, "temperature must be >= 0"),
    ({"prompt": [1], "sampling_params": {"best_of": 2}}, "sampling_params has unknown field(s) best_of"),
    ({"prompt": [1], "sampling_params": {"n": 2}}, "n must be 1: a row holds one completion, got 2"),
    ({"messages": [{"role": "user"}]}, "the conversation, message 0 must be a {'role', 'content'} message"),
    ({"messages": "hello"}, "the conversation must be a non-empty list"),
    ({"prompt": [1], "sampling_params": {"top_p": "high"}}, "top_p must be a number, got 'high'"),
    ({"prompt": [1], "sampling_params": {"structured_outputs": {"regexp": "a"}}},
     "sampling_params' structured_outputs has no 'regexp'; it takes json, regex"),
    ({"prompt": [1], "sampling_params": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
     "structured outputs take exactly one constraint of json, regex, choice, grammar, json_object, structural_tag; "
     "got regex and choice"),
    ({"prompt": [1], "sampling_params": {"structured_outputs": {"choice": []}}},
     "structured outputs' choice must be a non-empty list of strings, got []"),
    ({"prompt": [1], "sampling_params": {"structured_outputs": {"regex": "[0-9"}}},
     "the prompt's structured outputs regex cannot be compiled"),
    ({"prompt": [1], "sampling_params": {"structured_outputs": {"json": {"type": "nonsense"}}}},
     "the prompt's structured outputs json cannot be compiled"),
    ({"prompt": [1], "sampling_params": {"structured_outputs": '{"regex": "[0-9"'}}, "structured_outputs is not JSON"),
    ({"prompt": [1], "sampling_params": {"structured_outputs": '["a"]'}},
     "structured_outputs must be a dict of StructuredOutputsParams fields or its JSON text, got list"),
    ({"prompt": [1], "sampling_params": {"structured_outputs": 5}},
     "structured_outputs must be a dict of StructuredOutputsParams fields or its JSON text, got int"),
])
def test_a_bad_row_gets_an_error_and_the_others_complete(replica, row, message):
    good = {"prompt": [5, 6, 7], "sampling_params": GREEDY}
    rows = [good, {"sampling_params": GREEDY, **row}, good]
    out = call(replica, rows)
    assert [set(r) >= set(GENERATED_COLUMNS) for r in out] == [True] * 3
    assert out[0]["error"] is None and out[2]["error"] is None and len(out[0]["generated_tokens"]) == 3
    assert out[1]["error"] == message or message in out[1]["error"]
    assert [out[1][name] for name in GENERATED_COLUMNS[:-1]] == [None] * 4


@pytest.mark.parametrize("prompt", [{"prompt_token_ids": 5}, {"prompt_token_ids": None}])
def test_a_row_that_fails_in_any_way_gets_its_error_and_the_other_batch_completes(replica, prompt):
    """A prompt dict whose token ids are no list fails inside the engine's parsing with something other than a
    ValueError: still that row's error alone. (Its batch is its own: Arrow cannot hold it in one column with a
    list.)"""
    bad, good = call(replica, [{"prompt": prompt, "sampling_params": GREEDY}], [{"prompt": [5, 6, 7],
                                                                               "sampling_params": GREEDY}])
    assert bad["error"] and [bad[name] for name in GENERATED_COLUMNS[:-1]] == [None] * 4
    assert good["error"] is None and len(good["generated_tokens"]) == 3
    assert not replica.waiting and replica.llm.scheduler.is_finished()


def test_rows_of_token_ids_and_arrows_filled_in_keys(replica, llm):
    """Arrow gives every row every key its column has seen: None stands for a default."""
    rows = [{"prompt": [5, 6, 7], "sampling_params": {"temperature": 0, "max_tokens": 4, "stop": None}},
            {"prompt": [8, 9], "sampling_params": {"temperature": None, "max_tokens": 2, "stop": ["zz"]}}]
    out = call(replica, rows)
    assert out[0]["generated_tokens"] == llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4),
                                                      use_tqdm=False)[0].outputs[0].token_ids
    assert out[1]["num_generated_tokens"] <= 2 and out[1]["num_input_tokens"] == 2


def test_logit_bias_as_json_and_arrow_hold_it(replica, llm):
    """Token ids come as texts (JSON's keys, Arrow's field names), and each row holds every id of the column."""
    rows = [{"prompt": [5, 6], "sampling_params": {**GREEDY, "logit_bias": {"42": 100.0}}},
            {"prompt": [5, 6], "sampling_params": {**GREEDY, "logit_bias": {"7": 100.0, "9": -5.0}}}]
    out = call(replica, rows)
    want = llm.generate([[5, 6]] * 2, [SamplingParams(**GREEDY, logit_bias={42: 100.0}),
                                       SamplingParams(**GREEDY, logit_bias={7: 100.0, 9: -5.0})], use_tqdm=False)
    assert [r["error"] for r in out] == [None, None]
    assert [r["generated_tokens"] for r in out] == [o.outputs[0].token_ids for o in want]


def test_replicas_ask_for_tensor_parallel_size_gpus_only_on_gpus(cluster):
    from nanovllm.ray import num_gpus_per_replica

    assert num_gpus_per_replica({"device": "cuda", "tensor_parallel_size": 2}) == 2
    assert num_gpus_per_replica({"device": "cpu", "tensor_parallel_size": 2}) == 0
    assert num_gpus_per_replica({}) == 0  # "auto" in a cluster with no GPUs


# --- several batches in one replica ---

def test_batches_in_flight_share_the_engine_and_return_every_row_once(replica, llm):
    """Three batches handed over at once: the engine holds rows of several at a time, and each batch comes
    back whole, in its order, with generate's greedy tokens."""
    batches = [[{"id": f"{b}-{i}", "prompt": [5 + b, 6 + i, 7],
                 "sampling_params": {"temperature": 0, "max_tokens": 2 + 3 * i}} for i in range(4)] for b in range(3)]
    most_waiting, step = 0, llm.step

    def counting_step():
        nonlocal most_waiting
        most_waiting = max(most_waiting, len(replica.waiting))
        return step()
    llm.step = counting_step
    try:
        out = call(replica, *batches)
    finally:
        del llm.step
    rows = [row for batch in batches for row in batch]
    assert [r["id"] for r in out] == [row["id"] for row in rows]
    want = llm.generate([row["prompt"] for row in rows],
                        [SamplingParams(**row["sampling_params"]) for row in rows], use_tqdm=False)
    assert [r["generated_tokens"] for r in out] == [o.outputs[0].token_ids for o in want]
    assert most_waiting > 4  # more than one batch's rows in the engine at once
    assert not replica.waiting and llm.scheduler.is_finished()


class DiesOnce(NanoVLLMReplica):
    """A replica whose process exits in the middle of its first batch, once in the whole test (a marker
    file says it has)."""

    marker = None

    async def __call__(self, batch):
        import os
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            self.submit(batch.to_pylist()[0])
            self.llm.step()
            os._exit(1)
        return await super().__call__(batch)


def test_a_replica_that_dies_mid_batch_is_retried_without_lost_or_repeated_rows(cluster, tiny_gqa, tmp_path):
    import sys

    import ray.cloudpickle
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    DiesOnce.marker = str(tmp_path / "died")
    rows = [{"id": i, "prompt": [3, 4, i % 50], "sampling_params": {"temperature": 0, "max_tokens": 3}}
            for i in range(40)]
    processor = build_llm_processor(config(tiny_gqa, batch_size=8, max_concurrent_batches=2))
    processor.replica_class = DiesOnce
    got = processor(ray.data.from_items(rows)).take_all()
    assert (tmp_path / "died").exists()
    assert sorted(row["id"] for row in got) == list(range(40))
    assert all(row["error"] is None and len(row["generated_tokens"]) == 3 for row in got)


def test_a_cancelled_batch_leaves_the_others_and_the_engine_whole(replica, llm):
    """Ray cancels a batch's call (its task failed elsewhere): that batch's rows leave the engine, the other
    batch still gets generate's tokens, and nothing is left waiting."""
    long_rows = [{"prompt": [5, 6, i], "sampling_params": {"temperature": 0, "max_tokens": 30}} for i in range(3)]
    short_rows = [{"prompt": [7, 8, i], "sampling_params": {"temperature": 0, "max_tokens": 4}} for i in range(3)]

    async def one_cancelled():
        doomed = asyncio.ensure_future(replica(table(long_rows)))
        kept = asyncio.ensure_future(replica(table(short_rows)))
        await asyncio.sleep(0.2)
        doomed.cancel()
        return await kept
    out = asyncio.run(one_cancelled()).to_pylist()
    want = llm.generate([r["prompt"] for r in short_rows], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [r["generated_tokens"] for r in out] == [o.outputs[0].token_ids for o in want]
    assert not replica.waiting and not llm.requests and llm.scheduler.is_finished()


# --- structured outputs: the references are json.loads with jsonschema, and re.fullmatch ---

SCHEMA = {"type": "object", "properties": {"size": {"enum": ["small", "large"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["size", "count"], "additionalProperties": False}
# Merged with SCHEMA in one Arrow column, each "count" gets the other's keys as None, which no schema may hold.
OTHER_SCHEMA = {"type": "object", "required": ["count", "tags"], "additionalProperties": False,
                "properties": {"count": {"enum": [1, 2]},
                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}


def validates(schema):
    import jsonschema
    return lambda text: jsonschema.validate(json.loads(text), schema) is None


# Each output is short whatever a random model samples: every one must end before max_tokens and satisfy its row's.
CONSTRAINED = [  # (a row's structured_outputs, whether an output text satisfies it)
    ({"regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text)),
    ({"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ({"json": SCHEMA, "disable_any_whitespace": True}, validates(SCHEMA)),
    ({"json": OTHER_SCHEMA, "disable_any_whitespace": True}, validates(OTHER_SCHEMA)),
    ({"grammar": 'root ::= ("a" | "b") ("c" | "d")'}, lambda text: re.fullmatch("[ab][cd]", text)),
]


def constrained_row(i, structured_outputs):
    return {"prompt": [5, 6, i], "sampling_params": {"seed": i, "max_tokens": 48,
                                                      "structured_outputs": structured_outputs}}


def test_rows_are_constrained_by_their_own_structured_outputs(replica, llm):
    """One batch of dicts, whose schemas Arrow merges into one struct (each row's schema then holds the other's keys
    as None), one of JSON texts; an unconstrained row between them is `generate`'s."""
    as_dicts = [constrained_row(i, so) for i, (so, _) in enumerate(CONSTRAINED)]
    free = {"prompt": [5, 6, 99], "sampling_params": {"seed": 3, "max_tokens": 8, "ignore_eos": True}}
    as_texts = [constrained_row(i, json.dumps(so)) for i, (so, _) in enumerate(CONSTRAINED)]
    out = call(replica, [*as_dicts[:2], free, *as_dicts[2:]], as_texts)
    free_out, constrained = out[2], out[:2] + out[3:]
    for row, (so, satisfies) in zip(constrained, CONSTRAINED * 2):
        assert row["error"] is None and satisfies(row["generated_text"]), (so, row["generated_text"])
        assert row["num_generated_tokens"] < 48
    want = llm.generate([5, 6, 99], SamplingParams(seed=3, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert free_out["generated_tokens"] == want.outputs[0].token_ids


def test_structured_outputs_through_the_processor(cluster, tiny_gqa):
    """Rows whose constraints differ, as JSON text (one Arrow type for any constraint), set by a preprocess."""
    kinds = [(json.dumps({"choice": ["red", "green"]}), "red|green"),
             (json.dumps({"regex": "[a-c]{2}-[0-9]"}), "[a-c]{2}-[0-9]")]
    processor = build_llm_processor(
        config(tiny_gqa, batch_size=4),
        preprocess=lambda row: {"id": row["id"], "prompt": row["text"], "sampling_params": {
            "seed": row["id"], "max_tokens": 16, "structured_outputs": kinds[row["id"] % 2][0]}})
    got = processor(ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts(8))])).take_all()
    assert sorted(row["id"] for row in got) == list(range(8))
    for row in got:
        assert row["error"] is None and re.fullmatch(kinds[row["id"] % 2][1], row["generated_text"]), row
