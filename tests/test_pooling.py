"""A pooling engine (`LLM(..., runner="pooling")`) on a CPU: `embed` gives each prompt's last-token hidden state,
normalised, as transformers' float32 model computes it (within 1e-4), with many prompts packed in a step, long ones
chunked, prefixes from the cache and two ranks on gloo; `use_activation=False`, Matryoshka `dimensions` and
`truncate_prompt_tokens` as vLLM gives them; and the wrong method for a runner refused by name."""
import json
import os
import shutil

import pytest
import torch

from nanovllm import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams

from conftest import mixed_prompts

ENGINE_ARGS = dict(runner="pooling", device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256,
                   max_num_seqs=16)


@pytest.fixture(scope="module")
def reference(tiny_gqa):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_gqa, dtype=torch.float32).eval()


@torch.inference_mode()
def last_hidden_state(model, prompt: list[int]) -> torch.Tensor:
    """transformers' final hidden state (after the last norm) at the prompt's last token."""
    return model.model(torch.tensor([prompt])).last_hidden_state[0, -1]


def embeddings(outputs) -> list[torch.Tensor]:
    assert all(isinstance(output, EmbeddingRequestOutput) and output.finished for output in outputs)
    return [torch.tensor(output.outputs.embedding) for output in outputs]


@pytest.mark.parametrize("engine_args", [
    dict(),  # every prompt in one step
    dict(max_num_batched_tokens=64),  # long prompts in chunks of up to 64 tokens
    dict(tensor_parallel_size=2),
], ids=["packed", "chunked", "two-ranks"])
def test_embeddings_are_the_last_tokens_normalised_hidden_state(tiny_gqa, reference, engine_args):
    prompts = mixed_prompts()
    with LLM(tiny_gqa, **ENGINE_ARGS, **engine_args) as llm:
        first = embeddings(llm.embed(prompts, use_tqdm=False))
        again = embeddings(llm.embed(prompts[::-1], use_tqdm=False))[::-1]  # from the prefix cache
        assert llm.scheduler.block_manager.hash_to_block_id  # the prompts' full blocks were kept
    for prompt, got, cached in zip(prompts, first, again):
        want = torch.nn.functional.normalize(last_hidden_state(reference, prompt), dim=0)
        assert (got - want).abs().max() < 1e-4 and (cached - want).abs().max() < 1e-4
        assert abs(got.norm().item() - 1) < 1e-6


def test_use_activation_false_gives_the_hidden_state_itself(tiny_gqa, reference):
    prompt = mixed_prompts()[5]
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        got, = embeddings(llm.embed([prompt], PoolingParams(use_activation=False), use_tqdm=False))
    assert (got - last_hidden_state(reference, prompt)).abs().max() < 1e-4


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_gqa, reference):
    prompt = mixed_prompts()[6]
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        output, = llm.embed([prompt], truncate_prompt_tokens=20, use_tqdm=False)
    assert output.prompt_token_ids == prompt[-20:]
    want = torch.nn.functional.normalize(last_hidden_state(reference, prompt[-20:]), dim=0)
    assert (embeddings([output])[0] - want).abs().max() < 1e-4


def test_matryoshka_dimensions_cut_the_hidden_state_then_normalise(tiny_gqa, reference, tmp_path):
    path = shutil.copytree(tiny_gqa, tmp_path / "matryoshka").as_posix()
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "matryoshka_dimensions": [16, 32]}, f)
    prompt = mixed_prompts()[4]
    with LLM(path, **ENGINE_ARGS) as llm:
        got, = embeddings(llm.embed([prompt], PoolingParams(dimensions=16), use_tqdm=False))
        with pytest.raises(ValueError, match=r"dimensions=24: the model does not support Matryoshka embeddings of "
                                             r"that size \(its config lists matryoshka_dimensions=\[16, 32\]"):
            llm.embed([prompt], PoolingParams(dimensions=24))
    want = torch.nn.functional.normalize(last_hidden_state(reference, prompt)[:16], dim=0)
    assert got.shape == (16,) and (got - want).abs().max() < 1e-4


