"""Prompt attention on one GPU: the Triton `prefill_attention` against flash-attn's varlen kernel, at Qwen3-0.6B's
heads (16 query heads, 8 KV heads of 128), on the same inputs; µs a call, the mean of 20 after one warm-up call.

    python -m benchmarks.prompt_attention

Cases: 16 new prompts of 1,024 tokens; 16 new prompts of 100-970 tokens (bench.py's range); 8 chunks of 512
tokens continuing 3,072 cached keys each, through the block table (blocks of 256).
"""
import torch

from nanovllm.kernels.flash_attn import varlen_attention
from nanovllm.kernels.prefill_attention import prefill_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, CALLS = 16, 8, 128, 256, 20
CASES = {"16 x 1,024 new": ([1024] * 16, [0] * 16), "16 x 100-970 new": ([100 + 58 * i for i in range(16)], [0] * 16),
         "8 x 512 over 3,072 cached": ([512] * 8, [3072] * 8)}


def mean_us(fn, *args) -> float:
    fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn(*args)
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


def main():
    torch.manual_seed(0)
    for name, (q_lens, prefixes) in CASES.items():
        args = case_inputs(q_lens, prefixes)
        flash, triton_ = mean_us(varlen_attention, *args), mean_us(prefill_attention, *args)
        print(f"{name}: flash-attn {flash:.1f} us, triton {triton_:.1f} us, ratio {triton_ / flash:.2f}")


if __name__ == "__main__":
    main()
