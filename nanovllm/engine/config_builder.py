"""The engine's Config from `LLM(...)`'s settings: the model and tokenizer found on disk (or fetched from the
Hugging Face hub), the model's config.json read and checked, and what "auto" and None leave open filled in from
the model and the device. Every problem is a ValueError naming it, raised before any process starts."""
import os

import torch

from nanovllm.config import Config
from nanovllm.engine.input_processor import GENERATION_DEFAULTS
from nanovllm.engine.pooling import sentence_transformers_pooling
from nanovllm.models.classifier_from_token import resolve_classifier_from_token
from nanovllm.models.registry import check_architecture, is_classifier, split_sizes
from nanovllm.sampling_params import SamplingParams, is_token_id
from nanovllm.utils.folder_checkpoint import check_tokenizer_files, folder_config, read_json
from nanovllm.utils.fp8_weights import scheme_for
from nanovllm.utils.gguf_checkpoint import gguf_config, is_gguf_file, load_tokenizer
from nanovllm.utils.model_path import MODEL_FILES, TOKENIZER_FILES, resolve_model_path
from nanovllm.utils.quantization import check_block_splits, quantization_method

# vLLM's dtype names: "half" is float16 and "float" float32.
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
DEFAULT_MAX_MODEL_LEN = 4096
# vLLM's offline engine runs up to 1024 sequences at once on GPUs of 70 GiB and more, 256 elsewhere.
LARGE_GPU_BYTES, LARGE_GPU_MAX_NUM_SEQS, DEFAULT_MAX_NUM_SEQS = 70 * 2**30, 1024, 256


def build_config(model: str, **settings) -> Config:
    """The Config of `LLM(model, **settings)`, resolved: `model` and `tokenizer` local folders (or a GGUF file),
    `hf_config` the model's, and device, dtype, max_model_len and max_num_seqs as they will run.

    `model` is a local folder (`~` expanded), a GGUF file or a Hugging Face repo id, fetched at `revision` into
    `download_dir` (default: the Hugging Face cache) unless it is cached there, as transformers does; `tokenizer`
    (default: the model's) likewise at `tokenizer_revision`. `max_model_len` defaults to 4096 capped at the model's
    `max_position_embeddings`; a larger explicit value is refused, as in vLLM. On CUDA `dtype='auto'` turns a
    float32 checkpoint into bfloat16."""
    if isinstance(settings.get("tokenizer"), os.PathLike):
        settings["tokenizer"] = os.fspath(settings["tokenizer"])
    config = Config(os.fspath(model) if isinstance(model, os.PathLike) else model, **settings)
    _resolve_paths(config)
    _check_load_format(config)
    _check_generation_config(config)
    config.hf_config = _read_model_config(config)
    if not is_gguf_file(config.tokenizer):
        check_tokenizer_files(config.tokenizer)
    _resolve_device_and_dtype(config)
    _resolve_max_model_len(config)
    check_architecture(config.hf_config, config.max_model_len)
    _resolve_max_num_seqs(config)
    _check_fits_the_device(config)
    _resolve_runner(config)
    if getattr(config.hf_config, "classifier_from_token", None) is not None:
        tokenizer = load_tokenizer(config.tokenizer, trust_remote_code=config.trust_remote_code)
        resolve_classifier_from_token(config.hf_config, tokenizer)
    return config


def _resolve_runner(config: Config):
    """runner and convert as vLLM resolves them: a *ForSequenceClassification checkpoint classifies, a generative
    one embeds where asked; a pooling engine only prefills, so it captures no decode graphs."""
    classifier = is_classifier(config.hf_config)
    if config.runner == "auto":
        config.runner = "pooling" if classifier or config.convert in ("embed", "classify") else "generate"
    if config.runner == "generate" and (classifier or config.convert not in ("auto", "none")):
        what = "a *ForSequenceClassification checkpoint" if classifier else f"convert={config.convert!r}"
        raise ValueError(f"{what} makes a pooling model: give runner='pooling' (or leave it out)")
    if config.convert == "classify" and not classifier:
        raise ValueError(f"convert='classify' needs a *ForSequenceClassification checkpoint (a score head); "
                         f"{', '.join(config.hf_config.architectures)} has none: use convert='embed'")
    if config.runner == "pooling":
        if config.convert in ("auto", "none"):
            config.convert = "classify" if classifier else "embed"
        config.enforce_eager = True
    if config.max_num_batched_tokens is None:  # a pooling engine's prompts fill larger steps: 1.1x at 32768 (H200)
        config.max_num_batched_tokens = 32768 if config.runner == "pooling" else 16384
    _resolve_pooling_type(config)


