"""Output lines of a batch file: OpenAI's `text_completion` and `chat.completion` objects in
vLLM's batch envelope, or an error naming the problem."""
import itertools
import time
import uuid

from nanovllm.entrypoints.openai_batch import COMPLETIONS, BatchRequest
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput


def result_line(request: BatchRequest, output: RequestOutput, model: str) -> dict:
    if request.url == COMPLETIONS:
        body = completion(output, model)
    else:
        body = chat_completion(output, model, request.sampling_params.logprobs)
    return {"id": new_id("nanovllm"), "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": new_id("nanovllm-batch"), "body": body},
            "error": None}


def error_line(custom_id: str | None, code: str, message: str) -> dict:
    return {"id": new_id("nanovllm"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion(output: RequestOutput, model: str) -> dict:
    choices = [{"index": c.index, "text": c.text, "logprobs": completion_logprobs(c), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason} for c in output.outputs]
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(output)}


def chat_completion(output: RequestOutput, model: str, num_top_logprobs: int | None) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, num_top_logprobs), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason} for c in output.outputs]
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(output)}


def usage(output: RequestOutput) -> dict:
    num_prompt_tokens = len(output.prompt_token_ids)
    num_completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def completion_logprobs(c: CompletionOutput) -> dict | None:
    """The legacy completions shape: parallel lists, and each position's top tokens as {text: logprob}
    (the sampled token included, as vLLM does)."""
    if c.logprobs is None:
        return None
    sampled = [position[token] for token, position in zip(c.token_ids, c.logprobs)]
    tokens = [lp.decoded_token or "" for lp in sampled]
    offsets = [0, *itertools.accumulate(map(len, tokens))][:-1]
    return {"tokens": tokens,
            "token_logprobs": [lp.logprob for lp in sampled],
            "top_logprobs": [{lp.decoded_token or "": lp.logprob for lp in by_rank(position)}
                             for position in c.logprobs],
            "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, num_top: int | None) -> dict | None:
    """The chat shape: one entry per token, with its `num_top` most likely alternatives."""
    if c.logprobs is None:
        return None
    return {"content": [{**token_logprob(position[token]),
                         "top_logprobs": [token_logprob(lp) for lp in by_rank(position) if lp.rank <= num_top]}
                        for token, position in zip(c.token_ids, c.logprobs)]}


def token_logprob(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}


def by_rank(position: dict[int, Logprob]) -> list[Logprob]:
    return sorted(position.values(), key=lambda lp: lp.rank)
