"""nano-vllm: `from nanovllm import LLM, SamplingParams`.

The names below are imported when first used, as vLLM's package does: `import nanovllm` and
`nanovllm.SamplingParams` load neither torch nor transformers, and `nanovllm.engine.worker`, which a
tensor-parallel rank runs, loads nothing of the scheduler or the output side. (A rank's process also runs
the main module's own imports again, as every spawned process does.)
"""
from importlib import import_module
from typing import TYPE_CHECKING

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestOutputKind", "StructuredOutputsParams", "PoolingParams", "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "ScoringRequestOutput", "PoolingRequestOutput"]
_MODULES = dict(LLM="nanovllm.llm", LLMEngine="nanovllm.engine.llm_engine", EngineArgs="nanovllm.engine.arg_utils",
                SamplingParams="nanovllm.sampling_params",
                RequestOutputKind="nanovllm.sampling_params", StructuredOutputsParams="nanovllm.sampling_params",
                RequestOutput="nanovllm.outputs",
                CompletionOutput="nanovllm.outputs", PoolingParams="nanovllm.pooling_params",
                EmbeddingRequestOutput="nanovllm.outputs", ClassificationRequestOutput="nanovllm.outputs",
                ScoringRequestOutput="nanovllm.outputs", PoolingRequestOutput="nanovllm.outputs")

if TYPE_CHECKING:
    from nanovllm.engine.arg_utils import EngineArgs
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.llm import LLM
    from nanovllm.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from nanovllm.pooling_params import PoolingParams
    from nanovllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    return getattr(import_module(_MODULES[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