def test_dimensions_on_a_model_without_matryoshka_are_refused(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        with pytest.raises(ValueError, match="dimensions=8: the model does not support Matryoshka embeddings"):
            llm.embed(["hello"], PoolingParams(dimensions=8))
        assert len(llm.embed(["hello"], use_tqdm=False)[0].outputs.embedding) == 64  # the engine still serves


def test_each_method_refuses_the_other_runner_by_name(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        with pytest.raises(ValueError, match=r"generate\(\) needs an engine made with runner='generate'; this one "
                                             r"has runner='pooling'"):
            llm.generate(["hello"], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match=r"chat\(\) needs an engine made with runner='generate'"):
            llm.chat([{"role": "user", "content": "hello"}])
    with LLM(tiny_gqa, device="cpu", num_kvcache_blocks=64) as llm:
        with pytest.raises(ValueError, match=r"embed\(\) needs an engine made with runner='pooling'; this one has "
                                             r"runner='generate'"):
            llm.embed(["hello"])


@pytest.mark.parametrize("arguments, message", [
    (dict(runner="generate", convert="embed"), "convert='embed' makes a pooling model: give runner='pooling'"),
    (dict(runner="classify"), "runner must be one of auto, generate, pooling"),
])
def test_a_runner_and_convert_that_do_not_go_together_are_refused(tiny_gqa, arguments, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_gqa, device="cpu", **arguments)


def test_convert_embed_alone_makes_a_pooling_engine(tiny_gqa):
    with LLM(tiny_gqa, device="cpu", convert="embed", num_kvcache_blocks=64) as llm:
        assert llm.config.runner == "pooling" and llm.config.enforce_eager
        assert len(llm.embed("hello", use_tqdm=False)) == 1


@pytest.mark.parametrize("pooling_params, message", [
    (SamplingParams(), "pooling_params must be a PoolingParams or a list of them, one per prompt; got SamplingParams"),
    ([PoolingParams()], "pooling_params must be a PoolingParams or a list of them, one per prompt; got list for 2"),
    ([PoolingParams(), SamplingParams()], "pooling_params must be a PoolingParams or a list of them, got "
                                          "SamplingParams"),
])
def test_bad_pooling_params_are_refused_before_any_work(tiny_gqa, pooling_params, message):
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        with pytest.raises(ValueError, match=message):
            llm.embed(["a", "b"], pooling_params)
        assert not llm.has_unfinished_requests()


def without_special_ids(prompts: list[list[int]]) -> list[list[int]]:
    """The tiny tokenizer's three special ids (<|endoftext|> is the pad id transformers' classifiers skip) kept out."""
    return [[max(token, 3) for token in prompt] for prompt in prompts]


@pytest.fixture(scope="module", params=["Qwen3ForSequenceClassification", "LlamaForSequenceClassification"])
def classifier(request, tmp_path_factory) -> str:
    from nanovllm.utils.checkpoint import write_random_checkpoint
    return write_random_checkpoint(str(tmp_path_factory.mktemp("classifier")), initializer_range=0.1, seed=4,
                                   architecture=request.param, num_labels=3)


@torch.inference_mode()
def classifier_logits(path: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_batched_tokens=64), dict(tensor_parallel_size=2)],
                         ids=["packed", "chunked", "two-ranks"])
def test_classify_gives_the_softmax_of_the_score_heads_logits(classifier, engine_args):
    prompts = without_special_ids(mixed_prompts())
    with LLM(classifier, **{**ENGINE_ARGS, "runner": "auto"}, **engine_args) as llm:
        assert (llm.config.runner, llm.config.convert) == ("pooling", "classify")
        probs = [torch.tensor(o.outputs.probs) for o in llm.classify(prompts, use_tqdm=False)]
        scores = llm.classify(prompts[:2], PoolingParams(use_activation=False), use_tqdm=False)
    for prompt, got in zip(prompts, probs):
        assert (got - classifier_logits(classifier, prompt).softmax(-1)).abs().max() < 1e-4
    for prompt, output in zip(prompts, scores):
        assert (torch.tensor(output.outputs.probs) - classifier_logits(classifier, prompt)).abs().max() < 1e-4


def test_score_of_an_embedding_engine_is_the_cosine(tiny_gqa, reference):
    first, *others = mixed_prompts()[3:7]
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        one_to_many = llm.score({"prompt_token_ids": first}, [{"prompt_token_ids": p} for p in others],
                                use_tqdm=False)
        pairwise = llm.score([{"prompt_token_ids": p} for p in others[:2]],
                             [{"prompt_token_ids": p} for p in others[1:]], use_tqdm=False)
    hidden = {tuple(p): last_hidden_state(reference, p) for p in [first, *others]}

    def cosine(a, b):
        return torch.nn.functional.cosine_similarity(hidden[tuple(a)], hidden[tuple(b)], dim=0).item()
    assert [round(o.outputs.score, 4) for o in one_to_many] == [round(cosine(first, p), 4) for p in others]
    assert [round(o.outputs.score, 4) for o in pairwise] == [round(cosine(a, b), 4) for a, b in
                                                            zip(others[:2], others[1:])]


