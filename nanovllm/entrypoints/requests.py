"""Dataset rows into prompts (a text, token ids, or a conversation rendered with the chat template) and
structured-outputs constraints.

The engine checks each prompt itself (LLM.generate_as_completed answers a bad one with its own
ValueError), so a row only needs turning into token ids here.
"""
from nanovllm.chat import render_chat
from nanovllm.sampling_params import StructuredOutputsParams


def prompt_token_ids(llm, prompt=None, messages=None, **chat_options) -> list[int]:
    """The token ids of a prompt (a text or token ids) or of a conversation, as `LLM.generate` and
    `LLM.chat` would make them; `chat_options` are render_chat's. Raises ValueError."""
    if (prompt is None) == (messages is None):
        raise ValueError("give either a prompt or messages")
    if messages is not None:  # the template already holds any special tokens the model needs
        text = render_chat(llm.tokenizer, messages, **chat_options)
        return llm.input_processor.tokenize_prompt(text, add_special_tokens=False)[1]
    return llm.input_processor.tokenize_prompt(prompt)[1]


def structured_outputs_params(fields: dict, owner: str = "structured_outputs") -> StructuredOutputsParams:
    """StructuredOutputsParams from a dict of its fields; raises ValueError naming a key it does not have."""
    check_keys(owner, fields, StructuredOutputsParams.__dataclass_fields__)
    return StructuredOutputsParams(**fields)


def check_keys(owner: str, mapping: dict, allowed):
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        raise ValueError(f"{owner} has no {', '.join(map(repr, unknown))}; it takes {', '.join(allowed)}")
