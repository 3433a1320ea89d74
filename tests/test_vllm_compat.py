"""What vLLM's examples and docs use beyond generate(), against vLLM's documented behaviour: EngineArgs and
its flags, generation_config, get_metrics(), the profiler's errors, prompt types, SamplingParams.from_optional,
lora_request and priority at their defaults, logprobs=-1, reset_prefix_cache(reset_running_requests=...),
and four behaviours (greedy requests draw no random numbers; an unfinished last character is dropped; the
first stop string of the list wins; run_batch's choices carry stop_reason)."""
import dataclasses
import json
import math
import shutil

import pytest

from nanovllm import LLM, EngineArgs, LLMEngine, SamplingParams
from nanovllm.config import Config
from nanovllm.engine.arg_utils import VLLM_ARGS
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.utils import FlexibleArgumentParser

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=256, dtype="float32", device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


# --- EngineArgs and its flags ---

def test_engine_args_are_configs_fields_and_vllms():
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    assert names == [f.name for f in dataclasses.fields(Config) if f.init] + list(VLLM_ARGS)
    # max_num_batched_tokens: None, as vLLM's, until the engine's config resolves it (16384, or 32768 to pool)
    assert EngineArgs().model == "Qwen/Qwen3-0.6B" and EngineArgs().max_num_batched_tokens is None


def test_flags_take_dashes_or_underscores_and_no_prefix():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    dashes = parser.parse_args(["--max-model-len", "300", "--no-enable-prefix-caching", "--enforce-eager"])
    underscores = parser.parse_args(["--max_model_len=300", "--no-enable_prefix_caching", "--enforce_eager"])
    assert vars(dashes) == vars(underscores)
    assert (dashes.max_model_len, dashes.enable_prefix_caching, dashes.enforce_eager) == (300, False, True)
    assert parser.parse_args(["--pipeline-parallel-size", "1"]).pipeline_parallel_size == 1  # a vLLM int flag
    assert parser.parse_args(["--profiler-config", '{"profiler": "torch"}']).profiler_config == {"profiler": "torch"}


def test_every_flag_reaches_the_engine(tiny_gqa):
    """LLM(**vars(args)) takes exactly what add_cli_args added; from_engine_args builds the same engine."""
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", tiny_gqa, "--device", "cpu", "--dtype", "float32", "--num-kvcache-blocks", "32",
         "--kvcache-block-size", "16", "--max-model-len", "128"])
    with LLM(**vars(args)) as llm:
        want = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        assert engine.config.max_model_len == 128 and engine.config.num_kvcache_blocks == 32
        engine.add_request("a", [1, 2, 3], GREEDY)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert outputs[-1].outputs[0].token_ids == want
    finally:
        engine.exit()


# --- generation_config ---

def test_generation_config_auto_vllm_or_a_folder(tiny_gqa, tmp_path):
    model = shutil.copytree(tiny_gqa, tmp_path / "model")
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.3, "top_k": 7}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "temperature": None}))  # null: unset
    defaults = {}
    for source in ("auto", "vllm", str(other)):
        with LLM(str(model), generation_config=source, **ENGINE_ARGS) as llm:
            params = llm.get_default_sampling_params()
            defaults[source] = (params.temperature, params.top_k, params.top_p)
    assert defaults == {"auto": (0.3, 7, 1.0), "vllm": (1.0, 0, 1.0), str(other): (1.0, 0, 0.5)}
    with pytest.raises(ValueError, match="generation_config='nowhere' is neither 'auto', 'vllm' nor a folder"):
        LLM(str(model), generation_config="nowhere", **ENGINE_ARGS)


# --- metrics and the profiler ---

def test_metrics_count_tokens_hits_preemptions_and_finished_requests(tiny_gqa):
    from nanovllm.metrics import Counter, Gauge, Histogram
    prompts = [list(range(1, 41)), list(range(1, 41)), [5, 6, 7]]  # the second hits the first's two full blocks
    with LLM(tiny_gqa, **{**ENGINE_ARGS, "num_kvcache_blocks": 8, "max_model_len": 128}) as llm:  # too few for all
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    value = {name: m.value for (name, _), m in metrics.items() if isinstance(m, Counter | Gauge)}
    assert value["vllm:prompt_tokens"] == 83 and value["vllm:generation_tokens"] == 120
    assert metrics["vllm:request_success", "length"].value == 3
    assert value["vllm:num_preemptions"] > 0 and value["vllm:num_requests_running"] == 0
    assert value["vllm:prefix_cache_queries"] >= 83 and value["vllm:prefix_cache_hits"] >= 32
    ttft = metrics["vllm:time_to_first_token_seconds", None]
    assert isinstance(ttft, Histogram) and ttft.count == 3 and ttft.buckets["+Inf"] == 3
    e2e = metrics["vllm:e2e_request_latency_seconds", None]
    latest = max(o.metrics.finished_time - o.metrics.arrival_time for o in outputs)
    assert e2e.sum <= 3 * latest + 1e-6


def test_profiler_errors_name_the_fix(llm, tiny_gqa):
    with pytest.raises(RuntimeError, match="profiler is not enabled"):
        llm.start_profile()
    with pytest.raises(ValueError, match="profiler_config="):
        LLM(tiny_gqa, profiler_config={"profiler": "cuda"}, **ENGINE_ARGS)


# --- prompts, SamplingParams, generate()'s vLLM arguments ---

