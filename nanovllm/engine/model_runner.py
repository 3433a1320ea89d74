import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.async_output import AsyncStepOutput, UnsampledStep
from nanovllm.engine.cuda_graphs import GRAPH_LOGPROBS, MAX_CAPTURED_BATCH_SIZE, DecodeGraphs
from nanovllm.engine.device_inputs import DeviceInputs
from nanovllm.engine.kv_cache import allocate_kv_cache, free_gpu_bytes, layer_caches, num_kvcache_blocks
from nanovllm.engine.step_io import (
    DecodeInputs,
    GrammarMasks,
    PrefillInputs,
    SamplingInputs,
    StepInput,
    filtered_sampling,
    logprobs_sampling,
    plain_sampling,
    warmup_step_input,
)
from nanovllm.layers.attention import Attention
from nanovllm.layers.pooler import pool_prompts
from nanovllm.layers.sampled_logprobs import SampledLogprobs
from nanovllm.layers.sampler import Sampler, apply_token_bitmask, raw_logprobs
from nanovllm.models.registry import build_model
from nanovllm.utils.context import Context, prefill_context, set_context
from nanovllm.utils.fp8_weights import fp8_weights, scheme_for
from nanovllm.utils.loader import load_weights, weight_bytes
from nanovllm.utils.parallel import tensor_parallel
from nanovllm.utils.quantization import unquantized_modules

PROMPT_LOGPROBS_SLICE = 256  # prompt positions scored at once: their float32 logits span the vocabulary


