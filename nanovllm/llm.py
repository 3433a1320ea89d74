import itertools
from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.chat import render_chat
from nanovllm.engine.input_processor import Prompt, check_defaults_only
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request import Request
from nanovllm.inputs import is_single_prompt
from nanovllm.outputs import RequestOutput
from nanovllm.pooling_api import PoolingAPI
from nanovllm.sampling_params import SamplingParams, final_only
from nanovllm.utils.frozen_heap import frozen_heap


class LLM(PoolingAPI, LLMEngine):
    """An offline inference engine for a Hugging Face Qwen3 checkpoint.

    `LLM(model, **kwargs)`: `model` is a folder with config.json, *.safetensors and tokenizer files;
    keyword arguments are `nanovllm.config.Config` fields. Use it as a context manager, or call
    `exit()`, to release its processes, shared memory and GPU memory.
    """

    def __init__(self, model: str, **kwargs):
        super().__init__(model, **kwargs)
        self.request_counter = itertools.count()  # generate()'s request ids, "0", "1", ..., as vLLM numbers them

    @property
    def llm_engine(self) -> LLMEngine:
        return self

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt: a text, a list of token ids, or vLLM's {"prompt": text} or
        {"prompt_token_ids": [...]}, alone or in a list.

        `sampling_params` is one SamplingParams for all prompts or a list, one per prompt.
        Returns, in the prompts' order, a RequestOutput per prompt; `out["text"]` and
        `out["token_ids"]` give its first completion's. Every prompt is checked before any work
        starts: a bad one raises ValueError and runs nothing. `lora_request` and `priority` are vLLM's,
        taken at their defaults only (None; no priorities or all 0). Requests queued by add_request()
        advance too; their outputs come from the next step().
        """
        check_defaults_only(lora_request, priority)
        self._check_runner("generate", "generate()")
        with self.guard:
            return self._run(self._make_requests(prompts, sampling_params), use_tqdm)

    def generate_as_completed(self, prompts: Prompt | list[Prompt],
                              sampling_params: SamplingParams | list[SamplingParams] | None = None,
                              ) -> Iterator[tuple[int, RequestOutput | ValueError]]:
        """Complete every prompt, as generate() does, but yield (index, RequestOutput) as each finishes.
        A bad prompt does not stop the others: it yields (index, the ValueError naming the problem).
        A request that leaves the engine between two results (aborted, or its output taken by a step()
        call) yields nothing."""
        self._check_runner("generate", "generate_as_completed()")
        with self.guard:
            refused, waiting = self._queue_as_completed(prompts, sampling_params)
        try:  # a caller that stops iterating early leaves nothing queued
            yield from refused
            resumed = True
            while waiting and (outputs := self._next_outputs(waiting, resumed)) is not None:
                resumed = False
                for output in outputs:
                    if output.finished:
                        yield waiting.pop(output.request_id), output
                        resumed = True
        finally:
            if waiting and not self.guard.shut_down:
                self.abort_request(list(waiting))

    def _queue_as_completed(self, prompts, sampling_params) -> tuple[list[tuple[int, ValueError]], dict[str, int]]:
        """Queue a request for each good prompt: the bad prompts' (index, error), and the requests' index by id."""
        prompts, sampling_params = self._paired(prompts, sampling_params)
        final_only, refused, waiting = FinalOnly(), [], {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
                try:
                    request = self._final_only_request(final_only, prompt, params)
                except ValueError as error:
                    refused.append((i, error))
                    continue
                self.add_checked_request(request)
                waiting[request.request_id] = i
        except BaseException:  # an interrupt, or an error no check foresaw: nothing is left queued
            self._abort(waiting)
            raise
        return refused, waiting

    def _next_outputs(self, waiting: dict[str, int], resumed: bool) -> list[RequestOutput] | None:
        """These requests' next outputs: once resumed after a result, any held for them (the caller may have
        run another generate() meanwhile), else a step's; None once none of them is left in the engine."""
        with self.guard:
            if resumed and (held := self._take_held_outputs(waiting)):
                return held
            if not any(request_id in self.requests for request_id in waiting):
                return None
            return self._outputs_of(waiting)

    def _take_held_outputs(self, request_ids: dict[str, int]) -> list[RequestOutput]:
        held = [output for output in self.held_outputs if output.request_id in request_ids]
        if held:
            self.held_outputs = [output for output in self.held_outputs if output.request_id not in request_ids]
        return held

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request=None, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of
        them, each rendered with the tokenizer's chat template (or `chat_template`). Content may be a
        text or OpenAI's text content parts. `continue_final_message` continues the last message
        instead of starting a new one; `tools` reach the template."""
        check_defaults_only(lora_request)
        self._check_runner("generate", "chat()")
        if not isinstance(messages, list | tuple):
            raise ValueError(f"messages must be a conversation (a list of {{'role', 'content'}} messages) or a list "
                             f"of them, got {type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        with self.guard:
            prompts = [render_chat(self.tokenizer, conversation, i, add_generation_prompt, continue_final_message,
                                   chat_template, tools, chat_template_kwargs)
                       for i, conversation in enumerate(conversations)]
            # The template already holds any special tokens the model needs.
            return self._run(self._make_requests(prompts, sampling_params, add_special_tokens=False), use_tqdm)

    def _paired(self, prompts, sampling_params) -> tuple[list, list]:
        """The prompts as a list, and one SamplingParams for each."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        elif not isinstance(prompts, SequenceOf):
            raise ValueError(f"prompts must be a prompt (a text, token ids or a dict) or a list of them, got "
                             f"{type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, list | tuple):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, one per prompt, got "
                             f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        return prompts, sampling_params

    def _make_requests(self, prompts, sampling_params, add_special_tokens: bool = True) -> list[Request]:
        """Checked requests, one per prompt, that report only when finished."""
        prompts, sampling_params = self._paired(prompts, sampling_params)
        final_only = FinalOnly()
        return [self._final_only_request(final_only, prompt, params, i, add_special_tokens)
                for i, (prompt, params) in enumerate(zip(prompts, sampling_params))]

    def _final_only_request(self, final_only: "FinalOnly", prompt, params, index: int | None = None,
                            add_special_tokens: bool = True) -> Request:
        return self.input_processor.make_request(self._new_request_id(), prompt, final_only(params), index,
                                                 add_special_tokens)

    def _new_request_id(self) -> str:
        """The counter's next id that no request in the engine holds (a user's add_request may have taken it)."""
        while (request_id := str(next(self.request_counter))) in self.requests:
            pass
        return request_id

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        """Queue the requests and step until they are finished. The outputs of other requests (add_request's)
        are held, in order, for the caller's next step()."""
        for request in requests:
            self.add_checked_request(request)
        mine, outputs, others = {request.request_id for request in requests}, {}, []
        try:
            with ProgressBar(len(requests), use_tqdm) as progress, frozen_heap():
                while len(outputs) < len(requests):
                    for output in self.step():
                        if output.request_id not in mine:
                            others.append(output)
                        elif output.finished:
                            outputs[output.request_id] = output
                            progress.update(output)
        except BaseException:  # an error or an interrupt: the engine must stay usable for the next call
            self._abort(mine)
            raise
        finally:
            self.held_outputs[:0] = others  # before whatever a failed step() left held, which came later
        return [outputs[request.request_id] for request in requests]


class FinalOnly:
    """Each distinct SamplingParams once copied with output_kind FINAL_ONLY: generate() needs no
    output before a request finishes, and the caller's object stays as it was."""

    def __init__(self):
        self.copies: dict[int, SamplingParams] = {}

    def __call__(self, params):
        if not isinstance(params, SamplingParams):
            return params
        if id(params) not in self.copies:
            self.copies[id(params)] = final_only(params)
        return self.copies[id(params)]


class ProgressBar:
    """Finished requests out of all, with the prompt and completion tokens per second so far."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not enabled)
        self.start = perf_counter()
        self.num_prompt_tokens = self.num_output_tokens = 0

    def update(self, output: RequestOutput):
        self.num_prompt_tokens += len(output.prompt_token_ids)
        if isinstance(output, RequestOutput):  # an embedding has no output tokens
            self.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"input {self.num_prompt_tokens / elapsed:.0f} tok/s, "
                                 f"output {self.num_output_tokens / elapsed:.0f} tok/s", refresh=False)
        self.bar.update(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.bar.close()
