import dataclasses
import time
import weakref
from collections import deque
from collections.abc import Container, Iterable
from dataclasses import dataclass

from nanovllm.engine.arg_utils import make_config
from nanovllm.engine.async_output import AsyncStepOutput
from nanovllm.engine.caller_guard import CallerGuard
from nanovllm.engine.executor import RemoteStepOutput, make_executor
from nanovllm.engine.input_builder import ScoredPrompt, build_step_input, prompt_tokens_multiple
from nanovllm.engine.input_processor import InputProcessor, Prompt, check_defaults_only
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.pooling import pooled_outputs
from nanovllm.engine.profiler import EngineProfiler
from nanovllm.engine.request import Request
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.engine.step_io import StepOutput
from nanovllm.metrics import EngineStats, Metric
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams, is_finite
from nanovllm.utils.gguf_checkpoint import load_tokenizer
from nanovllm.utils.interrupts import keyboard_interrupt_deferred


@dataclass(slots=True)
class InFlightStep:
    """A step launched on the device whose sampled tokens have not been processed yet."""

    scheduled: SchedulerOutput
    scored: list[ScoredPrompt]  # the prompt positions whose log-probabilities the step computes
    output: AsyncStepOutput | RemoteStepOutput | None  # None while its rows await their grammar masks


