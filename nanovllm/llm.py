from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """An offline inference engine for a Hugging Face Qwen3 checkpoint.

    `LLM(model, **kwargs)`: `model` is a folder with config.json, *.safetensors and tokenizer files;
    keyword arguments are `nanovllm.config.Config` fields. Use it as a context manager, or call
    `exit()`, to release its processes, port and shared memory.
    """