class ModelRunner:
    """Runs the model on one tensor-parallel rank: builds and loads it, sizes its KV cache, captures
    the decode graphs, and computes steps. Rank 0 also samples, and keeps the sampling state of the
    running requests; every rank keeps the last step's samples on the device, where the next step's
    decodes take the tokens not yet known on the host. A step of decodes is two graph replays, the
    model's and the sampler's (three with log-probabilities).
    """

    def __init__(self, config: Config, rank: int):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.decode_graphs: DecodeGraphs | None = None
        self.inputs = DeviceInputs(self.device)
        self.mask_inputs = DeviceInputs(self.device)  # a buffer of their own: the step's inputs are still read
        # The last step's samples, row by row, where the next step's decodes take the tokens the host lacks.
        self.sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.unsampled: UnsampledStep | None = None  # a step whose model has run, waiting for its GrammarMasks
        self.pools = config.runner == "pooling"  # steps of prompt chunks only, pooled rather than sampled
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        free_at_start = free_gpu_bytes(self.device) if self.device.type == "cuda" else 0
        quantization_config = getattr(config.hf_config, "quantization_config", None)
        fp8_scheme = scheme_for(config.quantization, quantization_config) if self.device.type == "cuda" else None
        with torch.device(self.device), default_dtype(config.torch_dtype), tensor_parallel(rank, self.world_size), \
                fp8_weights(fp8_scheme, unquantized_modules(quantization_config)):  # a CPU dequantizes at load
            self.model = build_model(config.hf_config, pooling=self.pools)
            samples = rank == 0 and not self.pools
            self.sampler = Sampler(config.seed, config.max_num_seqs, config.hf_config.vocab_size) if samples else None
        load_weights(self.model, config)
        if rank == 0:
            print(f"nano-vllm: the model's weights take {weight_bytes(self.model) / 2**30:.2f} GiB a rank"
                  f"{f' (FP8, {fp8_scheme} scales)' if fp8_scheme else ''}",
                  file=sys.stderr, flush=True)
        activation_peak = self.warmup_model() if self.device.type == "cuda" else 0
        self.num_kvcache_blocks = num_kvcache_blocks(config, self.device, free_at_start, activation_peak)
        self.bind_kv_cache(*allocate_kv_cache(config, self.num_kvcache_blocks, self.device))
        if self.device.type == "cuda":
            self.warmup_cache_writes()
        if self.device.type == "cuda" and not config.enforce_eager:
            max_bs = min(config.max_num_seqs, MAX_CAPTURED_BATCH_SIZE)
            logits_width = config.hf_config.vocab_size if rank == 0 else 0  # only rank 0 holds logits
            logprobs = self._graph_logprobs if rank == 0 else None
            self.decode_graphs = DecodeGraphs(self._decode, self._sample, logprobs, max_bs, self.max_num_blocks_per_seq,
                                              config.max_num_seqs, logits_width, config.torch_dtype, self.device)

    @property
    def max_num_blocks_per_seq(self) -> int:
        return -(-(self.config.max_model_len + 1) // self.config.kvcache_block_size)

    def bind_kv_cache(self, kv_cache: torch.Tensor, scales: torch.Tensor | None = None):
        """Each attention layer's slice of the cache and an FP8 cache's scales ([k/v, layer, ...]), in layer order."""
        for layer, attention in enumerate(m for m in self.model.modules() if isinstance(m, Attention)):
            attention.k_cache, attention.v_cache, attention.kv_scales = layer_caches(kv_cache, scales, layer)

    def warmup_model(self) -> int:
        """Prefills before the cache exists, at the full token budget, at max_num_seqs one-token prompts
        and at one token: they compile every shape a step can meet. Returns the activation peak, above
        what stays allocated, that a step may need again."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        budget, max_num_seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        seq_len = min(self.config.max_model_len, budget)
        num_long = min(max(budget // seq_len, 1), max_num_seqs)
        shapes = [(num_long, seq_len, logprobs_sampling), (max_num_seqs, 1, filtered_sampling),
                  (1, 1, logprobs_sampling), (1, 1, plain_sampling)]
        for num_seqs, length, sampling in shapes:
            self._warmup_step(num_seqs, length, sampling)
        torch.cuda.synchronize(self.device)
        stats = torch.cuda.memory_stats(self.device)
        torch.cuda.empty_cache()
        return stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]

    def warmup_cache_writes(self):
        """A one-token prefill with the cache bound (slot -1, so nothing is written): the variant of the
        q/k/v kernel that stores K/V while keeping them for the prompt's own attention compiles here,
        not at the first request; so does the prompt kernel that reads the cache through a block table."""
        self._warmup_step(1, 1, plain_sampling)
        next(m for m in self.model.modules() if isinstance(m, Attention)).compile_paged_prompts(self.config.torch_dtype)

    def _warmup_step(self, num_seqs: int, length: int, sampling):
        """A prefill of num_seqs prompts of `length` zeros, sampled as `sampling(num_seqs)` says, run to its end."""
        output = self.execute_model(warmup_step_input(num_seqs, length, sampling(num_seqs, self.config.max_num_seqs)))
        if output is not None:
            output.result()

    @torch.inference_mode()
    def execute_model(self, step: StepInput) -> AsyncStepOutput | None:
        """Launch a step on the device. Rank 0 samples its rows as step.sampling says and returns its output,
        which reaches the host when the device is done; the other ranks return None. Every rank keeps the
        step's tokens in `sampled`.

        Decodes replay a graph where one is captured for their batch size, and its inputs go into the
        graphs' own buffer; so do their sampling slots when a step of decodes alone samples in a graph.
        Everything else comes in one upload, the joining sequences' sampling state too. A step whose rows
        await grammar masks stops before sampling, and returns None: `sample_tokens` completes it."""
        assert self.unsampled is None, "the step before waits for its masks: sample_tokens first"
        if self.pools:
            return self._pool(step)
        sampling = step.sampling
        graphs = self.decode_graphs if step.decode is not None and self._can_replay(step.num_decode) else None
        graph_samples = (graphs is not None and step.prefill is None
                         and graphs.can_sample(sampling.filter, sampling.num_logprobs))
        if graphs is not None:
            graphs.load(step.decode, sampling.slots if graph_samples else None)
        eager_decode = step.decode if graphs is None else None
        eager_slots = sampling.slots if self.rank == 0 and not graph_samples else None
        state_updates = (sampling.joins, sampling.bias_updates) if self.rank == 0 else (None, None)
        decode, prefill, slots, joins, bias_updates = self.inputs.upload(eager_decode, step.prefill, eager_slots,
                                                                         *state_updates)
        self._update_sampling_state(joins, bias_updates)
        if graphs is not None:
            decode_logits = graphs.replay_decode(step.num_decode)
        else:
            decode_logits = self._decode(decode) if decode is not None else None
        logits, prefill_hidden_states = self._logits(decode_logits, prefill)
        prompt_logprobs = self._prompt_logprobs(prefill, prefill_hidden_states)
        unsampled = UnsampledStep(step, logits, slots, graph_samples, prompt_logprobs)
        if sampling.awaits_masks:
            self.unsampled = unsampled
            return None
        return self._sample_step(unsampled)

    def _pool(self, step: StepInput) -> AsyncStepOutput | None:
        """A pooling engine's step: the float32 pooled state of each prompt that ends in it (`layers/pooler.py`; a
        classifier's scores of it), in row order (a prompt's one last token, after earlier chunks, is a decode row)."""
        decode, prefill = self.inputs.upload(step.decode, step.prefill)
        parts = [self._decode_hidden_states(decode)] if decode is not None else []
        if prefill is not None:
            parts.append(pool_prompts(self._prefill(prefill), prefill.cu_seqlens_q, prefill.sample_indices,
                                      self.config.pooling_type))
        if self.rank != 0:
            return None
        pooled = torch.cat(parts)
        pooled = (self.model.classify(pooled) if self.config.convert == "classify" else pooled).float()
        return AsyncStepOutput(torch.empty(0, dtype=torch.int64, device=self.device), None, pooled=pooled)

    @torch.inference_mode()
    def sample_tokens(self, masks: GrammarMasks | None) -> AsyncStepOutput | None:
        """Sample the step whose model ran last, its constrained rows (rank 0's logits) masked first."""
        unsampled, self.unsampled = self.unsampled, None
        if masks is not None and unsampled.logits is not None:
            masks, = self.mask_inputs.upload(masks)  # without waiting for the model, still running
            apply_token_bitmask(unsampled.logits, masks.rows, masks.bitmask)
        return self._sample_step(unsampled)

    def _sample_step(self, unsampled: UnsampledStep) -> AsyncStepOutput | None:
        step, logits, slots, graph_samples, prompt_logprobs = unsampled
        sampling = step.sampling
        if graph_samples:
            self.decode_graphs.replay_sample(step.num_decode, sampling.filter)
            token_ids, logprobs = self.sampled[:step.num_decode], None
            if self.rank == 0 and sampling.num_logprobs is not None:
                logprobs = self.decode_graphs.replay_logprobs(step.num_decode, sampling.num_logprobs)
        else:
            token_ids, logprobs = self._sample_eagerly(step.num_sampled, logits, slots, sampling)
        return AsyncStepOutput(token_ids, logprobs, prompt_logprobs) if self.rank == 0 else None

    def _update_sampling_state(self, joins, bias_updates):
        if joins is not None:
            self.sampler.state.join(joins)
        if bias_updates is not None:
            self.sampler.state.update_bias(bias_updates)

    def _can_replay(self, num_decode: int) -> bool:
        return self.decode_graphs is not None and self.decode_graphs.can_replay(num_decode)

    def _logits(self, decode_logits: torch.Tensor | None,
                prefill: PrefillInputs | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logits of the rows that sample, in row order (rank 0's; None elsewhere or if none do): the
        decodes', then those of the chunks that reach their prompt's end; and the hidden states of the
        chunks' tokens ([num_prefill_tokens, hidden], None without)."""
        parts, prefill_hidden_states = [decode_logits] if decode_logits is not None else [], None
        if prefill is not None:
            prefill_hidden_states = self._prefill(prefill)
            if len(prefill.sample_indices):
                parts.append(self.model.compute_logits(prefill_hidden_states[prefill.sample_indices]))
        if self.rank != 0 or not parts:
            return None, prefill_hidden_states
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), prefill_hidden_states

    def _decode(self, decode: DecodeInputs, logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """The decodes' logits, [num_seqs, vocab_size] on rank 0 (into `logits` where given), None elsewhere;
        each row's token is the previous step's sample where pending_rows >= 0. What the graphs capture."""
        return self.model.compute_logits(self._decode_hidden_states(decode), logits)

    def _decode_hidden_states(self, decode: DecodeInputs) -> torch.Tensor:
        samples = self.sampled[decode.pending_rows.clamp_min(0)]
        token_ids = torch.where(decode.pending_rows >= 0, samples, decode.token_ids)
        context = Context(is_prefill=False, slot_mapping=decode.slot_mapping, context_lens=decode.context_lens,
                          seq_order=decode.seq_order, block_tables=decode.block_tables)
        with set_context(context):
            return self.model(token_ids, decode.positions)

    def _prefill(self, prefill: PrefillInputs) -> torch.Tensor:
        """The prompt chunks' hidden states, through the varlen kernels. [num_tokens, hidden]"""
        context = prefill_context(prefill.cu_seqlens_q, prefill.cu_seqlens_k, prefill.max_seqlen_q,
                                  prefill.max_seqlen_k, prefill.slot_mapping, prefill.block_tables,
                                  prefill.num_paged_seqs, prefill.num_paged_tokens, prefill.max_paged_seqlen_q)
        with set_context(context):
            return self.model(prefill.token_ids, prefill.positions)

    def _prompt_logprobs(self, prefill: PrefillInputs | None, hidden_states: torch.Tensor | None):
        """Raw log-probabilities of the next prompt token at the scored prompt positions (rank 0), in slices
        that bound the logits' memory."""
        if prefill is None or not len(prefill.prompt_logprob_indices):
            return None
        parts = []
        for rows, token_ids in zip(prefill.prompt_logprob_indices.split(PROMPT_LOGPROBS_SLICE),
                                   prefill.prompt_logprob_token_ids.split(PROMPT_LOGPROBS_SLICE)):
            logits = self.model.compute_logits(hidden_states[rows])
            if self.rank == 0:
                parts.append(raw_logprobs(logits.float(), token_ids, prefill.num_prompt_logprobs))
        return SampledLogprobs(*(torch.cat(column) for column in zip(*(p.columns() for p in parts)))) if parts else None

    def _sample(self, logits: torch.Tensor, slots: torch.Tensor, filter: int):
        """Rank 0 samples the rows from `logits` and their slots; every rank keeps the tokens. What the graphs
        capture."""
        if self.rank == 0:
            token_ids = self.sampler(logits, slots, filter)
        else:
            token_ids = torch.empty(len(slots), dtype=torch.int64, device=self.device)
        self._keep_sampled(token_ids)

    def _graph_logprobs(self, logits: torch.Tensor, bs: int) -> SampledLogprobs:
        return raw_logprobs(logits, self.sampled[:bs], GRAPH_LOGPROBS)

    def _sample_eagerly(self, num_sampled: int, logits: torch.Tensor | None, slots: torch.Tensor | None,
                        sampling: SamplingInputs):
        """Rank 0 samples the rows as `sampling` says; every rank keeps the tokens. A step of prompt chunks
        alone may sample nothing."""
        token_ids = torch.empty(num_sampled, dtype=torch.int64, device=self.device)
        logprobs = None
        if num_sampled:
            if self.rank == 0:
                token_ids = self.sampler(logits, slots, sampling.filter)
                if sampling.num_logprobs is not None:
                    logprobs = raw_logprobs(logits, token_ids, sampling.num_logprobs)
            self._keep_sampled(token_ids)
        return self.sampled[:num_sampled], logprobs

    def _keep_sampled(self, token_ids: torch.Tensor):
        """The step's tokens, rank 0's on every rank, into `sampled`."""
        if self.world_size > 1:
            dist.broadcast(token_ids, src=0)
        self.sampled[:len(token_ids)] = token_ids

    def exit(self):
        """Give back the device memory: graphs and their pool, the KV cache, the model."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.decode_graphs = self.model = None  # the model holds the KV cache
        self.sampler = self.inputs = self.mask_inputs = self.sampled = None


@contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