def _resolve_pooling_type(config: Config):
    """pooler_config's pooling_type, else the sentence-transformers config's, else LAST. MEAN and CLS prefill
    each prompt whole (a step takes max_model_len tokens) and share no prefix: every token's state is pooled."""
    if config.runner != "pooling":
        if config.pooler_config is not None:
            raise ValueError("pooler_config is for an engine made with runner='pooling'")
        return
    own = None if is_gguf_file(config.model) else sentence_transformers_pooling(config.model)
    config.pooling_type = (config.pooler_config or {}).get("pooling_type") or own or "LAST"
    if config.pooling_type != "LAST":
        config.enable_prefix_caching = False
        config.max_num_batched_tokens = max(config.max_num_batched_tokens, config.max_model_len)


def _resolve_paths(config: Config):
    hub = dict(cache_dir=config.download_dir and os.path.expanduser(config.download_dir), token=config.hf_token)
    name = config.model
    if is_gguf_file(name):  # a GGUF file is its own checkpoint and, unless one is named, tokenizer
        config.model = os.path.abspath(os.path.expanduser(name))
        config.tokenizer = config.model if config.tokenizer is None else resolve_model_path(
            config.tokenizer, "tokenizer", config.tokenizer_revision, allow_patterns=TOKENIZER_FILES, **hub)
        return
    config.model = resolve_model_path(name, "model", config.revision, allow_patterns=MODEL_FILES, **hub)
    if config.tokenizer is None and config.tokenizer_revision is None:
        config.tokenizer = config.model
    else:
        config.tokenizer = resolve_model_path(config.tokenizer or name, "tokenizer", config.tokenizer_revision,
                                              allow_patterns=TOKENIZER_FILES, **hub)


def _check_load_format(config: Config):
    """'safetensors' reads a folder, 'gguf' a GGUF file; 'auto' either, and 'dummy' no weight file."""
    gguf = is_gguf_file(config.model)
    if (config.load_format, gguf) in (("safetensors", True), ("gguf", False)):
        wants, given = ("a folder", "a GGUF file") if gguf else ("a GGUF file", "a folder")
        raise ValueError(f"load_format={config.load_format!r} reads {wants}, and {config.model!r} is {given}: "
                         f"give load_format='auto'")


def _check_generation_config(config: Config):
    """The generation_config.json the engine will read (the model's, or that of the folder named) is a JSON object."""
    source = config.generation_config
    if source not in ("auto", "vllm"):
        if not os.path.isfile(os.path.join(os.path.expanduser(source), "generation_config.json")):
            raise ValueError(f"generation_config={source!r} is neither 'auto', 'vllm' nor a folder holding a "
                             f"generation_config.json")
        config.generation_config = os.path.expanduser(source)
    folder = config.model if source in ("auto", "vllm") else config.generation_config
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        _check_generation_values(read_json(path), path, sampling=source != "vllm")


def _check_generation_values(values: dict, path: str, sampling: bool):
    """The end-of-sequence ids and (unless generation_config='vllm') the default sampling params the engine takes
    from a generation_config.json."""
    eos = values.get("eos_token_id")
    if eos is not None and not all(is_token_id(t) for t in (eos if isinstance(eos, list) else [eos])):
        raise ValueError(f"{path!r}: eos_token_id must be a token id or a list of them, got {eos!r}")
    defaults = {name: values[name] for name in GENERATION_DEFAULTS if values.get(name) is not None} if sampling else {}
    try:
        SamplingParams(**defaults)
    except ValueError as error:
        raise ValueError(f"{path!r} gives a default sampling value that is refused: {error}") from error


