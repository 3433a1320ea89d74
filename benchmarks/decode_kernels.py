"""Device time of the kernels one decode step is made of, at Qwen3-0.6B's shapes: what is left to win.

    python -m benchmarks.decode_kernels [--out FILE]

1. Paged decode attention (`flash_attn_with_kvcache`) per batch size and context length, with flash's
   own choice of KV splits (0) against fixed ones. In a decode graph flash sees the block table's
   full width (max_model_len keys), not the keys a row has.
2. The layer's matmuls at a few decode batch sizes: cuBLAS (`F.linear`) against the one-row Triton
   kernel (`nanovllm.layers.one_row_linear`, at each block size tried), in µs and in GB/s of weights
   read (a decode matmul is a weight read: 4.8 TB/s is the H200's peak).

Each figure is the mean over 50 calls captured in one CUDA graph, as the decode graph runs them.
"""
import argparse
import json

import torch
import torch.nn.functional as F
import triton

from benchmarks.gpu_timing import mean_replay_ms
from nanovllm.layers.one_row_linear import one_row_linear_kernel

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 1024, 16, 8, 128, 3072, 151936
MATMULS = dict(qkv=((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), o=(HIDDEN, HEADS * HEAD_DIM),
               gate_up=(2 * INTERMEDIATE, HIDDEN), down=(HIDDEN, INTERMEDIATE), lm_head=(VOCAB, HIDDEN))
CALLS = 50


def graph_time_us(fn, *args, **kwargs) -> float:
    """Mean device time of fn(*args, **kwargs) over CALLS calls replayed from one CUDA graph."""
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(*args, **kwargs)
    return mean_replay_ms(graph, warmup=1, replays=5) * 1000 / CALLS


def attention_times(block_size: int = 256, max_model_len: int = 4096) -> list[dict]:
    from flash_attn import flash_attn_with_kvcache
    width = -(-(max_model_len + 1) // block_size)
    rows = []
    for bs in (1, 8, 64, 256):
        num_blocks = bs * width
        k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        block_table = torch.arange(num_blocks, dtype=torch.int32, device="cuda").view(bs, width)
        q = torch.randn(bs, 1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        for context in (640, 4000):
            lens = torch.full((bs,), context, dtype=torch.int32, device="cuda")
            row = dict(batch=bs, context=context)
            for splits in (0, 1, 2, 4, 8):
                row[f"splits={splits} us"] = round(graph_time_us(
                    flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=lens, block_table=block_table,
                    causal=True, num_splits=splits), 2)
            rows.append(row)
            print(row, flush=True)
    return rows


def one_row_matmul(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int):
    n, k = w.shape
    one_row_linear_kernel[(triton.cdiv(n, block_n),)](x, w, w, y, n, k, HAS_BIAS=False, BLOCK_N=block_n,
                                                      BLOCK_K=block_k)


def matmul_times() -> list[dict]:
    rows = []
    for name, (n, k) in MATMULS.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        weight_gb = w.numel() * 2 / 1e9
        for m in (1, 8, 64, 256):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            us = graph_time_us(F.linear, x, w)
            row = dict(matmul=name, n=n, k=k, m=m, cublas_us=round(us, 2), cublas_gb_s=round(weight_gb / us * 1e6))
            if m == 1:
                y = torch.empty(n, dtype=torch.bfloat16, device="cuda")
                expected = F.linear(x, w)[0].float()
                best = None
                for block_n in (4, 8, 16, 32):
                    for block_k in (128, 256, 512):
                        one_row_matmul(x, w, y, block_n, block_k)
                        torch.testing.assert_close(y.float(), expected, atol=2e-2, rtol=2e-2)
                        t = graph_time_us(one_row_matmul, x, w, y, block_n, block_k)
                        if best is None or t < best[0]:
                            best = (t, block_n, block_k)
                row.update(triton_us=round(best[0], 2), triton_gb_s=round(weight_gb / best[0] * 1e6),
                           triton_blocks=best[1:])
            rows.append(row)
            print(row, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="a JSON file for the figures")
    args = parser.parse_args()
    report = dict(gpu=torch.cuda.get_device_name(), attention=attention_times(), matmuls=matmul_times())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
