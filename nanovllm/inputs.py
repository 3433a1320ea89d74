"""vLLM's prompt types (`from nanovllm.inputs import TokensPrompt, TextPrompt`): the dicts `generate` takes
beside plain texts and token-id lists."""
from collections.abc import Sequence as SequenceOf
from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def is_single_prompt(prompts) -> bool:
    """One prompt (a text, a dict, or token ids) rather than a list of them."""
    if isinstance(prompts, str | dict):
        return True
    return isinstance(prompts, SequenceOf) and bool(prompts) and isinstance(prompts[0], int)
