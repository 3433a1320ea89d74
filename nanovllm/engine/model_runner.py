from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import MAX_CAPTURED_BATCH_SIZE, DecodeGraphs
from nanovllm.engine.device_inputs import DeviceInputs
from nanovllm.engine.kv_cache import allocate_kv_cache, free_gpu_bytes, num_kvcache_blocks
from nanovllm.engine.sampling_batch import make_sampling_batch
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_input import StepInput, warmup_step_input
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import SampledLogprobs, Sampler, SamplingBatch, raw_logprobs
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import Context, set_context
from nanovllm.utils.loader import load_model
from nanovllm.utils.parallel import tensor_parallel

PROMPT_LOGPROBS_SLICE = 256  # prompt positions scored at once: their float32 logits span the vocabulary


class ModelRunner:
    """Runs the model on one tensor-parallel rank: builds and loads it, sizes its KV cache, captures
    the decode graphs, and computes steps. Rank 0 also samples; every rank keeps the last step's
    samples on the device, where the next step's inputs take the tokens not yet known on the host.
    A step of decoding rows with plain sampling is one graph replay, its sampling included.
    """

    def __init__(self, config: Config, rank: int):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.decode_graphs: DecodeGraphs | None = None
        self.inputs = DeviceInputs(self.device)
        # The last step's samples, row by row, where the next step's inputs take the tokens the host lacks.
        self.sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        free_at_start = free_gpu_bytes(self.device) if self.device.type == "cuda" else 0
        with torch.device(self.device), default_dtype(config.torch_dtype), tensor_parallel(rank, self.world_size):
            self.model = Qwen3ForCausalLM(config.hf_config)
            self.sampler = Sampler(config.seed)
        load_model(self.model, config.model)
        self.kv_cache: torch.Tensor | None = None
        activation_peak = self.warmup_model() if self.device.type == "cuda" else 0
        self.num_kvcache_blocks = num_kvcache_blocks(config, self.device, free_at_start, activation_peak)
        self.bind_kv_cache(allocate_kv_cache(config, self.num_kvcache_blocks, self.device))
        if self.device.type == "cuda":
            self.warmup_cache_writes()
        if self.device.type == "cuda" and not config.enforce_eager:
            max_bs = min(config.max_num_seqs, MAX_CAPTURED_BATCH_SIZE)
            logits_width = config.hf_config.vocab_size if rank == 0 else 0  # only rank 0 holds logits
            self.decode_graphs = DecodeGraphs(self._decode_and_sample, max_bs, self.max_num_blocks_per_seq,
                                              logits_width, config.torch_dtype, self.device)

    @property
    def max_num_blocks_per_seq(self) -> int:
        return -(-(self.config.max_model_len + 1) // self.config.kvcache_block_size)

    def bind_kv_cache(self, kv_cache: torch.Tensor):
        """Each attention layer's slice of the cache: [k/v, layer, ...] in the model's layer order."""
        self.kv_cache = kv_cache
        for layer, attention in enumerate(m for m in self.model.modules() if isinstance(m, Attention)):
            attention.k_cache, attention.v_cache = kv_cache[0, layer], kv_cache[1, layer]

    def warmup_model(self) -> int:
        """Prefills before the cache exists, at the full token budget, at max_num_seqs one-token prompts
        and at one token: they compile every shape a step can meet. Returns the activation peak, above
        what stays allocated, that a step may need again."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        budget, max_num_seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        seq_len = min(self.config.max_model_len, budget)
        # The max_num_seqs rows sample with filters and logprobs: the eager path's sort over the vocabulary
        # is the sampler's memory peak.
        num_long = min(max(budget // seq_len, 1), max_num_seqs)
        # LOGPROBS rows take the plain kernels on float32 logits, PLAIN rows on the model's.
        shapes = [(num_long, seq_len, LOGPROBS), (max_num_seqs, 1, FILTERED), (1, 1, LOGPROBS), (1, 1, PLAIN)]
        for num_seqs, length, params in shapes:
            self._warmup_step(num_seqs, length, params)
        torch.cuda.synchronize(self.device)
        stats = torch.cuda.memory_stats(self.device)
        torch.cuda.empty_cache()
        return stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]

    def warmup_cache_writes(self):
        """A one-token prefill with the cache bound (slot -1, so nothing is written): the variant of the
        q/k/v kernel that stores K/V while keeping them for the prompt's own attention compiles here,
        not at the first request."""
        self._warmup_step(1, 1, PLAIN)

    def _warmup_step(self, num_seqs: int, length: int, params: SamplingParams):
        """A prefill of num_seqs prompts of `length` zeros, sampled with `params`, run to its end."""
        sampling = make_sampling_batch(_warmup_seqs(num_seqs, params), self.config.hf_config.vocab_size, ())
        output = self.execute_model(warmup_step_input(num_seqs, length), sampling)
        if output is not None:
            output.result()

    @torch.inference_mode()
    def execute_model(self, step: StepInput, sampling: SamplingBatch) -> "StepOutput | None":
        """Launch a step on the device. Rank 0 samples its rows as `sampling` says and returns its output,
        which arrives on the host when the device is done; the other ranks return None. Every rank keeps
        the step's tokens in `sampled`."""
        if self._samples_in_graph(step, sampling):
            self.decode_graphs.load(step, sampling.temperatures)
            self.decode_graphs.replay(step.num_decode)
            token_ids, logprobs, prompt_logprobs = self.sampled[:step.num_decode], None, None
        else:
            token_ids, logprobs, prompt_logprobs = self._execute_eagerly(step, sampling)
        return StepOutput(token_ids, logprobs, prompt_logprobs) if self.rank == 0 else None

    def _samples_in_graph(self, step: StepInput, sampling: SamplingBatch) -> bool:
        """A step of decoding rows alone, which a graph can replay, sampled at their temperatures alone."""
        return (self.decode_graphs is not None and step.num_tokens == step.num_decode
                and self.decode_graphs.can_replay(step.num_decode) and sampling.is_plain)

    def _decode_and_sample(self, input_ids: torch.Tensor, positions: torch.Tensor, pending_rows: torch.Tensor,
                           temperatures: torch.Tensor, logits: torch.Tensor):
        """The decode step the graphs capture: the rows' tokens (the previous step's samples where
        pending_rows >= 0), the model, its logits (rank 0's, into `logits`), and tokens sampled at the
        rows' temperatures, stored in `sampled` on every rank."""
        input_ids = torch.where(pending_rows >= 0, self.sampled[pending_rows.clamp_min(0)], input_ids)
        if self.model.compute_logits(self.model(input_ids, positions), logits) is not None:
            token_ids = self.sampler.sample_plain(logits, temperatures)
        else:
            token_ids = torch.empty_like(input_ids)
        self._keep_sampled(token_ids)

    def _keep_sampled(self, token_ids: torch.Tensor):
        """The step's tokens, rank 0's on every rank, into `sampled`."""
        if self.world_size > 1:
            dist.broadcast(token_ids, src=0)
        self.sampled[:len(token_ids)] = token_ids

    def _execute_eagerly(self, step: StepInput, sampling: SamplingBatch):
        """A step with prompt chunks, or sampling that needs more than temperatures: the sampler runs on
        the logits of the decoding rows (from a graph where one can replay them) and of the chunks."""
        tensors, sampling = self._upload(step, sampling if self.rank == 0 else None)
        logits, prefill_hidden_states = self._logits(step, tensors)
        prompt_logprobs = self._prompt_logprobs(step, tensors, prefill_hidden_states)
        token_ids, logprobs = torch.empty(len(step.sample_indices), dtype=torch.int64, device=self.device), None
        if len(step.sample_indices):  # a step of prompt chunks alone samples nothing
            if self.rank == 0:
                token_ids, logprobs = self.sampler(logits, sampling)
            self._keep_sampled(token_ids)
        return self.sampled[:len(token_ids)], logprobs, prompt_logprobs

    def _upload(self, step: StepInput, sampling: SamplingBatch | None):
        """The step's arrays and the sampling batch's (where given) on the device, in one transfer."""
        n = step.num_decode
        prefill_cu_seqlens_k = np.zeros(step.num_seqs - n + 1, dtype=np.int32)
        np.cumsum(step.seq_lens[n:], out=prefill_cu_seqlens_k[1:])
        arrays = dict(token_ids=step.token_ids, positions=step.positions, slot_mapping=step.slot_mapping,
                      seq_lens=step.seq_lens, block_tables=step.block_tables,
                      prefill_cu_seqlens_q=step.cu_seqlens_q[n:] - n, prefill_cu_seqlens_k=prefill_cu_seqlens_k,
                      prefill_sample_indices=step.sample_indices[n:] - n,
                      pending_indices=step.pending_indices, pending_rows=step.pending_rows,
                      prompt_logprob_rows=step.prompt_logprob_indices - n,
                      prompt_logprob_token_ids=step.prompt_logprob_token_ids)
        sampling_arrays = sampling.arrays() if sampling is not None else []
        uploaded = self.inputs.upload([*arrays.values(), *sampling_arrays])
        tensors = dict(zip(arrays, uploaded))
        return tensors, sampling.with_arrays(uploaded[len(arrays):]) if sampling is not None else None

    def _logits(self, step: StepInput, tensors: dict[str, torch.Tensor]):
        """The logits of the tokens that sample, in row order (rank 0's; None elsewhere or if none do): every decoding
        sequence's one token, then the last token of each prompt chunk that reaches its prompt's end;
        and the hidden states of every prompt-chunk token ([num_tokens - num_decode, hidden], None
        without chunks)."""
        n = step.num_decode
        parts, prefill = [], None
        if n:
            parts.append(self._decode_logits(step, tensors))
        if step.num_tokens > n:
            prefill = self._run_prefill(step, tensors)
            if len(step.sample_indices) > n:  # a chunk reaches its prompt's end
                parts.append(self.model.compute_logits(prefill[tensors["prefill_sample_indices"]]))
        if self.rank != 0 or not parts:
            return None, prefill
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), prefill

    def _prompt_logprobs(self, step: StepInput, t: dict[str, torch.Tensor], prefill: torch.Tensor | None):
        """Raw log-probabilities of the next prompt token at the scored prompt positions (rank 0), in slices
        that bound the logits' memory."""
        if not step.prompt_logprob_indices.size:
            return None
        parts = []
        for rows, token_ids in zip(t["prompt_logprob_rows"].split(PROMPT_LOGPROBS_SLICE),
                                   t["prompt_logprob_token_ids"].split(PROMPT_LOGPROBS_SLICE)):
            logits = self.model.compute_logits(prefill[rows])
            if self.rank == 0:
                parts.append(raw_logprobs(logits.float(), token_ids, step.num_prompt_logprobs))
        return SampledLogprobs(*(torch.cat(column) for column in zip(*(p.columns() for p in parts)))) if parts else None

    def _decode_logits(self, step: StepInput, t: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The logits of the first n tokens, one per decoding sequence: a graph replay where one was
        captured (its own sampling is overwritten later). [n, vocab_size] on rank 0; elsewhere None, or
        an empty view where a graph replayed."""
        n, graphs = step.num_decode, self.decode_graphs
        if graphs is not None and graphs.can_replay(n):
            graphs.load(step)
            return graphs.replay(n)
        input_ids = t["token_ids"]
        if t["pending_indices"].numel():
            input_ids[t["pending_indices"]] = self.sampled[t["pending_rows"]]
        context = Context(is_prefill=False, slot_mapping=t["slot_mapping"][:n],
                                context_lens=t["seq_lens"][:n], block_tables=t["block_tables"][:n])
        with set_context(context):
            return self.model.compute_logits(self.model(input_ids[:n], t["positions"][:n]))

    def _run_prefill(self, step: StepInput, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The prompt chunks after the decoding tokens, through the varlen kernels. [num_chunk_tokens, hidden]"""
        n = step.num_decode
        query_lens = np.diff(step.cu_seqlens_q[n:])
        context = Context(is_prefill=True, cu_seqlens_q=t["prefill_cu_seqlens_q"],
                                cu_seqlens_k=t["prefill_cu_seqlens_k"], max_seqlen_q=int(query_lens.max()),
                                max_seqlen_k=int(step.seq_lens[n:].max()), slot_mapping=t["slot_mapping"][n:],
                                block_tables=t["block_tables"][n:], has_cached_prefix=step.has_cached_prefix)
        with set_context(context):
            return self.model(t["token_ids"][n:], t["positions"][n:])

    def exit(self):
        """Give back the device memory: graphs and their pool, the KV cache, the model."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.decode_graphs = self.kv_cache = self.model = None
        self.sampler = self.inputs = self.sampled = None


class StepOutput:
    """Rank 0's sampled tokens of a step, with their log-probabilities and those of the scored prompt
    positions where asked for, copied to the host as the device finishes; `result()` waits for them."""

    def __init__(self, token_ids: torch.Tensor, logprobs: SampledLogprobs | None,
                 prompt_logprobs: SampledLogprobs | None = None):
        self.on_host = [_to_host(token_ids)] + [[_to_host(t) for t in x.columns()] if x is not None else None
                                               for x in (logprobs, prompt_logprobs)]
        self.done = None
        if token_ids.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def result(self) -> "StepResult":
        if self.done is not None:
            self.done.synchronize()
        token_ids, logprobs, prompt_logprobs = self.on_host
        as_lists = [None if x is None else [t.tolist() for t in x] for x in (logprobs, prompt_logprobs)]
        return StepResult(token_ids.tolist(), *as_lists)


@dataclass(slots=True)
class StepResult:
    """A step's output on the host. Log-probabilities come as four per-row lists: top ids, top
    log-probabilities, the chosen token's log-probability and its rank."""

    token_ids: list[int]
    logprobs: list[list] | None = None  # of the sampled tokens
    prompt_logprobs: list[list] | None = None  # of the next prompt token at each scored position


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy on the host (the tensor may be a view of a buffer the next step overwrites)."""
    if not t.is_cuda:
        return t.clone()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


PLAIN, LOGPROBS = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, logprobs=1)
FILTERED = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, logprobs=20)


def _warmup_seqs(num_seqs: int, params: SamplingParams) -> list[Sequence]:
    seqs = [Sequence([0], params) for _ in range(num_seqs)]
    for seq in seqs:
        seq.add_pending_token(0)
    return seqs


@contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
