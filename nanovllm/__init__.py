from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]
