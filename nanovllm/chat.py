"""Conversations into prompts, through the tokenizer's chat template, as vLLM's LLM.chat does."""


def render_chat(tokenizer, conversation, index: int | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None, tools: list | None = None,
                chat_template_kwargs: dict | None = None) -> str:
    """The prompt text of one conversation: a non-empty list of {"role", "content"} messages, whose
    content is a text or OpenAI's content parts ([{"type": "text", "text": ...}], joined by newlines).
    `index` names the conversation in errors; the other arguments reach the template."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True: the first starts "
                         "a new assistant message, the second continues the last one")
    name = "the conversation" if index is None else f"conversation {index}"
    messages = [_text_message(name, i, m) for i, m in enumerate(_messages(name, conversation))]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             chat_template=chat_template, tools=tools, **(chat_template_kwargs or {}))
    except ValueError:
        raise
    except Exception as error:  # the template's own errors (jinja2's, or one it raises) name the problem
        raise ValueError(f"{name}: the chat template failed: {error}") from error


def _messages(name: str, conversation) -> list:
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"{name} must be a non-empty list of {{'role', 'content'}} messages")
    return conversation


def _text_message(name: str, position: int, message) -> dict:
    where = f"{name}, message {position}"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
        raise ValueError(f"{where} must be a {{'role', 'content'}} message, got {message!r}")
    content = message["content"]
    if isinstance(content, list):
        return {**message, "content": _join_text_parts(where, content)}
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{where}: content must be a text or a list of content parts, "
                         f"got {type(content).__name__}")
    return message


def _join_text_parts(where: str, parts: list) -> str:
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: a content part of type {kind!r}: this engine serves text only "
                             f"([{{'type': 'text', 'text': ...}}])")
    return "\n".join(part["text"] for part in parts)
