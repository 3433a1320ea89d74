"""Prompt attention on one GPU: the Triton `prefill_attention` against flash-attn's varlen kernel, at Qwen3-0.6B's
heads (16 query heads, 8 KV heads of 128), bf16, on the same inputs; µs a call, the mean of 20 after one warm-up.

    python -m benchmarks.prompt_attention [--sweep] [--fp8-kv]

Cases: bench.py's prompts (16 new prompts of 100-970 tokens, 16 of 1,024); long prompts (one of 8,192, 16,384
and 32,768 tokens, four of 8,192); chunks continuing cached keys through the block table (blocks of 256): 8 of
512 over 3,072 keys, and 8,192-token chunks over 8,192 and 24,576 (a 32k prompt's second and last chunks).
--sweep also times the Triton kernel at each of SWEEP's tile configurations. --fp8-kv also times the chunks over
cached keys with the cache in FP8 (`kv_cache_dtype="fp8"`: the same keys and values quantized as the engine
stores them), at the engine's tiles and, with --sweep, at each of SWEEP's.
"""
import argparse

import torch

from nanovllm.kernels.flash_attn import varlen_attention
from nanovllm.kernels.prefill_attention import prefill_attention, tile_config
from nanovllm.utils.fp8_kv import quantize_cache

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, CALLS = 16, 8, 128, 256, 20
CASES = {"16 x 100-970 new": ([100 + 58 * i for i in range(16)], [0] * 16), "16 x 1,024 new": ([1024] * 16, [0] * 16),
         "1 x 8,192 new": ([8192], [0]), "1 x 16,384 new": ([16384], [0]), "1 x 32,768 new": ([32768], [0]),
         "4 x 8,192 new": ([8192] * 4, [0] * 4), "8 x 512 over 3,072 cached": ([512] * 8, [3072] * 8),
         "8,192 over 8,192 cached": ([8192], [8192]), "8,192 over 24,576 cached": ([8192], [24576])}
# (block_m, block_n, num_warps, num_stages)
SWEEP = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
         (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3)]


def mean_us(fn, *args, **kwargs) -> float:
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn(*args, **kwargs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS * 1000


def case_inputs(q_lens: list[int], prefixes: list[int]) -> tuple:
    k_lens = [q + p for q, p in zip(q_lens, prefixes)]
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    blocks = [-(-n // BLOCK_SIZE) for n in k_lens]
    k_cache, v_cache = (torch.randn(sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    table = torch.zeros(len(k_lens), max(blocks), dtype=torch.int32, device="cuda")
    for i, first in enumerate([0, *torch.tensor(blocks).cumsum(0).tolist()][:-1]):
        table[i, :blocks[i]] = torch.arange(first, first + blocks[i])
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for lens in (q_lens, k_lens))
    if any(prefixes):
        return q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), HEAD_DIM ** -0.5, table
    k, v = (cache.view(-1, KV_HEADS, HEAD_DIM)[:sum(k_lens)].contiguous() for cache in (k_cache, v_cache))
    return q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), HEAD_DIM ** -0.5


def tflops(q_lens: list[int], prefixes: list[int], us: float) -> float:
    """Causal attention's matmul FLOPs (the visible half of each chunk's square, all of its prefix) a second."""
    flops = sum(4 * HEADS * HEAD_DIM * q * (p + (q + 1) / 2) for q, p in zip(q_lens, prefixes))
    return flops / us / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernel at each SWEEP config")
    parser.add_argument("--fp8-kv", action="store_true", help="also time the cached-key chunks over an FP8 cache")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, (q_lens, prefixes) in CASES.items():
        inputs = case_inputs(q_lens, prefixes)
        print(f"{name}: Triton's tiles (block_m, block_n, warps, stages) "
              f"{tile_config(HEAD_DIM, torch.bfloat16, any(prefixes), max(q_lens))}")
        flash, triton_ = mean_us(varlen_attention, *inputs), mean_us(prefill_attention, *inputs)
        print(f"{name}: flash-attn {flash:.1f} us ({tflops(q_lens, prefixes, flash):.0f} TFLOPS), triton "
              f"{triton_:.1f} us ({tflops(q_lens, prefixes, triton_):.0f} TFLOPS), flash-attn/triton "
              f"{flash / triton_:.2f}", flush=True)
        for block_m, block_n, warps, stages in SWEEP if args.sweep else []:
            us = mean_us(prefill_attention, *inputs, block_m=block_m, block_n=block_n, num_warps=warps,
                         num_stages=stages)
            print(f"  {block_m}x{block_n} w{warps} s{stages}: {us:.1f} us, flash-attn/this {flash / us:.2f}",
                  flush=True)
        if args.fp8_kv and any(prefixes):
            fp8_cache_rows(name, inputs, triton_, args.sweep)


def fp8_cache_rows(name: str, inputs: tuple, bf16_us: float, sweep: bool):
    """The Triton kernel over the same chunk's keys in an FP8 cache, against the bf16 cache's time."""
    q, k_cache, v_cache, *rest = inputs
    k, v, scales = quantize_cache(k_cache, v_cache)
    us = mean_us(prefill_attention, q, k, v, *rest, kv_scales=scales)
    tiles = tile_config(HEAD_DIM, torch.bfloat16, paged=True, max_seqlen_q=0, fp8_kv=True)
    print(f"{name}, FP8 cache: triton {us:.1f} us (tiles {tiles}), bf16 cache/FP8 cache {bf16_us / us:.2f}", flush=True)
    for block_m, block_n, warps, stages in SWEEP if sweep else []:
        us = mean_us(prefill_attention, q, k, v, *rest, kv_scales=scales, block_m=block_m, block_n=block_n,
                     num_warps=warps, num_stages=stages)
        print(f"  FP8 cache {block_m}x{block_n} w{warps} s{stages}: {us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
