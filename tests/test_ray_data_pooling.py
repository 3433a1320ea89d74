"""Ray Data rows embedded and classified: `nanovllm.ray`'s processor with Ray's task_type "embed" and "classify", on
a local Ray cluster of 2 CPUs. The reference is transformers in float32 on the same random checkpoint: an embedding
is the last token's final hidden state, normalised; a classifier's probabilities the softmax of its logits."""
import functools
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from test_ray_data import call, cluster  # noqa: F401 (cluster: the local Ray cluster, a fixture)

from nanovllm.ray import NanoVLLMProcessorConfig, NanoVLLMReplica, build_llm_processor
from nanovllm.ray_pooling import POOLED_COLUMNS, PoolingReplica
from nanovllm.utils.checkpoint import write_random_checkpoint

from conftest import random_prompts, texts

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")

ENGINE_ARGS = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("classifier")), initializer_range=0.1, seed=4,
                                   architecture="Qwen3ForSequenceClassification", num_labels=3)


@functools.cache
def hf_model(path: str, classifier: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_embedding(path: str, prompt: list[int], normalize: bool = True) -> torch.Tensor:
    hidden = hf_model(path).model(torch.tensor([prompt])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0) if normalize else hidden


@torch.inference_mode()
def reference_logits(path: str, prompt: list[int]) -> torch.Tensor:
    return hf_model(path, classifier=True)(torch.tensor([prompt])).logits[0]


def vector(values) -> torch.Tensor:
    """A row's list column, as Ray hands it back (a list or a NumPy array)."""
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


def config(path: str, task_type: str, **kwargs) -> NanoVLLMProcessorConfig:
    return NanoVLLMProcessorConfig(model_source=path, task_type=task_type, engine_kwargs=ENGINE_ARGS,
                                   num_cpus_per_replica=0.5, **kwargs)


def test_embed_rows_are_transformers_normalised_last_hidden_state(cluster, tiny_gqa):  # noqa: F811
    """A Ray user's embed script: "prompt" in, "embeddings" out, each row's own pooling_params; a row with its
    "tokenized_prompt" is embedded from those ids. Every row comes back once; two bad ones carry their errors."""
    from transformers import AutoTokenizer

    items = [{"id": i, "text": text} for i, text in enumerate(texts(14))]
    params = [None, {"use_activation": False}, {"truncate_prompt_tokens": 3}]
    bad = {12: ({"dimensions": 8}, "dimensions=8: the model does not support Matryoshka embeddings"),
           13: (None, "a row needs either 'prompt' (a text or token ids) or 'messages'")}
    processor = build_llm_processor(
        config(tiny_gqa, "embed", batch_size=4),
        preprocess=lambda row: {"id": row["id"], "prompt": None if row["id"] == 13 else row["text"],
                                "tokenized_prompt": [7, 8, row["id"]] if row["id"] % 4 == 3 else None,
                                "pooling_params": bad[row["id"]][0] if row["id"] in bad else params[row["id"] % 3]},
        postprocess=lambda row: {"id": row["id"], "embedding": row["embeddings"], "error": row["error"]})
    got = processor(ray.data.from_items(items)).take_all()

    assert sorted(row["id"] for row in got) == list(range(14))
    tokenizer = AutoTokenizer.from_pretrained(tiny_gqa)
    for row in sorted(got, key=lambda row: row["id"]):
        i = row["id"]
        if i in bad:
            assert row["embedding"] is None and bad[i][1] in row["error"]
            continue
        prompt = [7, 8, i] if i % 4 == 3 else tokenizer.encode(items[i]["text"])
        prompt = prompt[-3:] if i % 3 == 2 else prompt
        want = reference_embedding(tiny_gqa, prompt, normalize=i % 3 != 1)
        assert row["error"] is None and (vector(row["embedding"]) - want).abs().max() < 1e-4, i


def test_classify_rows_are_the_softmax_of_transformers_logits(cluster, classifier):  # noqa: F811
    """A Ray user's classify script reads the probabilities from "embeddings", as Ray's gives them; with
    use_activation=False, the logits themselves."""
    prompts = [[max(t, 3) for t in p] for p in random_prompts([3, 9, 17, 40, 5, 28, 11, 2], seed=7)]  # no pad id
    rows = [{"id": i, "prompt": p, "pooling_params": {"use_activation": False} if i == 5 else None}
            for i, p in enumerate(prompts)]
    rows += [{"id": 8, "prompt": [4] * 300, "pooling_params": None},
             {"id": 9, "prompt": [4, 5], "pooling_params": {"dimensions": 2}}]
    processor = build_llm_processor(config(classifier, "classify", batch_size=3))
    got = {row["id"]: row for row in processor(ray.data.from_items(rows)).take_all()}

    assert sorted(got) == list(range(10))
    for i, prompt in enumerate(prompts):
        logits = reference_logits(classifier, prompt)
        want = logits if i == 5 else logits.softmax(-1)
        assert got[i]["error"] is None and got[i]["num_input_tokens"] == len(prompt)
        assert (vector(got[i]["embeddings"]) - want).abs().max() < 1e-4, i
    assert got[8]["error"] == "the prompt has 300 tokens, longer than max_model_len=256"
    assert got[9]["error"].startswith("dimensions=2: the model does not support Matryoshka embeddings")
    assert [got[i][name] for i in (8, 9) for name in POOLED_COLUMNS[:-1]] == [None] * 4


def test_an_embed_processor_given_sampling_params_stops_naming_them(cluster, tiny_gqa):  # noqa: F811
    """A generate preprocess on an embed processor is a mistake in the script, not in a row: the dataset stops."""
    processor = build_llm_processor(config(tiny_gqa, "embed"), preprocess=lambda row: {
        "prompt": row["item"], "sampling_params": {"temperature": 0, "max_tokens": 8}})
    with pytest.raises(Exception, match="rows give 'sampling_params', which task_type='embed' does not take"):
        processor(ray.data.from_items(texts(4))).take_all()


# --- one replica, called the way Ray calls it ---

@pytest.fixture(scope="module")
def embedder(tiny_gqa):
    replica = PoolingReplica(tiny_gqa, {**ENGINE_ARGS, "runner": "pooling", "convert": "embed"})
    yield replica
    replica.llm.exit()


@contextmanager
def pool_calls(replica):
    """The prompts of each run of requests the replica's engine makes meanwhile."""
    calls, run = [], replica.llm._run

    def recording_run(requests, **kwargs):
        calls.append([request.prompt_token_ids for request in requests])
        return run(requests, **kwargs)
    replica.llm._run = recording_run
    try:
        yield calls
    finally:
        replica.llm._run = run


@pytest.mark.parametrize("row, message", [
    ({"prompt": [5], "pooling_params": {"dimensions": 8}}, "dimensions=8: the model does not support Matryoshka"),
    ({"prompt": None}, "a row needs either 'prompt' (a text or token ids) or 'messages'"),
    ({"prompt": [1] * 300}, "the prompt has 300 tokens, longer than max_model_len=256"),
    ({"prompt": [1, 512]}, "token id 512 outside the vocabulary"),
    ({"tokenized_prompt": "5 6"}, "tokenized_prompt must be a list of token ids, got str"),
    ({"prompt": [1], "pooling_params": {"normalize": True}},
     "pooling_params has no 'normalize'; it takes dimensions, use_activation, truncate_prompt_tokens"),
    ({"prompt": [1], "pooling_params": {"truncate_prompt_tokens": 0}},
     "truncate_prompt_tokens must be None, -1 or >= 1, got 0"),
    ({"prompt": [1], "pooling_params": "dimensions=8"},
     "pooling_params must be a dict of PoolingParams fields, got str"),
])
def test_a_bad_row_gets_its_error_and_the_others_are_one_embed_call(embedder, row, message):
    good = {"prompt": [5, 6, 7]}
    with pool_calls(embedder) as calls:
        out = call(embedder, [good, row, good])
    assert calls == [[[5, 6, 7], [5, 6, 7]]]
    want = embedder.llm.embed([5, 6, 7], use_tqdm=False)[0].outputs.embedding
    for good_out in (out[0], out[2]):
        assert good_out["error"] is None and np.allclose(good_out["embeddings"], want, atol=1e-6)
    assert message in out[1]["error"] and [out[1][name] for name in POOLED_COLUMNS[:-1]] == [None, None]


def test_a_long_row_with_truncate_prompt_tokens_keeps_its_last_tokens(embedder):
    prompt = random_prompts([300], seed=3)[0]
    out, = call(embedder, [{"prompt": prompt, "pooling_params": {"truncate_prompt_tokens": -1}}])
    want = embedder.llm.embed(prompt[-256:], use_tqdm=False)[0].outputs.embedding
    assert out["num_input_tokens"] == 256 and np.allclose(out["embeddings"], want, atol=1e-6)


def test_a_field_of_another_task_is_refused_by_name_before_any_row_runs(embedder, tiny_gqa):
    with pool_calls(embedder) as calls, pytest.raises(
            ValueError, match="rows give 'sampling_params', which task_type='embed' does not take: it is for "
                              "task_type='generate'"):
        call(embedder, [{"prompt": [5]}, {"prompt": [6], "sampling_params": {"max_tokens": 3}}])
    assert calls == []
    generator = NanoVLLMReplica(tiny_gqa, ENGINE_ARGS)
    try:
        with pytest.raises(ValueError, match="rows give 'pooling_params', which task_type='generate' does not take: "
                                             "it is for task_type='embed' or 'classify'"):
            call(generator, [{"prompt": [5], "pooling_params": {"dimensions": 8}}])
        assert generator.llm.scheduler.is_finished() and not generator.waiting
    finally:
        generator.llm.exit()


@pytest.mark.parametrize("task_type, engine_kwargs, message", [
    ("score", {}, "task_type must be one of generate, embed, classify, got 'score'"),
    ("embed", {"runner": "generate"}, "engine_kwargs runner='generate' does not go with task_type='embed', which "
                                      "runs the engine with runner='pooling'"),
    ("embed", {"convert": "classify"}, "engine_kwargs convert='classify' does not go with task_type='embed'"),
    ("generate", {"convert": "embed"}, "engine_kwargs convert='embed' does not go with task_type='generate'"),
])
def test_a_task_type_and_engine_kwargs_that_disagree_are_refused_at_once(task_type, engine_kwargs, message):
    with pytest.raises(ValueError, match=message):
        NanoVLLMProcessorConfig(model_source="unused", task_type=task_type, engine_kwargs=engine_kwargs)
