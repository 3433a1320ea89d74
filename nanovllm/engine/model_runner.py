import pickle
import traceback
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.sampling_batch import make_sampling_batch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention, make_attention_backend
from nanovllm.layers.sampler import Sampler
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.utils.context import Context, set_context
from nanovllm.utils.loader import load_model

CPU_KVCACHE_BYTES = 1 << 30
SHM_SIZE = 1 << 24


class ModelRunner:
    """Runs the model on one tensor-parallel rank.

    Rank 0 lives in the engine's process; ranks 1.. are spawned and sit in `loop`. Rank 0's
    `call(method, *args)` writes the call into shared memory, wakes the others, and then every
    rank runs the same method, so one code path serves any tensor-parallel size.
    """

    def __init__(self, config: Config, rank: int, events: list[Event] | Event, init_method: str, shm_name: str):
        self.config = config
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.rank = rank
        self.events = events
        self.shm_name = shm_name
        self.shm = None
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.enforce_eager = config.enforce_eager or self.device.type != "cuda"
        self.decode_graphs: DecodeGraphs | None = None
        self._init_distributed(init_method)
        try:
            self._build_model()
            self._open_shared_memory()
        except BaseException:
            dist.destroy_process_group()
            raise

    def _init_distributed(self, init_method: str):
        if dist.is_initialized():
            raise RuntimeError("another nano-vllm engine is running in this process: call its exit() first")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, world_size=self.world_size, rank=self.rank)

    def _build_model(self):
        default_dtype, default_device = torch.get_default_dtype(), torch.get_default_device()
        torch.set_default_dtype(self.config.torch_dtype)
        torch.set_default_device(self.device)
        try:
            self.model = Qwen3ForCausalLM(self.config.hf_config)
            load_model(self.model, self.config.model)
            backend = make_attention_backend(self.device)
            for module in self.attention_layers():
                module.backend = backend
            self.sampler = Sampler()
            if self.device.type == "cuda":
                self.warmup_model()
            self.allocate_kv_cache()
            if not self.enforce_eager:
                self.capture_decode_graphs()
        finally:
            torch.set_default_dtype(default_dtype)
            torch.set_default_device(default_device)

    def _open_shared_memory(self):
        if self.world_size == 1:
            return
        if self.rank == 0:
            self.shm = SharedMemory(name=self.shm_name, create=True, size=SHM_SIZE)
            dist.barrier()
        else:
            dist.barrier()
            self.shm = SharedMemory(name=self.shm_name)

    def attention_layers(self) -> list[Attention]:
        return [module for module in self.model.modules() if isinstance(module, Attention)]

    # --- calls across ranks ---

    def call(self, method_name: str, *args):
        if self.world_size > 1 and self.rank == 0:
            self._write_shm(method_name, *args)
        return getattr(self, method_name)(*args)

    def loop(self):
        while True:
            method_name, args = self._read_shm()
            self.call(method_name, *args)
            if method_name == "exit":
                break

    def _write_shm(self, method_name: str, *args):
        data = pickle.dumps([method_name, *args])
        if len(data) + 4 > SHM_SIZE:
            raise RuntimeError(f"a {method_name!r} call of {len(data)} bytes exceeds the shared memory")
        self.shm.buf[0:4] = len(data).to_bytes(4, "little")
        self.shm.buf[4:len(data) + 4] = data
        for event in self.events:
            event.set()

    def _read_shm(self):
        self.events.wait()
        n = int.from_bytes(self.shm.buf[0:4], "little")
        method_name, *args = pickle.loads(self.shm.buf[4:n + 4])
        self.events.clear()
        return method_name, args

    def abort(self):
        """Rank 0, once a worker has died: release what exit() would, without waiting for the others."""
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None
        dist.destroy_process_group()

    def exit(self):
        if self.shm is not None:
            self.shm.close()
            dist.barrier()
            if self.rank == 0:
                self.shm.unlink()
            self.shm = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dist.destroy_process_group()

    # --- the KV cache ---

    def allocate_kv_cache(self):
        hf_config = self.config.hf_config
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        num_kv_heads = hf_config.num_key_value_heads // self.world_size
        num_layers = hf_config.num_hidden_layers
        block_bytes = 2 * num_layers * self.block_size * num_kv_heads * head_dim * self.config.torch_dtype.itemsize
        self.num_kvcache_blocks = self._num_kvcache_blocks(block_bytes)
        # [k/v, layer, block, slot in block, kv head, head_dim]
        self.kv_cache = torch.empty(2, num_layers, self.num_kvcache_blocks, self.block_size, num_kv_heads, head_dim)
        for layer_id, module in enumerate(self.attention_layers()):
            module.k_cache = self.kv_cache[0, layer_id]
            module.v_cache = self.kv_cache[1, layer_id]

    def _num_kvcache_blocks(self, block_bytes: int) -> int:
        if self.config.num_kvcache_blocks > 0:
            return self.config.num_kvcache_blocks
        if self.device.type == "cuda":
            return self._num_gpu_kvcache_blocks(block_bytes)
        blocks_for_one_sequence = -(-self.config.max_model_len // self.block_size)
        return max(CPU_KVCACHE_BYTES // block_bytes, blocks_for_one_sequence)

    def _num_gpu_kvcache_blocks(self, block_bytes: int) -> int:
        """nano-vllm's rule: gpu_memory_utilization x total memory, less what is in use now, less the
        warm-up's activation peak above the current allocation (each step may need it again).
        With tensor parallelism every rank takes the smallest count."""
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        activation_peak = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        available = int(total * self.config.gpu_memory_utilization) - (total - free) - activation_peak
        num_blocks = torch.tensor(available // block_bytes, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN)
        if num_blocks.item() < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization={self.config.gpu_memory_utilization}"
                f" ({available / 2**30:.2f} GiB after the model and a warm-up at max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}): raise gpu_memory_utilization or lower max_num_batched_tokens")
        return int(num_blocks.item())

    # --- CUDA start-up: a warm-up pass, then decode graphs ---

    def warmup_model(self):
        """One prefill at the full token budget before the cache exists: it compiles the kernels and
        leaves the activation peak in the allocator's statistics for the cache sizing."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        budget, max_model_len = self.config.max_num_batched_tokens, self.config.max_model_len
        seq_len = min(max_model_len, budget)
        num_seqs = min(max(budget // seq_len, 1), self.config.max_num_seqs)
        seqs = [Sequence([0] * seq_len) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        self.run(seqs, True)
        torch.cuda.empty_cache()

    def capture_decode_graphs(self):
        max_num_blocks = -(-(self.config.max_model_len + 1) // self.block_size)
        self.decode_graphs = DecodeGraphs(self.model, min(self.config.max_num_seqs, 512), max_num_blocks,
                                          self.config.hf_config.hidden_size)

    # --- one step ---

    def _tensor(self, values: list, dtype=torch.int64) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        return self._tensor([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs], torch.int32)

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Context]:
        input_ids, positions, slot_mapping, sample_indices = [], [], [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq.scheduled_token_ids)
            positions.extend(range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            if seq.samples_this_step:
                sample_indices.append(cu_seqlens_q[-1] - 1)
            if not seq.block_table:
                continue  # the warm-up pass: no cache yet
            for i in range(start // self.block_size, -(-end // self.block_size)):
                block_start = seq.block_table[i] * self.block_size
                first, last = max(start, i * self.block_size), min(end, (i + 1) * self.block_size)
                slot_mapping.extend(range(block_start + first % self.block_size,
                                          block_start + (last - 1) % self.block_size + 1))
        context = Context(
            is_prefill=True,
            cu_seqlens_q=self._tensor(cu_seqlens_q, torch.int32),
            cu_seqlens_k=self._tensor(cu_seqlens_k, torch.int32),
            max_seqlen_q=max(b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])),
            max_seqlen_k=max(b - a for a, b in zip(cu_seqlens_k, cu_seqlens_k[1:])),
            slot_mapping=self._tensor(slot_mapping, torch.int32),
            block_tables=self._block_tables(seqs),
            has_cached_prefix=cu_seqlens_k[-1] > cu_seqlens_q[-1],
        )
        return self._tensor(input_ids), self._tensor(positions), self._tensor(sample_indices), context

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, Context]:
        input_ids = [seq.last_token for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        slot_mapping = [seq.block_table[-1] * self.block_size + (len(seq) - 1) % self.block_size for seq in seqs]
        context = Context(
            is_prefill=False,
            slot_mapping=self._tensor(slot_mapping, torch.int32),
            context_lens=self._tensor([len(seq) for seq in seqs], torch.int32),
            block_tables=self._block_tables(seqs),
        )
        return self._tensor(input_ids), self._tensor(positions), context

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """The last hidden states: [num_tokens, hidden_size]. A decode batch replays the graph of the
        next bucket up when graphs were captured."""
        graphs = self.decode_graphs
        if context.is_prefill or graphs is None or not graphs.can_replay(input_ids.size(0)):
            with set_context(context):
                return self.model(input_ids, positions)
        return graphs.replay(input_ids, positions, context)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> tuple[list[int], list | None] | None:
        """Compute the scheduled tokens of `seqs`. Rank 0 returns a sampled token for each sequence
        that reached its end this step and, when any asked, their log-probabilities."""
        if is_prefill:
            input_ids, positions, sample_indices, context = self.prepare_prefill(seqs)
        else:
            (input_ids, positions, context), sample_indices = self.prepare_decode(seqs), None
        hidden_states = self.run_model(input_ids, positions, context)
        if sample_indices is not None:
            hidden_states = hidden_states[sample_indices]
        if not hidden_states.size(0):
            return [], None
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden_states)
            if self.rank != 0:
                return None
            return self.sample(logits, [seq for seq in seqs if seq.samples_this_step])

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list | None]:
        batch = make_sampling_batch(seqs, self.config.hf_config.vocab_size, self.config.eos_token_ids, self._tensor)
        token_ids, logprobs = self.sampler(logits, batch)
        if logprobs is None:
            return token_ids.tolist(), None
        return token_ids.tolist(), [t.tolist() for t in (logprobs.top_ids, logprobs.top_logprobs,
                                                         logprobs.sampled_logprobs, logprobs.sampled_ranks)]


def run_worker(config: Config, rank: int, event: Event, init_method: str, shm_name: str, error_pipe: Connection):
    """Entry point of a spawned tensor-parallel rank; a failure's traceback goes up `error_pipe`."""
    try:
        ModelRunner(config, rank, event, init_method, shm_name).loop()
    except BaseException:
        error_pipe.send(traceback.format_exc())
        raise
    finally:
        error_pipe.close()