def _read_model_config(config: Config):
    folder = config.model
    if is_gguf_file(folder):
        hf_config = gguf_config(folder)
    else:
        hf_config = folder_config(folder, config.trust_remote_code)
        if config.load_format != "dummy" and not any(name.endswith(".safetensors") for name in os.listdir(folder)):
            raise ValueError(f"model folder {folder!r} holds no *.safetensors weights")
    for name, value in (config.hf_overrides or {}).items():  # vLLM's hf_overrides, as a dict
        setattr(hf_config, name, value)
    if is_gguf_file(folder) and config.quantization is not None:
        raise ValueError(f"quantization={config.quantization!r} with a GGUF file: its own types are its quantization "
                         f"(leave quantization out)")
    try:
        config.quantization = quantization_method(getattr(hf_config, "quantization_config", None), config.quantization)
    except ValueError as error:
        raise ValueError(f"model {config.model!r}: {error}") from None
    return hf_config


def _resolve_device_and_dtype(config: Config):
    if config.device == "auto":
        config.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda', but torch finds no CUDA GPU (a CPU build of torch, or no GPU visible): "
                         "give device='cpu' or 'auto'")
    if config.dtype == "auto":
        config.torch_dtype = _checkpoint_dtype(config)
    elif config.dtype in DTYPES or config.dtype in DTYPES.values():
        config.torch_dtype = DTYPES.get(config.dtype, config.dtype)
    else:
        raise ValueError(f"dtype must be 'auto', one of {sorted(DTYPES)} or a torch dtype of those, "
                         f"got {config.dtype!r}")
    if config.device == "cuda" and config.torch_dtype == torch.float32 and config.dtype == "auto":
        config.torch_dtype = torch.bfloat16  # a float32 checkpoint runs in bfloat16, as in vLLM


def _checkpoint_dtype(config: Config) -> torch.dtype:
    dtype = getattr(config.hf_config, "dtype", None) or torch.float32
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in DTYPES.values():
        source = config.model if is_gguf_file(config.model) else os.path.join(config.model, "config.json")
        raise ValueError(f"{source!r} gives dtype {dtype}, not one this engine runs: pass dtype='bfloat16', "
                         f"'float16' or 'float32'")
    return dtype


def _resolve_max_model_len(config: Config):
    limit = config.hf_config.max_position_embeddings
    if config.max_model_len is None:
        config.max_model_len = min(DEFAULT_MAX_MODEL_LEN, limit)
    elif config.max_model_len > limit:  # rotary positions past the limit do not exist
        raise ValueError(f"User-specified max_model_len ({config.max_model_len}) is greater than the derived "
                         f"max_model_len (max_position_embeddings={limit} in the model's config.json): "
                         f"give at most {limit}, or leave max_model_len out")


def _resolve_max_num_seqs(config: Config):
    if config.max_num_seqs is None:
        large = config.device == "cuda" and torch.cuda.get_device_properties(0).total_memory >= LARGE_GPU_BYTES
        config.max_num_seqs = LARGE_GPU_MAX_NUM_SEQS if large else DEFAULT_MAX_NUM_SEQS


def _check_fits_the_device(config: Config):
    """The cache's blocks and the model's heads on the device the engine will run on."""
    tp = config.tensor_parallel_size
    if config.device == "cuda" and config.kv_cache_dtype != "auto" and torch.cuda.get_device_capability() < (8, 9):
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} needs a GPU with e4m3 conversions (compute "
                         f"capability 8.9 or later: Ada, Hopper); this one is {torch.cuda.get_device_capability()}")
    for name in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
        size = getattr(config.hf_config, name)
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name}={size}")
    if config.device == "cuda" and tp > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {torch.cuda.device_count()} visible GPUs")
    quantization_config = getattr(config.hf_config, "quantization_config", None)
    if config.device == "cuda" and scheme_for(config.quantization, quantization_config) == "block":
        check_block_splits(split_sizes(config.hf_config), tp)