def test_prompt_types_and_from_optional(llm):
    text = llm.generate([TextPrompt(prompt="hello world")], GREEDY, use_tqdm=False)[0]
    tokens = llm.generate([TokensPrompt(prompt_token_ids=text.prompt_token_ids)], GREEDY, use_tqdm=False)[0]
    assert tokens.outputs[0].token_ids == text.outputs[0].token_ids
    params = SamplingParams.from_optional(temperature=None, top_p=0.5, max_tokens=None, seed=None)
    assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (1.0, 0.5, 64, None)


def test_lora_request_and_priority_at_their_defaults_only(llm):
    llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=None, priority=[0])
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match=r"priority=\[1\] is not supported"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.add_request("x", [1, 2], GREEDY, lora_request="adapter")
    assert llm.scheduler.is_finished()


def test_logprobs_minus_one_gives_the_whole_vocabulary(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, logprobs=-1), use_tqdm=False)[0]
    vocab_size = llm.config.hf_config.vocab_size
    for position in out.outputs[0].logprobs:
        assert len(position) == vocab_size
        assert abs(math.log(sum(math.exp(lp.logprob) for lp in position.values()))) < 1e-4  # a distribution
        assert sorted(lp.rank for lp in position.values()) == list(range(1, vocab_size + 1))


# --- reset_prefix_cache ---

def test_reset_prefix_cache_with_running_requests(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([[3, 4, 5] * 12, [9, 8]], params, use_tqdm=False)]
    llm.add_request("a", [3, 4, 5] * 12, params)
    llm.add_request("b", [9, 8], params)
    outputs = llm.step() + llm.step() + llm.step()
    assert llm.reset_prefix_cache() is False  # blocks in use
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    while llm.has_unfinished_requests():
        outputs += llm.step()
    final = {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}
    assert [final["a"], final["b"]] == want


# --- behaviours ---

def test_greedy_requests_draw_no_random_numbers(tiny_gqa):
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        fresh = llm.generate([[5, 6, 7]], sampled, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        llm.generate([[9, 9, 9], [1, 2]], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)
        after_greedy = llm.generate([[5, 6, 7]], sampled, use_tqdm=False)[0].outputs[0].token_ids
    assert after_greedy == fresh


def lone_byte_token(tokenizer) -> int:
    """A token that is one byte of a multi-byte character: alone it decodes to U+FFFD."""
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")


def test_an_unfinished_last_character_is_dropped_with_or_without_stop_strings(llm):
    token = lone_byte_token(llm.tokenizer)
    texts = [llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=2, allowed_token_ids=[token], stop=stop),
                          use_tqdm=False)[0].outputs[0].text for stop in (None, ["zzz"])]
    assert texts == ["", ""]


def test_the_first_stop_string_of_the_list_wins(llm):
    from nanovllm.engine.detokenizer import IncrementalDetokenizer
    token_ids = llm.tokenizer.encode("the model reads")
    for stop, kept in ((["reads", "model reads"], "the model "), (["model reads", "reads"], "the ")):
        detokenizer = IncrementalDetokenizer(llm.tokenizer, [], True, stop)
        found = [detokenizer.add(t) for t in token_ids]
        assert (found[-1], detokenizer.text) == (stop[0], kept)


def test_vllms_flags_that_take_no_value_or_a_float(tiny_gqa):
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", tiny_gqa, "--disable-log-stats", "--disable_custom_all_reduce", "--cpu-offload-gb", "0.0",
         "--swap-space", "2.5", "--device", "cpu", "--dtype", "float32", "--num-kvcache-blocks", "32",
         "--kvcache-block-size", "16", "--max-model-len", "128"])
    assert (args.disable_log_stats, args.disable_custom_all_reduce, args.cpu_offload_gb, args.swap_space) == \
           (True, True, 0.0, 2.5)
    with LLM(**vars(args)) as llm:
        assert len(llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_a_generation_config_folder_gives_its_end_of_sequence_ids_too(llm, tiny_gqa, tmp_path):
    free = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    stop_at = free.token_ids[0]
    assert free.finish_reason == "length"
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_at]}))
    with LLM(tiny_gqa, generation_config=str(folder), **ENGINE_ARGS) as other:
        out = other.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free.token_ids[:1], "stop")


def test_held_outputs_survive_a_failed_step(llm, monkeypatch):
    """A request finished while reset_prefix_cache drained the steps in flight: its output waits for the
    next step(), and a step that fails to launch does not lose it."""
    llm.add_request("held", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1))
    outputs = llm.step()
    llm.reset_prefix_cache(reset_running_requests=True)
    assert [o.request_id for o in llm.held_outputs] == ["held"]
    llm.add_request("next", [4, 5], SamplingParams(temperature=0, max_tokens=2))
    execute = llm.executor.execute_model
    monkeypatch.setattr(llm.executor, "execute_model", lambda step: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        llm.step()
    monkeypatch.setattr(llm.executor, "execute_model", execute)
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert "held" in {o.request_id for o in outputs if o.finished}


def test_max_num_batched_tokens_defaults_by_runner(tiny_gqa):
    from nanovllm.engine.config_builder import build_config
    assert build_config(tiny_gqa, device="cpu").max_num_batched_tokens == 16384
    assert build_config(tiny_gqa, device="cpu", runner="pooling").max_num_batched_tokens == 32768
    given = build_config(tiny_gqa, device="cpu", runner="pooling", max_num_batched_tokens=64)
    assert given.max_num_batched_tokens == 64