def test_score_of_a_cross_encoder_is_the_sigmoid_of_its_score_of_the_pair(tmp_path):
    from transformers import AutoTokenizer

    from nanovllm.utils.checkpoint import write_random_checkpoint
    path = write_random_checkpoint(str(tmp_path), initializer_range=0.1, seed=5,
                                   architecture="Qwen3ForSequenceClassification", num_labels=1)
    queries, documents = "the model reads a prompt", ["keys and values", "a quick brown fox jumps"]
    with LLM(path, **{**ENGINE_ARGS, "runner": "auto"}) as llm:
        scores = [o.outputs.score for o in llm.score(queries, documents, use_tqdm=False)]
        raw = [o.outputs.score for o in llm.score(queries, documents, use_tqdm=False,
                                                  pooling_params=PoolingParams(use_activation=False))]
    tokenizer = AutoTokenizer.from_pretrained(path)
    for document, score, logit in zip(documents, scores, raw):
        want = classifier_logits(path, tokenizer(queries, document)["input_ids"])[0]
        assert abs(logit - want.item()) < 1e-4 and abs(score - torch.sigmoid(want).item()) < 1e-5


def test_pooling_methods_refuse_a_model_that_does_not_give_what_they_need(tiny_gqa, classifier):
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        with pytest.raises(ValueError, match=r"classify\(\) needs convert='classify'; this engine has "
                                             r"convert='embed'"):
            llm.classify(["hello"])
        with pytest.raises(ValueError, match="score\\(\\) pairs one data_1 with each data_2, or each data_1 with its "
                                             "data_2: got 2 and 3"):
            llm.score(["a", "b"], ["c", "d", "e"])
    with LLM(classifier, **{**ENGINE_ARGS, "runner": "auto"}) as llm:
        with pytest.raises(ValueError, match=r"embed\(\) needs convert='embed'; this engine has convert='classify'"):
            llm.embed(["hello"])
        with pytest.raises(ValueError, match="score\\(\\) with a classifier needs one label \\(a cross-encoder\\); "
                                             "this model has 3: use classify\\(\\)"):
            llm.score("a", "b")
    with pytest.raises(ValueError, match="convert='classify' needs a \\*ForSequenceClassification checkpoint"):
        LLM(tiny_gqa, device="cpu", runner="pooling", convert="classify")
    with pytest.raises(ValueError, match="a \\*ForSequenceClassification checkpoint makes a pooling model: give "
                                         "runner='pooling'"):
        LLM(classifier, device="cpu", runner="generate")


def test_an_embedding_models_bare_decoder_file_loads(tiny_mha, tmp_path):
    """Qwen3-Embedding's layout: the decoder's tensors without the `model.` prefix and no LM head (the untied
    checkpoint's head left out); embeddings as the full checkpoint gives them, whose LM head a pooling engine
    skips."""
    from safetensors.torch import load_file, save_file
    bare = shutil.copytree(tiny_mha, tmp_path / "bare").as_posix()
    tensors = load_file(os.path.join(tiny_mha, "model.safetensors"))
    assert "lm_head.weight" in tensors
    save_file({name.removeprefix("model."): tensor for name, tensor in tensors.items() if name != "lm_head.weight"},
              os.path.join(bare, "model.safetensors"))
    prompts = mixed_prompts()[:4]
    got = []
    for path in (tiny_mha, bare):
        with LLM(path, **ENGINE_ARGS) as llm:
            assert not hasattr(llm.executor.model_runner.model, "lm_head")
            got.append(embeddings(llm.embed(prompts, use_tqdm=False)))
    for full, stripped in zip(*got):
        assert torch.equal(full, stripped)


