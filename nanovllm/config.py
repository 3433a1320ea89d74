import types
import typing
from dataclasses import dataclass, field, fields

import torch
from transformers import PretrainedConfig

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cuda", "cpu")
QUANTIZATIONS = (None, "fp8", "compressed-tensors")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's; "auto" generates, unless convert asks for pooling
# What a pooling engine gives: "embed", the last token's hidden state; "classify", a *ForSequenceClassification
# checkpoint's score head on it.
CONVERTS = ("auto", "none", "embed", "classify")
# How a pooling engine pools a prompt's hidden states (vLLM's pooling_type): its last token's, their mean, or the
# first token's. MEAN and CLS need every token's state, so they prefill each prompt whole, without the prefix cache.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# vLLM's names: "auto", the model's dtype; "fp8" (or "fp8_e4m3"), e4m3 with a scale per token and head (fp8_kv.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's StructuredOutputsConfig fields and defaults; its backends this engine has (xgrammar, which "auto" picks)
STRUCTURED_OUTPUTS_DEFAULTS = dict(backend="auto", disable_fallback=False, disable_any_whitespace=False,
                                   disable_additional_properties=False)
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")


@dataclass(slots=True)
class Config:
    """Engine settings, with vLLM's names: `LLM(model, **kwargs)` takes any of these fields as keyword arguments
    (and vLLM's arguments of `engine/arg_utils.VLLM_ARGS` at the values this engine runs as). Building one checks
    each value's type, as its field's annotation gives it, and range, nothing more.

    `engine/config_builder.py` makes the engine's: it resolves `model` and `tokenizer` to local folders (or a GGUF
    file), reads the model's config.json into `hf_config` and checks what it asks for, and fills in what "auto" and
    None leave open (`device`, the `torch_dtype` that `dtype` names, `max_model_len`, `max_num_seqs`,
    `max_num_batched_tokens`, `runner` and `convert`).
    """

    model: str
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    trust_remote_code: bool = False
    download_dir: str | None = None
    hf_token: bool | str | None = None
    seed: int | None = 0
    quantization: str | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    dtype: str | torch.dtype = "auto"
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    generation_config: str = "auto"
    profiler_config: dict | None = None
    structured_outputs_config: dict | None = None
    runner: str = "auto"
    convert: str = "auto"
    hf_overrides: dict | None = None
    pooler_config: dict | None = None
    hf_config: PretrainedConfig | None = field(default=None, init=False)
    torch_dtype: torch.dtype | None = field(default=None, init=False)
    pooling_type: str = field(default="LAST", init=False)  # a pooling engine's: POOLING_TYPES

    def __post_init__(self):
        for f in fields(self):
            if f.init:
                check_type(f.name, getattr(self, f.name), f.type)
        self._check_ranges()
        self.structured_outputs_config = STRUCTURED_OUTPUTS_DEFAULTS | (self.structured_outputs_config or {})

    def _check_structured_outputs_config(self):
        config = self.structured_outputs_config or {}
        unknown = sorted(set(config) - set(STRUCTURED_OUTPUTS_DEFAULTS))
        if unknown:
            raise ValueError(f"structured_outputs_config has no {', '.join(map(repr, unknown))}; it takes "
                             f"{', '.join(STRUCTURED_OUTPUTS_DEFAULTS)}")
        if config.get("backend", "auto") not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_config backend {config['backend']!r} is not available here: "
                             f"{' or '.join(map(repr, STRUCTURED_OUTPUTS_BACKENDS))} (xgrammar)")

    def _check_ranges(self):
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported; supported: None (the "
                             f"checkpoint's own), 'fp8' (FP8 checkpoints, or a bf16 one quantized at load) and "
                             f"'compressed-tensors' (its FP8 checkpoints)")
        self._check_structured_outputs_config()
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} is not supported; supported: {', '.join(LOAD_FORMATS)}")
        if self.runner not in RUNNERS or self.convert not in CONVERTS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)} and convert one of {', '.join(CONVERTS)}, "
                             f"got runner={self.runner!r}, convert={self.convert!r}")
        pooling_type = (self.pooler_config or {}).get("pooling_type", "LAST")
        if set(self.pooler_config or {}) - {"pooling_type"} or pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config takes pooling_type, one of {', '.join(POOLING_TYPES)}; got "
                             f"{self.pooler_config!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; supported: "
                             f"{', '.join(KV_CACHE_DTYPES)} (e4m3 with a scale per token and KV head)")
        if self.device not in DEVICES:
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kvcache_block_size < 16 or self.kvcache_block_size % 16:
            raise ValueError(f"kvcache_block_size must be a positive multiple of 16, got {self.kvcache_block_size}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:  # what torch's generators take
            raise ValueError(f"seed must be None or in [-2**63, 2**64), got {self.seed}")
        if self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError(f"num_kvcache_blocks must be -1 (auto) or positive, got {self.num_kvcache_blocks}")


# How an error names each type a field may take.
TYPE_NAMES = {int: "an integer", float: "a number", bool: "True or False", str: "a text", dict: "a dict",
              torch.dtype: "a torch.dtype", types.NoneType: "None"}


def check_type(name: str, value, annotation):
    """`value` is of a type the field's annotation names: a bool only where it says bool, an int not a bool, a
    float an int or a float."""
    kinds = typing.get_args(annotation) or (annotation,)
    if not any(is_of_type(value, kind) for kind in kinds):
        *others, last = [TYPE_NAMES[kind] for kind in kinds]
        raise ValueError(f"{name} must be {', '.join(others)}{' or ' if others else ''}{last}, got {value!r}")


def is_of_type(value, kind) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)
