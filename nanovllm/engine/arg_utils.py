"""vLLM's `EngineArgs`: the engine arguments as a dataclass and as command-line flags, from one list (the
fields of `Config` and the vLLM arguments of `VLLM_ARGS`), so that `LLM(**vars(parser.parse_args()))`
takes exactly the flags `EngineArgs.add_cli_args(parser)` added, and `run_batch` has the same ones.

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    llm = LLM(**vars(parser.parse_args()))             # or
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args()))
"""
import argparse
import dataclasses
import json
import typing

from nanovllm.config import Config
from nanovllm.engine.config_builder import build_config
from nanovllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["EngineArgs", "FlexibleArgumentParser"]

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"  # vLLM's default model
HELP = {
    "model": "a folder with config.json, *.safetensors and tokenizer files, a .gguf file, or a Hugging Face repo id",
    "tokenizer": "the tokenizer's folder or repo id (default: the model's)",
    "revision": "the model's revision on the Hugging Face hub",
    "tokenizer_revision": "the tokenizer's revision on the Hugging Face hub",
    "trust_remote_code": "let transformers run the checkpoint's own code for its config and tokenizer",
    "download_dir": "where models from the hub are kept (default: the Hugging Face cache)",
    "hf_token": "the Hugging Face token (default: the one logged in)",
    "seed": "seeds the sampling of requests without a seed of their own",
    "quantization": "None (the checkpoint's own), fp8 (FP8 checkpoints, or a bf16 one quantized at load) or "
                    "compressed-tensors",
    "max_num_batched_tokens": "the most tokens one step computes (default: 16384; 32768 for a pooling engine)",
    "max_num_seqs": "the most sequences one step runs (default: 1024 on GPUs of 70 GiB or more, else 256)",
    "max_model_len": "the longest prompt plus completion (default: 4096, capped at the model's)",
    "gpu_memory_utilization": "the share of the GPU's memory the engine may take, the KV cache included",
    "tensor_parallel_size": "GPUs (or CPU processes) one model is split across",
    "enforce_eager": "decode without CUDA graphs",
    "kvcache_block_size": "tokens per KV-cache block (vLLM's block_size)",
    "num_kvcache_blocks": "KV-cache blocks (-1: sized from the memory left; vLLM's num_gpu_blocks_override)",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 (e4m3 with a scale per token and KV head: about twice the "
                      "tokens in the same memory)",
    "device": "auto, cuda or cpu",
    "dtype": "auto, bfloat16, float16 or float32 (auto: the checkpoint's; float32 runs as bfloat16 on CUDA)",
    "enable_prefix_caching": "share the KV blocks of identical prompt prefixes",
    "load_format": "auto, safetensors, gguf, or dummy (random weights from the config alone)",
    "generation_config": "auto: the model's generation_config.json gives the default sampling params; "
                         "vllm: vLLM's defaults; or a folder holding a generation_config.json",
    "profiler_config": "a dict, e.g. {\"profiler\": \"torch\", \"torch_profiler_dir\": DIR}, for "
                       "start_profile() and stop_profile()",
    "structured_outputs_config": "a dict: backend (auto or xgrammar), disable_any_whitespace, "
                                 "disable_additional_properties, disable_fallback",
    "runner": "generate, or pooling: an engine for embed() (auto: generate, unless convert is embed)",
    "convert": "how a generative checkpoint pools: embed (its last token's hidden state; auto with runner pooling)",
    "pooler_config": "a pooling engine's {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\"} (default: the "
                     "model's sentence-transformers config, else LAST)",
    "hf_overrides": "a dict of config.json fields to set, e.g. Qwen3-Reranker's {\"architectures\": "
                    "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
                    "\"is_original_qwen3_reranker\": true}",
}

# vLLM engine arguments this engine takes only at the values it runs as (the first is vLLM's default); any other
# value raises ValueError with the hint. None in place of the values: any value runs the same (vLLM's knobs for
# machinery this engine does not have: CPU swap space, stat logging, custom all-reduce, graph-capture lengths).
VLLM_ARGS: dict[str, tuple[tuple | None, str]] = {
    "tokenizer_mode": (("auto",), "the tokenizer is loaded with transformers' AutoTokenizer"),
    "skip_tokenizer_init": ((False,), "the engine needs the tokenizer for text prompts, stop strings and output"),
    "task": (("auto", "generate"), "this engine generates text only"),
    "pipeline_parallel_size": ((1,), "split the model across GPUs with tensor_parallel_size"),
    "data_parallel_size": ((1,), "start one engine per group of GPUs"),
    "distributed_executor_backend": ((None, "mp", "uni"), "tensor-parallel workers are local processes ('mp')"),
    "enable_lora": ((False,), "merge the LoRA adapter into the checkpoint's weights"),
    "cpu_offload_gb": ((0,), "the weights stay on the GPUs: raise tensor_parallel_size to fit a larger model"),
    "enable_chunked_prefill": ((None, True), "prompts longer than max_num_batched_tokens are always prefilled in "
                                             "chunks; raise max_num_batched_tokens to prefill each in one step"),
    "scheduling_policy": (("fcfs",), "requests are scheduled first come, first served"),
    "swap_space": (None, ""),
    "disable_log_stats": (None, ""),
    "max_seq_len_to_capture": (None, ""),
    "disable_custom_all_reduce": (None, ""),
    "disable_async_output_proc": (None, ""),
}
# vLLM's names for settings this engine spells differently.
VLLM_RENAMED_ARGS = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}