def test_one_label_classifiers_and_token_id_scores(tmp_path, tiny_gqa, reference):
    """A one-label classifier's probability is its sigmoid (vLLM's activation), a cross-encoder scores two token-id
    prompts as their ids joined, and an embedding engine scores plain token-id lists by their cosine, which
    use_activation=False leaves a cosine."""
    from nanovllm.utils.checkpoint import write_random_checkpoint
    path = write_random_checkpoint(str(tmp_path), initializer_range=0.1, seed=5,
                                   architecture="Qwen3ForSequenceClassification", num_labels=1)
    first, second = without_special_ids(mixed_prompts()[2:4])
    with LLM(path, **{**ENGINE_ARGS, "runner": "auto"}) as llm:
        prob, = llm.classify([first], use_tqdm=False)
        score, = llm.score({"prompt_token_ids": first}, {"prompt_token_ids": second}, use_tqdm=False)
    assert abs(prob.outputs.probs[0] - torch.sigmoid(classifier_logits(path, first)[0]).item()) < 1e-5
    assert abs(score.outputs.score - torch.sigmoid(classifier_logits(path, first + second)[0]).item()) < 1e-5
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        scores = [llm.score(first, [second], use_tqdm=False, pooling_params=params)[0].outputs.score
                  for params in (None, PoolingParams(use_activation=False))]
    want = torch.nn.functional.cosine_similarity(last_hidden_state(reference, first),
                                                 last_hidden_state(reference, second), dim=0).item()
    assert abs(scores[0] - want) < 1e-4 and abs(scores[1] - want) < 1e-4


def test_the_step_api_of_a_pooling_engine_takes_pooling_params(tiny_gqa, reference):
    prompt = mixed_prompts()[3]
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        llm.add_request("a", {"prompt_token_ids": prompt})  # the default PoolingParams
        llm.add_request("b", {"prompt_token_ids": prompt}, PoolingParams(use_activation=False))
        with pytest.raises(ValueError, match="an engine made with runner='pooling' takes no SamplingParams"):
            llm.add_request("c", "hello", SamplingParams(max_tokens=4))
        outputs = {}
        while llm.has_unfinished_requests():
            outputs.update({output.request_id: output for output in llm.step()})
        with pytest.raises(ValueError, match=r"generate_as_completed\(\) needs an engine made with "
                                             r"runner='generate'"):
            next(llm.generate_as_completed(["hello"]))
    hidden = last_hidden_state(reference, prompt)
    assert (torch.tensor(outputs["a"].outputs.embedding) - torch.nn.functional.normalize(hidden, dim=0)).abs().max() \
        < 1e-4
    assert (torch.tensor(outputs["b"].outputs.embedding) - hidden).abs().max() < 1e-4


def test_a_reranker_from_hf_overrides_scores_p_yes_of_the_causal_lms_logits(tiny_gqa, tiny_mha):
    """Qwen3-Reranker's vLLM spelling on a causal LM: the score of a pair is P(true token) of the softmax over the
    two tokens' logits at the last position, as transformers' float32 model gives them; with a list of tokens
    and no 2-way method, classify gives the softmax over those tokens' logits. Tied and untied heads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    query, documents = "q: a b c", ["d: a b", "d: c c c", "d: b"]
    for path in (tiny_gqa, tiny_mha):
        tokenizer = AutoTokenizer.from_pretrained(path)
        no, yes = tokenizer.convert_tokens_to_ids(["a", "b"])
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a", "b"]}
        with LLM(path, **{**ENGINE_ARGS, "runner": "auto"},
                 hf_overrides={**overrides, "is_original_qwen3_reranker": True}) as llm:
            scores = [output.outputs.score for output in llm.score(query, documents, use_tqdm=False)]
        with LLM(path, **{**ENGINE_ARGS, "runner": "auto"}, hf_overrides=overrides) as llm:
            probs = llm.classify([query], use_tqdm=False)[0].outputs.probs
        with torch.inference_mode():
            for document, score in zip(documents, scores):
                logits = model(torch.tensor([tokenizer(query, document)["input_ids"]])).logits[0, -1]
                assert abs(score - logits[[no, yes]].softmax(-1)[1].item()) < 1e-5
            logits = model(torch.tensor([tokenizer(query)["input_ids"]])).logits[0, -1]
            assert torch.allclose(torch.tensor(probs), logits[[no, yes]].softmax(-1), atol=1e-5)


def test_a_classifier_from_unknown_tokens_is_refused_by_name(tiny_gqa):
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                 "is_original_qwen3_reranker": True}
    with pytest.raises(ValueError, match="the tokenizer has no token 'no'"):
        LLM(tiny_gqa, **ENGINE_ARGS, hf_overrides=overrides)
    with pytest.raises(ValueError, match=r"two: the false one, then the true one"):
        LLM(tiny_gqa, **ENGINE_ARGS, hf_overrides={**overrides, "classifier_from_token": ["a"]})


def test_encode_gives_embed_and_classify_values_as_tensors(tiny_gqa, reference, classifier):
    from nanovllm import PoolingRequestOutput
    prompt, = without_special_ids(mixed_prompts()[3:4])
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        output, = llm.encode([prompt], pooling_task="embed", use_tqdm=False)
        with pytest.raises(ValueError, match="needs pooling_task, one of 'embed', 'classify'"):
            llm.encode([prompt], use_tqdm=False)
        with pytest.raises(ValueError, match="convert='classify'"):
            llm.encode([prompt], pooling_task="classify", use_tqdm=False)
    assert isinstance(output, PoolingRequestOutput) and isinstance(output.outputs.data, torch.Tensor)
    want = torch.nn.functional.normalize(last_hidden_state(reference, prompt), dim=0)
    assert torch.allclose(output.outputs.data.float(), want, atol=1e-4)
    with LLM(classifier, **{**ENGINE_ARGS, "runner": "auto"}) as llm:
        probs = llm.encode([prompt], pooling_task="classify", use_tqdm=False)[0].outputs.data
    assert torch.allclose(probs.float(), classifier_logits(classifier, prompt).softmax(-1), atol=1e-5)


def sentence_transformers_folder(tiny_gqa: str, tmp_path, modes: dict):
    """sentence-transformers' layout: modules.json names a Pooling module whose config.json sets its mode."""
    folder = shutil.copytree(tiny_gqa, tmp_path / "model")
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_lasttoken": False, **modes}))
    return str(folder)


