"""Engine arguments as vLLM takes them: its names and defaults, dtype aliases, max_model_len against the
model's limit, `~` paths, Hugging Face repo ids (from a cache the tests write, offline), and clear errors
for what this engine does not do."""
import json
import os
import re
import shutil

import huggingface_hub
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.arg_utils import make_config
from nanovllm.engine.config_builder import build_config
from nanovllm.utils.checkpoint import write_random_checkpoint

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, device="cpu")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
COMMIT_MAIN, COMMIT_V1 = "a" * 40, "b" * 40


def copy_checkpoint(src: str, dst, skip=()) -> str:
    os.makedirs(dst)
    for name in os.listdir(src):
        if name not in skip:
            shutil.copy(os.path.join(src, name), dst)
    return str(dst)


def greedy(max_tokens=4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# --- vLLM's names and defaults ---

def test_vllm_defaults(tiny_gqa):
    config = build_config(tiny_gqa, device="cpu")
    assert config.seed == 0
    assert config.tokenizer == config.model == tiny_gqa
    assert (config.revision, config.tokenizer_revision, config.quantization) == (None, None, None)
    assert config.trust_remote_code is False


@pytest.mark.parametrize("kwargs", [
    dict(seed=1234), dict(seed=None), dict(trust_remote_code=True),
    # A local folder is read as it is, whatever the revision or download folder, as in transformers.
    dict(revision="main", tokenizer_revision="main"), dict(download_dir="/nonexistent"), dict(hf_token="hf_x"),
])
def test_accepted_engine_args(tiny_gqa, kwargs):
    config = make_config(tiny_gqa, {**kwargs, "device": "cpu"})
    for name, value in kwargs.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize("name, value", [
    ("tokenizer_mode", "auto"), ("skip_tokenizer_init", False), ("load_format", "auto"),
    ("load_format", "safetensors"), ("kv_cache_dtype", "auto"), ("task", "generate"),
    ("pipeline_parallel_size", 1), ("data_parallel_size", 1), ("distributed_executor_backend", "mp"),
    ("distributed_executor_backend", None), ("enable_lora", False), ("cpu_offload_gb", 0),
    ("enable_chunked_prefill", True), ("scheduling_policy", "fcfs"),
    # Knobs for machinery this engine does not have: any value.
    ("swap_space", 16), ("disable_log_stats", False), ("max_seq_len_to_capture", 1024),
    ("disable_custom_all_reduce", True), ("disable_async_output_proc", True),
])
def test_vllm_args_at_the_values_this_engine_runs_as(tiny_gqa, name, value):
    config = make_config(tiny_gqa, {name: value, "device": "cpu"})
    assert config.model == tiny_gqa


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="awq"), "quantization='awq' is not supported; supported: None (the checkpoint's own), 'fp8'"),
    (dict(tokenizer_mode="slow"), "tokenizer_mode='slow' is not supported ('auto' only)"),
    (dict(skip_tokenizer_init=True), "skip_tokenizer_init=True is not supported (False only)"),
    (dict(load_format="pt"), "load_format='pt' is not supported; supported: auto, safetensors, gguf, dummy"),
    (dict(load_format="gguf"), "load_format='gguf' reads a GGUF file, and "),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype='fp8_e5m2' is not supported; supported: auto, fp8"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2 is not supported (1 only): split the model "
                                     "across GPUs with tensor_parallel_size"),
    (dict(enable_lora=True), "enable_lora=True is not supported (False only)"),
    (dict(cpu_offload_gb=4), "cpu_offload_gb=4 is not supported (0 only)"),
    (dict(distributed_executor_backend="ray"), "distributed_executor_backend='ray' is not supported"),
    (dict(enable_chunked_prefill=False), "enable_chunked_prefill=False is not supported"),
    (dict(block_size=16), "'block_size' is called 'kvcache_block_size' in this engine: pass kvcache_block_size=16"),
    (dict(num_gpu_blocks_override=100), "'num_gpu_blocks_override' is called 'num_kvcache_blocks'"),
    (dict(seed="0"), "seed must be an integer or None, got '0'"),
])
def test_refused_engine_args(tiny_gqa, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(tiny_gqa, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len="512"), "max_model_len must be an integer or None, got '512'"),
    (dict(max_num_seqs=2.5), "max_num_seqs must be an integer or None, got 2.5"),
    (dict(enable_prefix_caching="false"), "enable_prefix_caching must be True or False, got 'false'"),
    (dict(enforce_eager=1), "enforce_eager must be True or False, got 1"),
    (dict(tensor_parallel_size=True), "tensor_parallel_size must be an integer, got True"),
    (dict(num_kvcache_blocks=64.0), "num_kvcache_blocks must be an integer, got 64.0"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a number, got '0.5'"),
    (dict(dtype=5), "dtype must be a text or a torch.dtype, got 5"),
    (dict(hf_token=1), "hf_token must be True or False, a text or None, got 1"),
    (dict(profiler_config="torch"), "profiler_config must be a dict or None, got 'torch'"),
    (dict(enable_chunked_prefill=1), "enable_chunked_prefill=1 is not supported (None or True only)"),
    (dict(seed=2**64), f"seed must be None or in [-2**63, 2**64), got {2**64}"),
    (dict(seed=-2**63 - 1), "seed must be None or in [-2**63, 2**64)"),
])
def test_engine_args_of_the_wrong_type_are_refused_by_name(tmp_path, kwargs, message):
    """Before the model is looked up: the folder does not exist."""
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(tmp_path / "nowhere"), **kwargs)


