"""vLLM's prompt types (`from nanovllm.inputs import TokensPrompt, TextPrompt`): the dicts `generate` takes
beside plain texts and token-id lists."""
from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