class LLMEngine:
    """Drives the input processor, the scheduler, the executor and the output processor step by step,
    with vLLM's loop API: `add_request()`, then `step()` until `has_unfinished_requests()` is False.

    The host prepares each step while the device runs the one before: `step()` schedules and launches the
    next step first, then waits for the previous one's tokens and processes them. Tokens the device has
    sampled but the host has not seen yet are pending in the scheduler, and the device feeds them to the
    next step itself, as it counts them for penalties and bad words: no sampling feature waits for the host.

    One thread at a time may call it (`CallerGuard`): a second thread is refused with RuntimeError.
    """

    def __init__(self, model: str, **kwargs):
        self.guard = CallerGuard()
        self.config = config = make_config(model, kwargs)
        self.tokenizer = load_tokenizer(config.tokenizer, trust_remote_code=config.trust_remote_code)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.eos_token_ids = self.input_processor.eos_token_ids
        self.prompt_tokens_multiple = prompt_tokens_multiple(config)
        self.structured_outputs = self.input_processor.structured_outputs
        self.profiler = EngineProfiler(config.profiler_config)  # checked before any process starts
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
        self.held_outputs: list[RequestOutput] = []  # outputs for the next step(), of steps processed outside it
        self.stats = EngineStats()

    @classmethod
    def from_engine_args(cls, engine_args) -> "LLMEngine":
        """vLLM's: the engine of an EngineArgs (`nanovllm.EngineArgs`)."""
        return cls(**dataclasses.asdict(engine_args))

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
            max_model_len=config.max_model_len, num_kvcache_blocks=num_blocks,
            kvcache_block_size=config.kvcache_block_size,
            eos_token_ids=self.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching,
            chunks_prompts=config.pooling_type == "LAST",
        )

    def exit(self):
        """Stop every model runner and release their processes, shared memory and GPU memory. Later calls
        raise RuntimeError; exit() again does nothing."""
        with self.guard.shutting_down():
            self._exit()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.exit()

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request=None, priority: int = 0):
        """Queue one prompt, checked first; `step()` then advances it with everything else queued (`params`: a
        pooling engine's are PoolingParams). `lora_request` and `priority` are vLLM's, at their defaults only."""
        check_defaults_only(lora_request, priority)
        with self.guard:
            request_id = str(request_id)
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already queued")
            if arrival_time is not None and not (isinstance(arrival_time, int | float) and is_finite(arrival_time)):
                raise ValueError(f"arrival_time must be None or a time in seconds, as time.time() gives, "
                                 f"got {arrival_time!r}")
            params = params if params is not None else self.input_processor.default_params()
            request = self.input_processor.make_request(request_id, prompt, params)
            if arrival_time is not None:
                request.metrics.arrival_time = arrival_time
            self.add_checked_request(request)

    def add_checked_request(self, request: Request):
        self.output_processor.add_request(request)
        self.requests[request.request_id] = request
        if request.grammar is not None:
            self.structured_outputs.add(request.seqs, request.grammar)
        for seq in request.seqs:
            self.request_of_seq[seq.seq_id] = request
            self.scheduler.add(seq)

    def abort_request(self, request_ids: str | Iterable[str]):
        """Drop these requests wherever they are; unknown or finished ids are ignored."""
        with self.guard:
            self._abort(request_ids)

    def _abort(self, request_ids: str | Iterable[str]):
        for request_id in [request_ids] if isinstance(request_ids, str | int) else request_ids:
            request = self.requests.get(str(request_id))
            if request is not None:
                self.scheduler.abort(request.seqs)
                self._forget(request)

    def _forget(self, request: Request):
        del self.requests[request.request_id]
        self.structured_outputs.forget(request.seqs)
        for seq in request.seqs:
            del self.request_of_seq[seq.seq_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.in_flight) or bool(self.held_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then process the previous one's tokens while the device runs it.
        Returns the outputs of the requests that progressed, as their output_kind asks."""
        with self.guard:
            outputs = self._advance()  # if it fails, the held outputs wait for the next step()
            held, self.held_outputs = self.held_outputs, []
            return held + outputs

    def _outputs_of(self, request_ids: Container[str]) -> list[RequestOutput]:
        """Advance as step() does, for a caller that waits for these requests: their outputs (the others' wait for
        the next step(), so that a user's own loop still gets them)."""
        mine = []
        for output in self._advance():
            (mine if output.request_id in request_ids else self.held_outputs).append(output)
        return mine

    def _advance(self) -> list[RequestOutput]:
        outputs = self._process_then_sample()  # a step an interrupt left waiting for its masks
        launched = self._launch_next_step()
        if launched and self.in_flight[-1].output is None:
            return outputs + self._process_then_sample()
        if self.in_flight and (len(self.in_flight) > 1 or not launched):
            return outputs + self._process_oldest_step()
        return outputs

    def _process_then_sample(self) -> list[RequestOutput]:
        """If the newest step waits for its grammar masks: process the steps before it, and once the last one's
        tokens are in the sequences (so in the grammars), sample it with its masks; that text follows."""
        if not self.in_flight or self.in_flight[-1].output is not None:
            return []
        step, outputs = self.in_flight[-1], []
        try:
            while len(self.in_flight) > 1:
                sample = (lambda: self._sample_with_masks(step)) if len(self.in_flight) == 2 else None
                outputs += self._process_oldest_step(sample)
            if step.output is None:
                with keyboard_interrupt_deferred():
                    self._sample_with_masks(step)
        except BaseException:  # an interrupt: what was processed is the next step()'s
            self.held_outputs += outputs
            raise
        return outputs

    def _sample_with_masks(self, step: InFlightStep):
        step.output = self.executor.sample_tokens(self.structured_outputs.masks(step.scheduled.sampled))

    def _launch_next_step(self) -> bool:
        with keyboard_interrupt_deferred():  # a step is launched and recorded as in flight, or neither
            scheduled = self.scheduler.schedule()
            if not scheduled.seqs:
                return False
            try:
                step_input, scored = build_step_input(scheduled, self.config.kvcache_block_size, self.eos_token_ids,
                                                      self.prompt_tokens_multiple)
                output = self.executor.execute_model(step_input)
            except BaseException:
                self._drop_unlaunched(scheduled)
                raise
            self.in_flight.append(InFlightStep(scheduled, scored, output))
            self._note_scheduled(scheduled)
            return True

    def _drop_unlaunched(self, scheduled: SchedulerOutput):
        """A step scheduled but never launched advanced its sequences past work that never happened (pending
        tokens that will not come, blocks registered but never filled): their requests are aborted."""
        self.scheduler.unschedule(scheduled)
        self._abort({self.request_of_seq[seq.seq_id].request_id for seq in scheduled.seqs})

    def _process_oldest_step(self, then=None) -> list[RequestOutput]:
        step = self.in_flight[0]
        result = self.executor.wait(step.output)  # a Ctrl-C here leaves the step in flight, to process later
        with keyboard_interrupt_deferred():
            self.in_flight.popleft()
            return self._process(step, result, then)

    def _process(self, step: InFlightStep, output: StepOutput, then=None) -> list[RequestOutput]:
        """The step's tokens into the scheduler (which finishes sequences on tokens), `then()` (the next step's
        sampling, which waits for these tokens), then into the output processor (text, log-probabilities, stop
        strings); returns the outputs the requests are due. A pooling engine's step finishes its rows instead."""
        scheduled = step.scheduled
        if output.pooled is not None:
            requests, outputs = pooled_outputs(self.scheduler, self.request_of_seq, scheduled, output.pooled,
                                               self.config)
            self._note_tokens(requests)
            return outputs
        rows = self.scheduler.update_from_output(scheduled, output.token_ids)
        if then is not None:
            then()
        if output.prompt_logprobs is not None:
            # A request aborted since the step was launched is forgotten: its positions are left out.
            scored = [(self.request_of_seq.get(scheduled.seqs[i].seq_id), scheduled.seqs[i], start, count)
                      for i, start, count in step.scored]
            self.output_processor.add_prompt_logprobs(scored, output.prompt_logprobs)
        seqs = [scheduled.sampled[i] for i in rows]
        requests = [self.request_of_seq[seq.seq_id] for seq in seqs]
        logprobs = output.logprobs.map(lambda column: [column[i] for i in rows]) if output.logprobs else None
        for seq, stop in self.output_processor.add_tokens(requests, seqs, logprobs):
            self.scheduler.finish(seq, "stop", stop)
        self.stats.generation_tokens += len(rows)
        return self.output_processor.step_outputs(self._note_tokens(requests))

    def _note_scheduled(self, scheduled: SchedulerOutput):
        now = time.time()
        for seq in scheduled.seqs[scheduled.num_decode:]:
            metrics = self.request_of_seq[seq.seq_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now

    def _note_tokens(self, requests: list[Request]) -> list[Request]:
        """These requests, which took tokens, each once and in order; finished ones are forgotten."""
        progressed = list(dict.fromkeys(requests))  # a request is the same object for all its sequences
        for request in self.stats.note_progress(progressed, time.time()):  # those that finished
            self._forget(request)
        return progressed

    def start_profile(self):
        """vLLM's: start the torch profiler that profiler_config asked for."""
        self.profiler.start()

    def stop_profile(self):
        """Stop it and write its trace into profiler_config's torch_profiler_dir."""
        self.profiler.stop()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's counters, gauges and histograms so far (`nanovllm.metrics`)."""
        return self.stats.metrics(self)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults, as vLLM gives them."""
        return self.input_processor.default_sampling_params()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix. While requests hold blocks: False, and nothing forgotten, unless
        `reset_running_requests` (vLLM's), which preempts the running ones to compute again from their
        tokens; their steps in flight finish first, and what those steps give comes with the next step()."""
        with self.guard:
            if reset_running_requests:
                self.held_outputs += self._process_then_sample()
                while self.in_flight:
                    self.held_outputs += self._process_oldest_step()
                for seq in list(reversed(self.scheduler.running)):  # preempted to the waiting queue's front
                    self.scheduler.preempt(seq)
            return self.scheduler.block_manager.reset_prefix_cache()