def make_config(model: str, kwargs: dict) -> Config:
    """The engine's Config from `LLM`'s keyword arguments: Config fields, and vLLM's arguments of VLLM_ARGS (checked,
    then dropped). A vLLM name this engine spells differently raises ValueError, an unknown name TypeError."""
    names = {f.name for f in dataclasses.fields(Config) if f.init}
    for name, value in kwargs.items():
        if name not in names:
            check_vllm_arg(name, value, names)
    return build_config(model, **{name: value for name, value in kwargs.items() if name in names})


def check_vllm_arg(name: str, value, names: set[str]):
    if name in VLLM_RENAMED_ARGS:
        raise ValueError(f"{name!r} is called {VLLM_RENAMED_ARGS[name]!r} in this engine: "
                         f"pass {VLLM_RENAMED_ARGS[name]}={value!r}")
    if name not in VLLM_ARGS:
        valid = ", ".join(sorted(names - {"model"} | VLLM_ARGS.keys()))
        raise TypeError(f"unknown engine argument {name!r}; valid arguments: {valid}")
    values, hint = VLLM_ARGS[name]
    if values is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in values):
        raise ValueError(f"{name}={value!r} is not supported ({' or '.join(map(repr, values))} only): {hint}")


# vLLM's types and defaults for the VLLM_ARGS that take any value (their flags parse as vLLM's do).
ANY_VALUE_ARGS = {"swap_space": (float, 4.0), "disable_log_stats": (bool, False), "max_seq_len_to_capture": (int, 8192),
                  "disable_custom_all_reduce": (bool, False), "disable_async_output_proc": (bool, False)}
FLOAT_ARGS = {"cpu_offload_gb"}  # vLLM takes a float where this engine's only value is 0


def engine_fields() -> list[tuple[str, type, dataclasses.Field]]:
    """(name, type, field) of every engine argument: Config's, then VLLM_ARGS' at their defaults."""
    config_fields = [(f.name, f.type, dataclasses.field(default=DEFAULT_MODEL if f.name == "model" else f.default))
                     for f in dataclasses.fields(Config) if f.init]
    return config_fields + [(name, *vllm_arg_type_and_default(name, values)) for name, (values, _) in VLLM_ARGS.items()]


def vllm_arg_type_and_default(name: str, values: tuple | None) -> tuple[type, dataclasses.Field]:
    """A VLLM_ARGS argument's type and default: those of the values it takes, or vLLM's where it takes any."""
    if values is None:
        kind, default = ANY_VALUE_ARGS.get(name, (str, None))
    else:
        kind = float if name in FLOAT_ARGS else next((type(v) for v in values if v is not None), str)
        default = values[0]
    return kind, dataclasses.field(default=default)


def add_cli_args(cls, parser):
    """Add a flag for every engine argument to `parser` (or an argument group), with its default; returns it."""
    for f in dataclasses.fields(cls):
        flag, help_text = "--" + f.name.replace("_", "-"), f"{help_for(f.name)} (default: {f.default})"
        if f.type is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=option_type(f.type), default=f.default, help=help_text)
    return parser


def help_for(name: str) -> str:
    if name in HELP:
        return HELP[name]
    values, hint = VLLM_ARGS[name]
    return f"vLLM's; {' or '.join(map(repr, values))} only: {hint}" if values else "vLLM's; any value runs the same"


def from_cli_args(cls, args: argparse.Namespace):
    """EngineArgs from parsed flags (those add_cli_args added; other attributes are left out)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def option_type(annotation):
    """int or float where the argument takes one (alone or with None), a dict from JSON, else text."""
    kinds = typing.get_args(annotation) or (annotation,)
    if dict in kinds or any(typing.get_origin(kind) is dict for kind in kinds):
        return json.loads
    return next((kind for kind in (int, float) if kind in kinds), str)


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", engine_fields(),
    namespace={"add_cli_args": classmethod(add_cli_args), "from_cli_args": classmethod(from_cli_args),
               "__module__": __name__,
               "__doc__": "The engine's arguments with vLLM's names and defaults (LLM(**asdict(args)))."})
