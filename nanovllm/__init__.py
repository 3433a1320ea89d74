"""nano-vllm: `from nanovllm import LLM, SamplingParams`.

The names below are imported when first used (as vLLM's package does), so that a tensor-parallel rank's
process, which imports only `nanovllm.engine.worker` and what it needs, does not load the engine's
scheduler, tokenizer or output processing.
"""
from importlib import import_module
from typing import TYPE_CHECKING

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]
_MODULES = dict(LLM="nanovllm.llm", LLMEngine="nanovllm.engine.llm_engine", SamplingParams="nanovllm.sampling_params",
                RequestOutputKind="nanovllm.sampling_params", RequestOutput="nanovllm.outputs",
                CompletionOutput="nanovllm.outputs")

if TYPE_CHECKING:
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.llm import LLM
    from nanovllm.outputs import CompletionOutput, RequestOutput
    from nanovllm.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    return getattr(import_module(_MODULES[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
