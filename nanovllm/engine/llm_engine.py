import atexit
import itertools
import json
import os
from collections.abc import Sequence as SequenceOf
from time import perf_counter
from typing import NamedTuple

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import make_config
from nanovllm.engine.executor import Executor
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

# A text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": [...]} dicts.
Prompt = str | list[int] | dict


class Request(NamedTuple):
    request_id: int
    prompt: str | None
    seqs: list[Sequence]  # one per completion (SamplingParams.n)


class LLMEngine:
    """Owns the tokenizer, the scheduler and the model runners, and drives them step by step."""

    def __init__(self, model: str, **kwargs):
        self.config = config = make_config(model, kwargs)
        self.executor = None
        self.request_counter = itertools.count()
        atexit.register(self.exit)
        try:
            self.executor = Executor(config)
            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=config.trust_remote_code)
            self.output_processor = OutputProcessor(self.tokenizer)
            # Rank 0's runner shares this config: its sampler reads these ids to enforce min_tokens.
            config.eos_token_ids = eos_token_ids(config.model, self.tokenizer, config.hf_config)
            self.scheduler = self._make_scheduler()
        except BaseException:
            self.exit()
            raise

    def _make_scheduler(self) -> Scheduler:
        config = self.config
        num_blocks = self.executor.model_runner.num_kvcache_blocks
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
            eos_token_ids=config.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching,
        )

    def exit(self):
        """Stop every model runner and release their processes, port and shared memory."""
        atexit.unregister(self.exit)
        if self.executor is not None:
            self.executor.exit()
            self.executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.exit()

    # --- requests ---

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> Request:
        """Queue one prompt (checked first); `step()` then advances it with everything else queued."""
        request = self._make_request(0, prompt, sampling_params)
        for seq in request.seqs:
            self.scheduler.add(seq)
        return request

    def _make_request(self, index: int, prompt: Prompt, sampling_params: SamplingParams,
                      add_special_tokens: bool = True) -> Request:
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling params {index} is a {type(sampling_params).__name__}, not SamplingParams")
        text, token_ids = parse_prompt(index, prompt)
        if token_ids is None:
            token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        self._check_prompt(index, token_ids)
        seeds = child_seeds(sampling_params.seed, sampling_params.n)
        seqs = [Sequence(token_ids, sampling_params, seed) for seed in seeds]
        return Request(next(self.request_counter), text, seqs)

    def _check_prompt(self, index: int, token_ids: list[int]):
        if not token_ids:
            raise ValueError(f"prompt {index} is empty")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"prompt {index} has {len(token_ids)} tokens, longer than "
                             f"max_model_len={self.config.max_model_len}")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")

    def _make_requests(self, prompts, sampling_params, add_special_tokens: bool = True) -> list[Request]:
        if is_single_prompt(prompts):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        return [self._make_request(i, p, sp, add_special_tokens)
                for i, (p, sp) in enumerate(zip(prompts, sampling_params))]

    # --- running ---

    def step(self) -> tuple[list[Sequence], int, bool]:
        """Run one scheduled step; returns the finished sequences, the tokens computed and
        whether it was a prefill step."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return [], 0, is_prefill
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        sampled = [seq for seq in seqs if seq.samples_this_step]
        token_ids, logprobs = self.executor.call("run", seqs, is_prefill)
        finished = self.scheduler.postprocess(seqs, token_ids)
        if logprobs is not None:
            self.output_processor.add_logprobs(sampled, logprobs)
        return finished + self._stop_on_strings(sampled), num_tokens, is_prefill

    def _stop_on_strings(self, seqs: list[Sequence]) -> list[Sequence]:
        stopped = []
        for seq in seqs:
            match = None if seq.is_finished else self.output_processor.find_stop_string(seq)
            if match:
                stop, seq.output_text = match
                self.scheduler.finish(seq, "stop", stop)
                stopped.append(seq)
        return stopped

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (a string or a list of token ids).

        `sampling_params` is one SamplingParams for all prompts or a list, one per prompt.
        Returns, in the prompts' order, a RequestOutput per prompt; `out["text"]` and
        `out["token_ids"]` give its first completion's. Every prompt is checked before any work
        starts: a bad one raises ValueError and runs nothing.
        """
        return self._generate(self._make_requests(prompts, sampling_params), use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of
        them, each rendered with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self._render_chat(i, conversation, add_generation_prompt, chat_template_kwargs or {})
                   for i, conversation in enumerate(conversations)]
        # The template already holds any special tokens the model needs.
        return self._generate(self._make_requests(prompts, sampling_params, add_special_tokens=False), use_tqdm)

    def _render_chat(self, index: int, conversation, add_generation_prompt: bool, kwargs: dict) -> str:
        if not conversation or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in conversation):
            raise ValueError(f"conversation {index} must be a non-empty list of {{'role', 'content'}} messages")
        return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)

    def _generate(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        seqs = [seq for request in requests for seq in request.seqs]
        for seq in seqs:
            self.scheduler.add(seq)
        try:
            self._run_until_done(requests, use_tqdm)
        except BaseException:  # an error or an interrupt: the engine must stay usable for the next call
            self.scheduler.abort(seqs)
            raise
        return [self.output_processor.request_output(r.request_id, r.prompt, r.seqs) for r in requests]

    def _run_until_done(self, requests: list[Request], use_tqdm: bool):
        request_of = {seq.seq_id: request for request in requests for seq in request.seqs}
        with tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as pbar:
            prefill_throughput = decode_throughput = 0.0
            while not self.is_finished():
                start = perf_counter()
                finished, num_tokens, is_prefill = self.step()
                throughput = num_tokens / max(perf_counter() - start, 1e-9)
                if is_prefill:
                    prefill_throughput = throughput
                else:
                    decode_throughput = throughput
                pbar.set_postfix_str(f"prefill {prefill_throughput:.0f} tok/s, decode {decode_throughput:.0f} tok/s",
                                     refresh=False)
                completed = {request_of[seq.seq_id].request_id for seq in finished
                             if all(s.is_finished for s in request_of[seq.seq_id].seqs)}
                pbar.update(len(completed))


def is_single_prompt(prompts) -> bool:
    """One prompt (a text, a dict, or token ids) rather than a list of them."""
    if isinstance(prompts, str | dict):
        return True
    return isinstance(prompts, SequenceOf) and bool(prompts) and isinstance(prompts[0], int)


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def parse_prompt(index: int, prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt; the token ids are None when the text is still to be tokenized."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - set(PROMPT_DICT_KEYS))
        if unknown or not set(prompt) & set(PROMPT_DICT_KEYS):
            raise ValueError(f"prompt {index} is a dict with keys {sorted(prompt)}: expected 'prompt' (a text) "
                             f"or 'prompt_token_ids' (a list of token ids)")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), parse_prompt(index, list(prompt["prompt_token_ids"]))[1]
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt {index}: 'prompt' must be a text, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"], None
    if isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"prompt {index} is a {type(prompt).__name__}: expected a text, a list of token ids, "
                     f"or a dict with 'prompt' or 'prompt_token_ids'")


def eos_token_ids(model: str, tokenizer, hf_config) -> frozenset[int]:
    """The tokenizer's end-of-sequence id and those of config.json and generation_config.json."""
    ids = [tokenizer.eos_token_id, hf_config.eos_token_id]
    path = os.path.join(model, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            ids.append(json.load(f).get("eos_token_id"))
    flat = [i for entry in ids for i in (entry if isinstance(entry, list) else [entry])]
    return frozenset(i for i in flat if i is not None)


def child_seeds(seed: int | None, n: int) -> list[int | None]:
    """One seed per completion: the request's for the first, distinct ones derived from it for the rest."""
    if seed is None:
        return [None] * n
    return [seed & (2**63 - 1)] + [hash((seed, i)) & (2**63 - 1) for i in range(1, n)]
