import dataclasses
import json
import os
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from transformers import AutoTokenizer

from nanovllm.config import make_config
from nanovllm.engine.executor import RemoteStepOutput, make_executor
from nanovllm.engine.input_builder import ScoredPrompt, build_step_input, scored_prompts
from nanovllm.engine.model_runner import AsyncStepOutput
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.request import Request
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_io import StepOutput
from nanovllm.outputs import RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.interrupts import keyboard_interrupt_deferred

# A text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": [...]} dicts.
Prompt = str | list[int] | dict


@dataclass(slots=True)
class InFlightStep:
    """A step launched on the device whose sampled tokens have not been processed yet."""

    scheduled: SchedulerOutput
    scored: list[ScoredPrompt]  # the prompt positions whose log-probabilities the step computes
    output: AsyncStepOutput | RemoteStepOutput
    blocks_next_step: bool  # a sampled sequence's next step needs this one's tokens on the host (penalties)


class LLMEngine:
    """Owns the tokenizer, the scheduler and the executor, and drives them step by step, with vLLM's
    loop API: `add_request()`, then `step()` until `has_unfinished_requests()` is False.

    The host prepares each step while the device runs the one before: `step()` schedules and launches
    the next step first, then waits for the previous one's tokens and processes them. Tokens the
    device has sampled but the host has not seen yet are pending in the scheduler, and the device
    feeds them to the next step itself. A step whose sequences need their latest tokens to be
    sampled again (penalties count them) is processed before the next one is scheduled.
    """

    def __init__(self, model: str, **kwargs):
        self.config = config = make_config(model, kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=config.trust_remote_code)
        self.output_processor = OutputProcessor(self.tokenizer)
        generation = generation_config(config.model)
        self.eos_token_ids = eos_token_ids(self.tokenizer, config.hf_config, generation)
        self.generation_defaults = {name: value for name, value in generation.items() if name in GENERATION_DEFAULTS}
        self.executor = make_executor(config)
        self._exit = weakref.finalize(self, self.executor.exit)
        try:
            self.scheduler = self._make_scheduler()
        except BaseException:
            self.exit()
            raise
        self.requests: dict[str, Request] = {}
        self.request_of_seq: dict[int, Request] = {}
        self.in_flight: deque[InFlightStep] = deque()

    def _make_scheduler(self) -> Scheduler:
        config = self.config
        num_blocks = self.executor.num_kvcache_blocks
        if num_blocks * config.kvcache_block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {config.kvcache_block_size} tokens, fewer than "
                f"max_model_len={config.max_model_len}: raise num_kvcache_blocks or lower max_model_len")
        return Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            num_kvcache_blocks=num_blocks,
            kvcache_block_size=config.kvcache_block_size,
            eos_token_ids=self.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching,
        )

    def exit(self):
        """Stop every model runner and release their processes, shared memory and GPU memory."""
        self._exit()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.exit()

    # --- requests ---

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None):
        """Queue one prompt, checked first; `step()` then advances it with everything else queued."""
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already queued")
        self.add_checked_request(self.make_request(request_id, prompt, params or self.get_default_sampling_params()))

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams, index: int | None = None,
                     add_special_tokens: bool = True) -> Request:
        """A checked request, not yet queued; `index`, where given, numbers the prompt in errors."""
        name = "the prompt" if index is None else f"prompt {index}"
        if not isinstance(params, SamplingParams):
            owner = "the sampling params" if index is None else f"sampling params {index}"
            raise ValueError(f"{owner} is a {type(params).__name__}, not SamplingParams")
        text, token_ids = self.tokenize_prompt(prompt, name, add_special_tokens)
        token_ids = self._truncated(token_ids, params.truncate_prompt_tokens)
        self._check_prompt(name, token_ids)
        params = self._checked_params(name, params, len(token_ids))
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words or [])
        seqs = [Sequence(token_ids, params, seed, bad_words) for seed in child_seeds(params.seed, params.n)]
        return Request(str(request_id), text, list(token_ids), params, seqs, RequestMetrics(time.time()))

    def tokenize_prompt(self, prompt: Prompt, name: str = "the prompt",
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt; the text is None when it came as token ids."""
        text, token_ids = parse_prompt(name, prompt)
        if token_ids is None:
            token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return text, token_ids

    def _truncated(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` tokens of the prompt (-1: the last max_model_len), as vLLM truncates."""
        if keep is None:
            return token_ids
        return token_ids[-(self.config.max_model_len if keep == -1 else keep):]

    def _checked_params(self, name: str, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """The params checked against the vocabulary, with max_tokens=None made what max_model_len leaves."""
        vocab_size = self.config.hf_config.vocab_size
        for field in ("logprobs", "prompt_logprobs"):
            if (getattr(params, field) or 0) > vocab_size:
                raise ValueError(f"{field}={getattr(params, field)} exceeds the vocabulary's {vocab_size} tokens")
        for field, token_ids in params.token_ids_named().items():
            bad = next((t for t in token_ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"{field} has token id {bad} outside the vocabulary [0, {vocab_size})")
        if params.max_tokens is not None:
            return params
        room = self.config.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(f"{name} has {num_prompt_tokens} tokens and fills max_model_len="
                             f"{self.config.max_model_len}: max_tokens=None leaves no room for a completion")
        return dataclasses.replace(params, max_tokens=room)

    def _check_prompt(self, name: str, token_ids: list[int]):
        if not token_ids:
            raise ValueError(f"{name} is empty")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"{name} has {len(token_ids)} tokens, longer than "
                             f"max_model_len={self.config.max_model_len}")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} has token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")

    def add_checked_request(self, request: Request):
        self.output_processor.add_request(request)
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.request_of_seq[seq.seq_id] = request
            self.scheduler.add(seq)

    def abort_request(self, request_ids: str | Iterable[str]):
        """Drop these requests wherever they are; unknown or finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str | int) else request_ids:
            request = self.requests.get(str(request_id))
            if request is not None:
                self.scheduler.abort(request.seqs)
                self._forget(request)

    def _forget(self, request: Request):
        del self.requests[request.request_id]
        for seq in request.seqs:
            del self.request_of_seq[seq.seq_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.in_flight)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- running ---

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then process the previous one's tokens while the device runs it.
        Returns the outputs of the requests that progressed, as their output_kind asks."""
        launched = False
        if not (self.in_flight and self.in_flight[-1].blocks_next_step):
            launched = self._launch_next_step()
        if self.in_flight and (len(self.in_flight) > 1 or not launched):
            return self._process_oldest_step()
        return []

    def _launch_next_step(self) -> bool:
        with keyboard_interrupt_deferred():  # a step is launched and recorded as in flight, or neither
            scheduled = self.scheduler.schedule()
            if not scheduled.seqs:
                return False
            try:
                scored = scored_prompts(scheduled)
                step_input = build_step_input(scheduled, scored, self.config.kvcache_block_size,
                                              self.config.hf_config.vocab_size, self.eos_token_ids)
                output = self.executor.execute_model(step_input)
            except BaseException:
                self._drop_unlaunched(scheduled)
                raise
            blocks = any(seq.sampling_params.needs_history for seq in scheduled.sampled)
            self.in_flight.append(InFlightStep(scheduled, scored, output, blocks))
            self._note_scheduled(scheduled)
            return True

    def _drop_unlaunched(self, scheduled: SchedulerOutput):
        """A step was scheduled but never launched: its sequences were advanced past work that never
        happened (pending tokens that will not come, blocks registered but never filled), so the
        requests they belong to are aborted."""
        self.scheduler.unschedule(scheduled)
        self.abort_request({self.request_of_seq[seq.seq_id].request_id for seq in scheduled.seqs})

    def _process_oldest_step(self) -> list[RequestOutput]:
        step = self.in_flight[0]
        result = self.executor.wait(step.output)  # a Ctrl-C here leaves the step in flight, to process later
        with keyboard_interrupt_deferred():
            self.in_flight.popleft()
            return self._process(step, result)

    def _process(self, step: InFlightStep, output: StepOutput) -> list[RequestOutput]:
        """The step's tokens into the scheduler (which finishes sequences on tokens), then into the output
        processor (text, log-probabilities, stop strings); returns the outputs the requests are due."""
        scheduled = step.scheduled
        if output.prompt_logprobs is not None:
            scored = [(self.request_of_seq[scheduled.seqs[i].seq_id], scheduled.seqs[i], start, count)
                      for i, start, count in step.scored]
            self.output_processor.add_prompt_logprobs(scored, output.prompt_logprobs)
        rows = self.scheduler.update_from_output(scheduled, output.token_ids)
        seqs = [scheduled.sampled[i] for i in rows]
        requests = [self.request_of_seq[seq.seq_id] for seq in seqs]
        logprobs = output.logprobs.map(lambda column: [column[i] for i in rows]) if output.logprobs else None
        for seq, stop in self.output_processor.add_tokens(requests, seqs, logprobs):
            self.scheduler.finish(seq, "stop", stop)
        return self.output_processor.step_outputs(self._note_tokens(requests))

    def _note_scheduled(self, scheduled: SchedulerOutput):
        now = time.time()
        for seq in scheduled.seqs[scheduled.num_decode:]:
            metrics = self.request_of_seq[seq.seq_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now

    def _note_tokens(self, requests: list[Request]) -> list[Request]:
        """These requests, which took tokens, each once and in order; finished ones are forgotten."""
        now, progressed = time.time(), {}
        for request in requests:
            progressed[request.request_id] = request
        for request in progressed.values():
            metrics = request.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            if request.finished:
                metrics.finished_time = now
                self._forget(request)
        return list(progressed.values())

    # --- the cache and the tokenizer ---

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults, as vLLM gives them."""
        return SamplingParams(**self.generation_defaults)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing forgotten) while requests hold blocks."""
        return self.scheduler.block_manager.reset_prefix_cache()


def parse_prompt(name: str, prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt, `name` in errors; the token ids are None while the text is to be tokenized."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        return _parse_prompt_dict(name, prompt)
    if isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"{name} is a {type(prompt).__name__}: expected a text, a list of token ids, "
                     f"or a dict with 'prompt' or 'prompt_token_ids'")


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def _parse_prompt_dict(name: str, prompt: dict) -> tuple[str | None, list[int] | None]:
    unknown = sorted(set(prompt) - set(PROMPT_DICT_KEYS))
    if unknown or not set(prompt) & set(PROMPT_DICT_KEYS):
        raise ValueError(f"{name} is a dict with keys {sorted(prompt)}: expected 'prompt' (a text) "
                         f"or 'prompt_token_ids' (a list of token ids)")
    if "prompt_token_ids" in prompt:
        return prompt.get("prompt"), parse_prompt(name, list(prompt["prompt_token_ids"]))[1]
    if not isinstance(prompt["prompt"], str):
        raise ValueError(f"{name}: 'prompt' must be a text, got {type(prompt['prompt']).__name__}")
    return prompt["prompt"], None


def generation_config(model: str) -> dict:
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


# generation_config.json's sampling fields that vLLM takes as the default SamplingParams
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def eos_token_ids(tokenizer, hf_config, generation: dict) -> frozenset[int]:
    """The tokenizer's end-of-sequence id and those of config.json and generation_config.json."""
    ids = [tokenizer.eos_token_id, hf_config.eos_token_id, generation.get("eos_token_id")]
    flat = [i for entry in ids for i in (entry if isinstance(entry, list) else [entry])]
    return frozenset(i for i in flat if i is not None)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, as written alone and after a space (vLLM's two spellings)."""
    spellings = {tuple(tokenizer.encode(spelling, add_special_tokens=False))
                 for word in words for spelling in (word.strip(), " " + word.strip())}
    return [list(ids) for ids in sorted(spellings) if ids]


def child_seeds(seed: int | None, n: int) -> list[int | None]:
    """One seed per completion: the request's for the first, distinct ones derived from it for the rest."""
    if seed is None:
        return [None] * n
    return [seed & (2**63 - 1)] + [hash((seed, i)) & (2**63 - 1) for i in range(1, n)]
