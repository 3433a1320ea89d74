"""A Ray Data row's values as the engine takes them, for both of `nanovllm.ray`'s replicas: the generating one
(`ray.py`) and the embedding or classifying one (`ray_pooling.py`)."""
from nanovllm.entrypoints.requests import prompt_token_ids

# The row fields only one kind of task reads, and the task_types that read them. Another task's field in a row is
# a preprocess written for another processor: refused, for it would be ignored.
TASK_FIELDS = {"sampling_params": ("generate",), "pooling_params": ("embed", "classify")}


def refuse_other_tasks_fields(batch, task_type: str):
    """Raises ValueError, before any of the batch's rows reach the engine, where a row gives another task's field
    (Arrow gives every row every column seen in the batch, None where a row has none: only a value counts)."""
    for name, task_types in TASK_FIELDS.items():
        if task_type not in task_types and name in batch.column_names and batch.column(name).null_count < len(batch):
            raise ValueError(f"rows give {name!r}, which task_type={task_type!r} does not take: it is for task_type="
                             f"{' or '.join(map(repr, task_types))}; leave it out of the preprocess")


def row_prompt(llm, row: dict) -> list[int]:
    """The row's token ids: its "tokenized_prompt" where it has one (Ray's, which a tokenize stage adds beside the
    text), else its "prompt" (a text or token ids) or "messages" (rendered with the chat template)."""
    tokenized = to_python(row.get("tokenized_prompt"))
    if tokenized is not None:
        if not isinstance(tokenized, list):  # a text here would be tokenized, not taken as the ids it was meant as
            raise ValueError(f"tokenized_prompt must be a list of token ids, got {type(tokenized).__name__}")
        return prompt_token_ids(llm, prompt=tokenized)
    prompt, messages = to_python(row.get("prompt")), to_python(row.get("messages"))
    if (prompt is None) == (messages is None):
        raise ValueError("a row needs either 'prompt' (a text or token ids) or 'messages' (or 'tokenized_prompt', "
                         "its token ids)")
    if isinstance(messages, list):  # Arrow gives every message every key seen in the column: drop the empty ones
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
    return prompt_token_ids(llm, prompt=prompt, messages=messages)


def to_python(value):
    """Lists and numbers in place of the NumPy arrays and scalars a preprocess may leave in a row."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    return value


def error_text(error: Exception) -> str:
    """A ValueError's text, which names the problem; any other error's with its type."""
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


def with_columns(batch, columns: dict):
    """The batch (a pyarrow Table) with `columns` added at its end, in place of any of the same name it has."""
    for name, column in columns.items():
        if name in batch.column_names:
            batch = batch.drop_columns([name])
        batch = batch.append_column(name, column)
    return batch