@torch.inference_mode()
def pooled_reference(model, prompt: list[int], pooling_type: str) -> torch.Tensor:
    states = model.model(torch.tensor([prompt])).last_hidden_state[0]
    pooled = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[pooling_type]
    return torch.nn.functional.normalize(pooled, dim=0)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
@pytest.mark.parametrize("engine_args", [dict(max_num_batched_tokens=64), dict(tensor_parallel_size=2)],
                         ids=["small-steps", "two-ranks"])
def test_mean_and_cls_pooling_from_pooler_config(tiny_gqa, reference, pooling_type, engine_args):
    """vLLM's pooler_config: every token's state, prompts prefilled whole (max_num_batched_tokens is raised to
    max_model_len) and not from the prefix cache, the second pass of the same prompts too."""
    prompts = mixed_prompts()
    with LLM(tiny_gqa, **ENGINE_ARGS, **engine_args, pooler_config={"pooling_type": pooling_type}) as llm:
        assert not llm.config.enable_prefix_caching
        if "max_num_batched_tokens" in engine_args:
            assert llm.config.max_num_batched_tokens == llm.config.max_model_len == 1024
        got = [embeddings(llm.embed(prompts, use_tqdm=False)), embeddings(llm.embed(prompts[::-1], use_tqdm=False))]
    for i, prompt in enumerate(prompts):
        want = pooled_reference(reference, prompt, pooling_type)
        assert (got[0][i] - want).abs().max() < 1e-4 and (got[1][-1 - i] - want).abs().max() < 1e-4


@pytest.mark.parametrize("modes, pooling_type", [({"pooling_mode_lasttoken": True}, "LAST"),
                                                 ({"pooling_mode_mean_tokens": True}, "MEAN"),
                                                 ({"pooling_mode_cls_token": True}, "CLS")])
def test_a_sentence_transformers_config_sets_the_pooling(tiny_gqa, reference, tmp_path, modes, pooling_type):
    prompt = mixed_prompts()[3]
    with LLM(sentence_transformers_folder(tiny_gqa, tmp_path, modes), **ENGINE_ARGS) as llm:
        got = torch.tensor(llm.embed([prompt], use_tqdm=False)[0].outputs.embedding)
    assert (got - pooled_reference(reference, prompt, pooling_type)).abs().max() < 1e-4


def test_other_poolings_are_refused_by_name(tiny_gqa, tmp_path):
    with pytest.raises(ValueError, match="pools by max_tokens .*this engine pools by one of lasttoken"):
        LLM(sentence_transformers_folder(tiny_gqa, tmp_path, {"pooling_mode_max_tokens": True}), **ENGINE_ARGS)
    with pytest.raises(ValueError, match="pooler_config takes pooling_type, one of LAST, MEAN, CLS"):
        LLM(tiny_gqa, **ENGINE_ARGS, pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="pooler_config is for an engine made with runner='pooling'"):
        LLM(tiny_gqa, device="cpu", pooler_config={"pooling_type": "MEAN"})


def test_a_sentence_transformers_dense_projection_is_refused_by_name(tiny_gqa, tmp_path):
    folder = sentence_transformers_folder(tiny_gqa, tmp_path, {"pooling_mode_lasttoken": True})
    modules = json.loads(open(os.path.join(folder, "modules.json")).read())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match="Dense module .*'2_Dense'.*which this engine does not apply"):
        LLM(folder, **ENGINE_ARGS)
