import atexit
import json
import os
import socket
import uuid
from collections.abc import Sequence as SequenceOf
from time import perf_counter

import torch.multiprocessing as mp
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import make_config
from nanovllm.engine.model_runner import ModelRunner, run_worker
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


class LLMEngine:
    """Owns the tokenizer, the scheduler and the model runners, and drives them step by step."""

    def __init__(self, model: str, **kwargs):
        self.config = config = make_config(model, kwargs)
        self.processes, self.model_runner = [], None
        atexit.register(self.exit)
        try:
            self._start_model_runners()
            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
            config.eos_token_ids = eos_token_ids(config.model, self.tokenizer, config.hf_config)
            self.scheduler = self._make_scheduler()
        except BaseException:
            self.exit()
            raise

    def _start_model_runners(self):
        self.port = free_port()
        init_method = f"tcp://127.0.0.1:{self.port}"
        shm_name = f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        ctx = mp.get_context("spawn")
        events = []
        for rank in range(1, self.config.tensor_parallel_size):
            event = ctx.Event()
            process = ctx.Process(target=run_worker, args=(self.config, rank, event, init_method, shm_name))
            process.start()
            self.processes.append(process)
            events.append(event)
        self.model_runner = ModelRunner(self.config, 0, events, init_method, shm_name)

    def _make_scheduler(self) -> Scheduler:
        config = self.config
        num_blocks = self.model_runner.num_kvcache_blocks
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
        """Stop every model runner and release their processes, ports and shared memory."""
        atexit.unregister(self.exit)
        runners_started = self.model_runner is not None
        if runners_started:
            self.model_runner.call("exit")
            self.model_runner = None
        for process in self.processes:
            process.join(timeout=30 if runners_started else 0)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.exit()

    # --- requests ---

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams):
        self.scheduler.add(self._make_sequence(prompt, sampling_params, index=0))

    def _make_sequence(self, prompt: Prompt, sampling_params: SamplingParams, index: int) -> Sequence:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError(f"prompt {index} is empty")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"prompt {index} has {len(token_ids)} tokens, longer than "
                             f"max_model_len={self.config.max_model_len}")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling params {index} is a {type(sampling_params).__name__}, not SamplingParams")
        return Sequence(token_ids, sampling_params)

    def _make_sequences(self, prompts, sampling_params) -> list[Sequence]:
        if isinstance(prompts, str) or (isinstance(prompts, SequenceOf) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        return [self._make_sequence(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, sampling_params))]

    def step(self) -> tuple[list[Sequence], int, bool]:
        """Run one scheduled step; returns the finished sequences, the tokens computed and
        whether it was a prefill step."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return [], 0, is_prefill
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        token_ids = self.model_runner.call("run", seqs, is_prefill)
        return self.scheduler.postprocess(seqs, token_ids), num_tokens, is_prefill

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Complete every prompt (a string or a list of token ids).

        `sampling_params` is one SamplingParams for all prompts or a list, one per prompt.
        Returns, in the prompts' order, a dict per prompt with the completion's "text" and "token_ids".
        Every prompt is checked before any work starts: a bad one raises ValueError and runs nothing.
        """
        seqs = self._make_sequences(prompts, sampling_params)
        for seq in seqs:
            self.scheduler.add(seq)
        try:
            self._run_until_done(len(seqs), use_tqdm)
        except BaseException:
            self._abort(seqs)
            raise
        return [{"text": self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True),
                 "token_ids": seq.completion_token_ids} for seq in seqs]

    def _run_until_done(self, num_seqs: int, use_tqdm: bool):
        with tqdm(total=num_seqs, desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as pbar:
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
                pbar.update(len(finished))

    def _abort(self, seqs: list[Sequence]):
        """Drop `seqs` from the scheduler and free their blocks, so the engine can serve the next call."""
        scheduler = self.scheduler
        for seq in seqs:
            if seq.block_table:
                scheduler.block_manager.deallocate(seq)
            for queue in (scheduler.waiting, scheduler.running):
                if seq in queue:
                    queue.remove(seq)


def eos_token_ids(model: str, tokenizer, hf_config) -> frozenset[int]:
    """The tokenizer's end-of-sequence id and those of config.json and generation_config.json."""
    ids = [tokenizer.eos_token_id, hf_config.eos_token_id]
    path = os.path.join(model, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            ids.append(json.load(f).get("eos_token_id"))
    flat = [i for entry in ids for i in (entry if isinstance(entry, list) else [entry])]
    return frozenset(i for i in flat if i is not None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