@pytest.mark.parametrize("model", [None, 5])
def test_a_model_that_is_not_a_path_is_refused(model):
    with pytest.raises(ValueError, match=re.escape(f"model must be a text, got {model!r}")):
        LLM(model)


def test_paths_and_whole_numbers_where_a_number_goes_are_taken(tiny_gqa):
    import pathlib
    config = build_config(pathlib.Path(tiny_gqa), tokenizer=pathlib.Path(tiny_gqa), gpu_memory_utilization=1,
                          device="cpu")
    assert (config.model, config.tokenizer, config.gpu_memory_utilization) == (tiny_gqa, tiny_gqa, 1)


def test_refused_before_the_model_is_looked_up(tmp_path):
    with pytest.raises(ValueError, match="quantization='gptq' is not supported"):
        LLM(str(tmp_path / "nowhere"), quantization="gptq")
    with pytest.raises(ValueError, match="enable_lora=True is not supported"):
        LLM(str(tmp_path / "nowhere"), enable_lora=True)


def test_unknown_engine_argument_lists_the_valid_ones(tiny_gqa):
    with pytest.raises(TypeError, match="unknown engine argument 'sed'; valid arguments: .*seed.*swap_space"):
        LLM(tiny_gqa, sed=0)


def test_quantized_checkpoint_is_refused(tiny_gqa, tmp_path):
    path = copy_checkpoint(tiny_gqa, tmp_path / "awq")
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    hf_config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    with pytest.raises(ValueError, match="the checkpoint's quantization 'awq' is not supported; served: Qwen's"):
        build_config(path, device="cpu")


# --- dtype ---

@pytest.mark.parametrize("dtype, torch_dtype", [
    ("half", torch.float16), ("float16", torch.float16), ("float", torch.float32), ("float32", torch.float32),
    ("bfloat16", torch.bfloat16), ("auto", torch.float32),  # the tiny checkpoint is float32
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
])
def test_dtype_names(tiny_gqa, dtype, torch_dtype):
    assert build_config(tiny_gqa, device="cpu", dtype=dtype).torch_dtype == torch_dtype


@pytest.mark.parametrize("dtype", ["fp16", "int8", torch.int8])
def test_bad_dtype(tiny_gqa, dtype):
    with pytest.raises(ValueError, match=re.escape(f"dtype must be 'auto', one of ['bfloat16', 'float', 'float16', "
                                                   f"'float32', 'half'] or a torch dtype of those, got {dtype!r}")):
        build_config(tiny_gqa, device="cpu", dtype=dtype)


# --- max_model_len ---

def test_max_model_len_default_is_capped_by_the_model(tiny_gqa):
    assert build_config(tiny_gqa, device="cpu").max_model_len == 1024  # the tiny model's max_position_embeddings


def test_max_model_len_default_is_4096(tmp_path):
    path = write_random_checkpoint(str(tmp_path), max_position_embeddings=8192)
    assert build_config(path, device="cpu").max_model_len == 4096


@pytest.mark.parametrize("max_model_len", [1, 512, 1024])
def test_max_model_len_up_to_the_model_limit(tiny_gqa, max_model_len):
    assert build_config(tiny_gqa, device="cpu", max_model_len=max_model_len).max_model_len == max_model_len


def test_max_model_len_above_the_model_limit_is_refused(tiny_gqa):
    message = ("User-specified max_model_len (1025) is greater than the derived max_model_len "
               "(max_position_embeddings=1024 in the model's config.json)")
    with pytest.raises(ValueError, match=re.escape(message)):
        build_config(tiny_gqa, device="cpu", max_model_len=1025)


# --- paths ---

