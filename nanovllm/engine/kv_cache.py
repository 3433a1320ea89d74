import math

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.models.decoder import attention_head_dim
from nanovllm.utils.fp8_kv import FP8_KV, value_cache

CPU_KVCACHE_BYTES = 1 << 30
STEPS_IN_FLIGHT = 2  # the engine schedules a step while the one before runs (llm_engine)


def kv_cache_shape(config: Config, num_blocks: int) -> tuple[int, ...]:
    """[k/v, layer, block, slot in block, kv head, head_dim] of this rank's cache."""
    hf_config = config.hf_config
    num_kv_heads = hf_config.num_key_value_heads // config.tensor_parallel_size
    return (2, hf_config.num_hidden_layers, num_blocks, config.kvcache_block_size, num_kv_heads,
            attention_head_dim(hf_config))


def cache_dtype(config: Config) -> torch.dtype:
    return FP8_KV if config.kv_cache_dtype.startswith("fp8") else config.torch_dtype


def block_bytes(config: Config) -> int:
    """Bytes of one block of this rank's K/V over every layer (with an FP8 cache's scales)."""
    shape = kv_cache_shape(config, 1)
    scales = math.prod(shape[:-1]) * 4 if cache_dtype(config) == FP8_KV else 0
    return math.prod(shape) * cache_dtype(config).itemsize + scales


def num_kvcache_blocks(config: Config, device: torch.device, free_at_start: int, activation_peak: int) -> int:
    """The configured count; on a CPU, CPU_KVCACHE_BYTES' worth (at least one max_model_len sequence);
    on CUDA, what available_gpu_bytes leaves after the activation peak of a step (every rank takes the
    smallest count). A pooling engine takes no more than pooling_blocks."""
    if config.num_kvcache_blocks > 0:
        return config.num_kvcache_blocks
    most = pooling_blocks(config) if config.runner == "pooling" else None
    if device.type != "cuda":
        blocks_for_one_sequence = -(-config.max_model_len // config.kvcache_block_size)
        return min(max(CPU_KVCACHE_BYTES // block_bytes(config), blocks_for_one_sequence), most or math.inf)
    available = available_gpu_bytes(config, device, free_at_start) - activation_peak
    num_blocks = torch.tensor(available // block_bytes(config), device=device)
    if config.tensor_parallel_size > 1:
        dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN)
    if num_blocks.item() < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization={config.gpu_memory_utilization}"
            f" ({available / 2**30:.2f} GiB after the model and a warm-up at max_num_batched_tokens="
            f"{config.max_num_batched_tokens}): raise gpu_memory_utilization or lower max_num_batched_tokens")
    return min(int(num_blocks.item()), most or math.inf)


def pooling_blocks(config: Config) -> int:
    """What a pooling engine's steps, which only prefill, can fill: one max_model_len prompt whose last chunk
    reads all of it, and the packed prompts of the steps in flight (the next is scheduled while one runs), each
    of max_num_batched_tokens in as many blocks, and a part-filled block for each of its up to max_num_seqs
    prompts."""
    size, tokens = config.kvcache_block_size, config.max_num_batched_tokens
    step = -(-tokens // size) + min(config.max_num_seqs, tokens)
    return -(-config.max_model_len // size) + STEPS_IN_FLIGHT * step


def free_gpu_bytes(device: torch.device) -> int:
    """The GPU's free memory, counting what this process's allocator holds unused (it is ours to take)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def available_gpu_bytes(config: Config, device: torch.device, free_at_start: int) -> int:
    """gpu_memory_utilization x the memory free when the engine started, less what it has taken since
    (weights, buffers): an engine alone on a GPU takes that share of it, and one started beside others
    (another engine of the notebook, another process) sizes its cache from what is left."""
    taken_since_start = free_at_start - free_gpu_bytes(device)
    return int(config.gpu_memory_utilization * free_at_start) - taken_since_start


def allocate_kv_cache(config: Config, num_blocks: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cache, and an FP8 cache's scales ([k/v, layer, block, kv head, slot in block], float32), both zeroed
    (`utils/fp8_kv.py`)."""
    shape = kv_cache_shape(config, num_blocks)
    if cache_dtype(config) != FP8_KV:
        return torch.empty(shape, dtype=cache_dtype(config), device=device), None
    *blocks, block_size, num_kv_heads, _ = shape
    return (torch.zeros(shape, dtype=FP8_KV, device=device),
            torch.zeros(*blocks, num_kv_heads, block_size, dtype=torch.float32, device=device))


def layer_caches(kv_cache: torch.Tensor, scales: torch.Tensor | None, layer: int):
    """One layer's keys and values, and an FP8 cache's scales (values and scales as `utils/fp8_kv.py` lays them out)."""
    if scales is None:
        return kv_cache[0, layer], kv_cache[1, layer], None
    return kv_cache[0, layer], value_cache(kv_cache[1, layer]), (scales[0, layer], scales[1, layer])
