"""One request at a time in, a chunk of requests through the engine at once.

A dataset holds bad rows; `LLM.generate` refuses its whole call when one prompt is bad. So each row is
turned into token ids and checked here first (`prompt_token_ids`), and only rows that pass reach
`generate_each`, the one function that drives the engine.
"""
from collections.abc import Iterator

from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


def prompt_token_ids(llm, prompt=None, messages=None, add_generation_prompt: bool = True,
                     chat_template_kwargs: dict | None = None) -> list[int]:
    """The checked token ids of a prompt (a text or token ids) or of a conversation rendered with the
    tokenizer's chat template, as `LLM.generate` and `LLM.chat` would make them. Raises ValueError."""
    if (prompt is None) == (messages is None):
        raise ValueError("give either a prompt or messages")
    if messages is not None:
        token_ids = llm.tokenizer.encode(render_chat(llm.tokenizer, messages, add_generation_prompt,
                                                     chat_template_kwargs or {}), add_special_tokens=False)
    elif isinstance(prompt, str):
        token_ids = llm.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_ids = prompt
    else:
        raise ValueError(f"the prompt is a {type(prompt).__name__}: expected a text or a list of token ids")
    check_token_ids(llm, token_ids)
    return token_ids


def render_chat(tokenizer, messages, add_generation_prompt: bool, chat_template_kwargs: dict) -> str:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects with text values")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **chat_template_kwargs)
    except Exception as e:  # the template's own errors (jinja2's, or one it raises) name the problem
        raise ValueError(f"the chat template failed: {e}") from e


def check_token_ids(llm, token_ids: list[int]):
    max_model_len, vocab_size = llm.config.max_model_len, llm.config.hf_config.vocab_size
    if not token_ids:
        raise ValueError("the prompt is empty")
    if len(token_ids) > max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens, longer than max_model_len={max_model_len}")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"the prompt has token id {bad} outside the vocabulary [0, {vocab_size})")


def generate_each(llm, prompts: list[list[int]],
                  params: list[SamplingParams]) -> Iterator[tuple[int, RequestOutput | ValueError]]:
    """Complete checked prompts; yields (index, its RequestOutput, or the ValueError that refused it).

    This is the one place that drives the engine. Today it runs the whole chunk through
    `LLM.generate` and yields when all of it is done; should the engine refuse the chunk anyway,
    each prompt is run on its own so that only the bad one fails. With a step API it would add
    the requests and yield each one as it finishes.
    """
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except ValueError as e:
        if len(prompts) == 1:
            outputs = [e]
        else:  # the engine refused the chunk: run each prompt alone, so only the bad one fails
            outputs = [next(generate_each(llm, [p], [sp]))[1] for p, sp in zip(prompts, params)]
    yield from enumerate(outputs)