def test_home_folder_is_expanded(tiny_gqa, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = copy_checkpoint(tiny_gqa, tmp_path / "huggingface" / "Qwen3-tiny")
    config = build_config("~/huggingface/Qwen3-tiny/", device="cpu")  # as in the README
    assert os.path.samefile(config.model, path)
    assert config.tokenizer == config.model


def test_tokenizer_folder(tiny_gqa, tmp_path, monkeypatch):
    """A model folder without tokenizer files runs with `tokenizer=` another folder (`~` expanded too)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    copy_checkpoint(tiny_gqa, tmp_path / "weights", skip=TOKENIZER_FILES)
    tokenizer = copy_checkpoint(tiny_gqa, tmp_path / "tok", skip=("model.safetensors",))
    with LLM("~/weights", tokenizer="~/tok", **ENGINE_ARGS) as llm:
        assert os.path.samefile(llm.config.tokenizer, tokenizer)
        output = llm.generate("the model reads a prompt", greedy(), use_tqdm=False)[0]
    assert output.prompt_token_ids == llm.tokenizer.encode("the model reads a prompt")
    assert len(output.outputs[0].token_ids) == 4


@pytest.mark.parametrize("name", ["~/nowhere/model", "/nowhere/model", "./nowhere", "a/b/c"])
def test_missing_folder_named_as_a_path(tmp_path, monkeypatch, name):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match=re.escape(f"model folder {name!r} does not exist")):
        build_config(name)


# --- Hugging Face repo ids, offline ---

def write_snapshot(cache, repo_id: str, commit: str, src: str, refs=("main",)) -> str:
    """The Hugging Face cache's layout: models--Org--Name/snapshots/<commit>/<files>, refs/<name> = <commit>."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = copy_checkpoint(src, os.path.join(repo, "snapshots", commit))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)  # no newline: huggingface_hub reads the file as it is
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> str:
    """An empty Hugging Face cache, offline. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, when
    imported, so the tests set its constants as well as the environment."""
    cache = str(tmp_path / "hub")
    os.makedirs(cache)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_repo_id_from_the_cache_offline(tiny_gqa, hf_cache):
    snapshot = write_snapshot(hf_cache, "Org/Name", COMMIT_MAIN, tiny_gqa)
    with LLM("Org/Name", **ENGINE_ARGS) as llm:
        assert os.path.samefile(llm.config.model, snapshot)
        assert llm.config.tokenizer == llm.config.model
        output = llm.generate("hello world", greedy(), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4


def test_repo_revisions(tiny_gqa, hf_cache):
    main = write_snapshot(hf_cache, "Org/Name", COMMIT_MAIN, tiny_gqa)
    v1 = write_snapshot(hf_cache, "Org/Name", COMMIT_V1, tiny_gqa, refs=("v1",))
    config = build_config("Org/Name", revision="v1", device="cpu")
    assert os.path.samefile(config.model, v1) and os.path.samefile(config.tokenizer, v1)
    config = build_config("Org/Name", tokenizer_revision="v1", device="cpu")
    assert os.path.samefile(config.model, main) and os.path.samefile(config.tokenizer, v1)
    assert os.path.samefile(build_config("Org/Name", revision=COMMIT_V1, device="cpu").model, v1)


def test_tokenizer_repo_id(tiny_gqa, hf_cache):
    tokenizer = write_snapshot(hf_cache, "Org/Tokenizer", COMMIT_MAIN, tiny_gqa)
    config = build_config(tiny_gqa, tokenizer="Org/Tokenizer", device="cpu")
    assert config.model == tiny_gqa and os.path.samefile(config.tokenizer, tokenizer)


def test_download_dir_is_the_cache(tiny_gqa, hf_cache, tmp_path):
    snapshot = write_snapshot(tmp_path / "elsewhere", "Org/Name", COMMIT_MAIN, tiny_gqa)
    config = build_config("Org/Name", download_dir=str(tmp_path / "elsewhere"), device="cpu")
    assert os.path.samefile(config.model, snapshot)


def test_repo_id_not_in_the_cache_offline(tiny_gqa, hf_cache):
    write_snapshot(hf_cache, "Org/Name", COMMIT_MAIN, tiny_gqa)
    message = (f"model 'Org/Missing' is neither a local folder nor found in the Hugging Face cache {hf_cache} "
               f"(offline: HF_HUB_OFFLINE is set)")
    with pytest.raises(ValueError, match=re.escape(message)):
        build_config("Org/Missing", device="cpu")
    with pytest.raises(ValueError, match=re.escape("model 'Org/Name' (revision 'v2') is neither a local folder")):
        build_config("Org/Name", revision="v2", device="cpu")


def test_load_format_dummy_needs_no_weight_files(tmp_path, tiny_gqa):
    """vLLM's dummy weights: the checkpoint's config and tokenizer alone, every parameter uniform in
    [-1e-3, 1e-3), the same each start."""
    import shutil

    import torch

    from nanovllm import LLM, SamplingParams
    for name in os.listdir(tiny_gqa):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_gqa, name), tmp_path / name)
    with pytest.raises(ValueError, match="holds no .*safetensors weights"):
        LLM(str(tmp_path), device="cpu")
    runs = []
    for _ in range(2):
        with LLM(str(tmp_path), load_format="dummy", device="cpu", num_kvcache_blocks=16, kvcache_block_size=16,
                 max_model_len=128) as llm:
            weights = torch.cat([p.flatten() for p in llm.executor.model_runner.model.parameters()])
            runs.append(llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                     use_tqdm=False)[0].outputs[0].token_ids)
        assert -1e-3 <= weights.min() < weights.max() < 1e-3 and weights.std() > 1e-4
    assert runs[0] == runs[1] and len(runs[0]) == 8


def test_cuda_asked_for_where_there_is_none_is_refused(tiny_gqa, monkeypatch):
    """Not torch's AssertionError "Torch not compiled with CUDA enabled" from inside the engine."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match=re.escape("device='cuda', but torch finds no CUDA GPU")):
        LLM(tiny_gqa, device="cuda")
