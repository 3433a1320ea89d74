"""Device time of the kernels one decode step is made of, at Qwen3-0.6B's shapes: what is left to win.

    python -m benchmarks.decode_kernels [--out FILE]

1. Paged decode attention per batch size and context length: flash-attn's `flash_attn_with_kvcache`
   against the Triton `decode_attention`, each given the block table's full width (max_model_len keys),
   as in a decode graph. (Flash's time does not change with its number of KV splits: 13 us at one
   sequence of 640 keys, measured 2026-11-30.)
2. The layer's matmuls at a few decode batch sizes: cuBLAS (`F.linear`) against the one-row Triton
   kernel (`nanovllm.layers.one_row_linear`, at each block size tried), in µs and in GB/s of weights
   read (a decode matmul is a weight read: 4.8 TB/s is the H200's peak).

3. The same matmuls at one row with cold weights (`cold_matmuls`): each call reads another copy of
   the weight, 256 MB of copies in all, so no call finds its weight in the 50 MB L2 cache, as in a
   decode step, whose 28 layers read 0.9 GB of weights. Every block size and warp count tried.
   `cold_moe_matmuls`: the same at Qwen3-30B-A3B's attention matmuls (qkv 5120 x 2048, o 2048 x 4096).

4. Decode attention over bench.py's workload (`bench_attention`): the batches and context lengths its
   decode steps meet, flash-attn against the Triton kernel's slice lengths.

5. The plain sampler (`sampler`) at each chunk length and warp count.

Each figure is the mean over 50 calls (a cold pass over the copies) captured in one CUDA graph, as the
decode graph runs them.
"""
import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F
import triton

from benchmarks.gpu_timing import mean_replay_ms
from nanovllm.layers.one_row_linear import BLOCK_N, blocks_for, one_row_linear_kernel

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 1024, 16, 8, 128, 3072, 151936
MATMULS = dict(qkv=((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), o=(HIDDEN, HEADS * HEAD_DIM),
               gate_up=(2 * INTERMEDIATE, HIDDEN), down=(HIDDEN, INTERMEDIATE), lm_head=(VOCAB, HIDDEN))
# Qwen3-30B-A3B's attention (hidden 2048, 32 heads, 4 KV heads of 128), whose one-row matmuls its MoE decode runs
MOE_MATMULS = dict(qkv_30b=((32 + 2 * 4) * 128, 2048), o_30b=(2048, 32 * 128))
CALLS = 50


def graph_time_us(fn, *args, **kwargs) -> float:
    """Mean device time of fn(*args, **kwargs) over CALLS calls replayed from one CUDA graph."""
    return calls_time_us([partial(fn, *args, **kwargs)] * CALLS)


def calls_time_us(calls: list) -> float:
    """Mean device time of a call of `calls` (each made once outside the graph first), all of them in
    turn replayed from one CUDA graph."""
    for call in dict.fromkeys(calls):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return mean_replay_ms(graph, warmup=1, replays=5) * 1000 / len(calls)


def attention_times(block_size: int = 256, max_model_len: int = 4096) -> list[dict]:
    from flash_attn import flash_attn_with_kvcache

    from nanovllm.layers.decode_attention import decode_attention
    width = -(-(max_model_len + 1) // block_size)
    scale = HEAD_DIM**-0.5
    rows = []
    for bs in (1, 2, 4, 8, 16, 32, 64):
        num_blocks = bs * width
        k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        block_table = torch.randperm(num_blocks, device="cuda").int().view(bs, width)
        q = torch.randn(bs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        for context in (384, 1024, 4000):
            lens = torch.full((bs,), context, dtype=torch.int32, device="cuda")
            flash = partial(flash_attn_with_kvcache, q.unsqueeze(1), k_cache, v_cache, cache_seqlens=lens,
                            block_table=block_table, softmax_scale=scale, causal=True)
            triton_attention = partial(decode_attention, q, k_cache, v_cache, lens, block_table, scale)
            expected = flash().squeeze(1).float()
            error = (triton_attention().float() - expected).norm() / expected.norm()
            row = dict(batch=bs, context=context, flash_us=round(graph_time_us(flash), 2),
                       triton_us=round(graph_time_us(triton_attention), 2), relative_difference=round(error.item(), 5))
            rows.append(row)
            print(row, flush=True)
    return rows


# (split keys, tile keys, warps, pipeline stages) tried over bench's batches besides the engine's own. Of
# 5 x 2 x 3 launches swept on 2026-11-30 (8 warps and 1 stage too), these were within 4% of the best.
TRIED_LAUNCHES = [(512, 64, 4, 2), (512, 128, 4, 2), (1024, 128, 4, 2), (1024, 128, 4, 3)]


def bench_attention_times(block_size: int = 256, max_model_len: int = 4096, every: int = 192) -> dict:
    """Decode attention at the batches bench.py's workload decodes: at every `every`-th decode step, the
    sequences still running, each attending to its prompt and the tokens so far. Flash-attn (its own
    split heuristic; also with each sequence's blocks in address order) against the Triton kernel at
    the engine's split and tile lengths and others; the
    sum over the sampled steps times `every` times 28 layers estimates the workload's attention time."""
    from flash_attn import flash_attn_with_kvcache

    from benchmarks.workloads import make_workload
    from nanovllm.layers.decode_attention import decode_attention
    workload = make_workload("bench")
    prompt_lens = torch.tensor([len(p) for p in workload.prompts])
    max_tokens = torch.tensor(workload.max_tokens)
    width = -(-(max_model_len + 1) // block_size)
    scale = HEAD_DIM**-0.5
    num_blocks = len(prompt_lens) * width
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    variants = {"flash_splits0": 0, "flash_splits0_sorted_blocks": 0, "triton_engine": {}}
    variants |= {f"triton_{keys}keys_tile{tile}_w{warps}_s{stages}": dict(split_keys=keys, tile_keys=tile,
                                                                          num_warps=warps, num_stages=stages)
                 for keys, tile, warps, stages in TRIED_LAUNCHES}
    steps, totals = [], dict.fromkeys(variants, 0.0)  # triton_engine: the engine's launch
    for step in range(1, int(max_tokens.max()), every):
        lens = (prompt_lens + step)[max_tokens > step].int().cuda()
        bs = len(lens)
        block_table = torch.randperm(num_blocks, device="cuda")[:bs * width].int().view(bs, width)
        q = torch.randn(bs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        row = dict(step=step, batch=bs, mean_keys=round(lens.float().mean().item()))
        kv_bytes = lens.sum().item() * KV_HEADS * HEAD_DIM * 2 * 2
        expected = None
        for name, arg in variants.items():
            # sorted: each sequence's blocks in address order, as a fresh cache hands them out
            table = block_table.sort(dim=1).values if name.endswith("sorted_blocks") else block_table
            if name.startswith("flash"):
                call = partial(flash_attn_with_kvcache, q.unsqueeze(1), k_cache, v_cache, cache_seqlens=lens,
                               block_table=table, softmax_scale=scale, causal=True, num_splits=arg)
            else:
                call = partial(decode_attention, q, k_cache, v_cache, lens, block_table, scale, **arg)
            try:
                out = call().view(bs, HEADS, HEAD_DIM).float()
            except triton.runtime.errors.OutOfResources:  # the pipeline stages' tiles overflow shared memory
                row[name], totals[name] = None, float("inf")
                continue
            if expected is None:
                expected = out
            error = ((out - expected).norm() / expected.norm()).item()
            assert error < 1e-2 or table is not block_table, (name, row, error)  # other blocks, other keys
            us = graph_time_us(call)
            row[name] = round(us, 1)
            totals[name] += us * every * 28 / 1e6
        row["flash_tb_s"] = round(kv_bytes / row["flash_splits0"] / 1e6, 2)
        best = min((name for name in variants if row[name] is not None), key=row.get)
        row["best"], row["best_tb_s"] = best, round(kv_bytes / row[best] / 1e6, 2)
        steps.append(row)
        print(row, flush=True)
    estimate = {name: round(seconds, 3) for name, seconds in sorted(totals.items(), key=lambda kv: kv[1])}
    print("estimated attention seconds over bench:", estimate, flush=True)
    return dict(steps=steps, estimated_seconds=estimate)


def sampler_times() -> list[dict]:
    """The plain sampler's two kernels at a few batch sizes, over Qwen3's vocabulary, at each chunk
    length and warp count tried (`nanovllm.layers.plain_sampler`)."""
    from nanovllm.layers.plain_sampler import CHUNK, sample_plain
    rows = []
    for num_rows in (1, 32, 140, 256):
        logits = torch.randn(num_rows, VOCAB, dtype=torch.bfloat16, device="cuda") * 3
        temperatures = torch.ones(num_rows, device="cuda")
        counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        row = dict(rows=num_rows)
        for chunk in (1024, 2048, 4096, 8192, 16384):
            for num_warps in (4, 8, 16):
                if chunk >= 4 * 32 * num_warps:
                    row[f"chunk{chunk}_w{num_warps}"] = round(graph_time_us(
                        sample_plain, logits, temperatures, counter, chunk=chunk, num_warps=num_warps), 1)
        row["engine"] = row[f"chunk{CHUNK}_w4"]
        row["best"] = min((key for key in row if key.startswith("chunk")), key=row.get)
        rows.append(row)
        print(row, flush=True)
    return rows


def one_row_matmul(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int,
                   num_warps: int = 4):
    n, k = w.shape
    one_row_linear_kernel[(triton.cdiv(n, block_n),)](x, w, w, y, n, k, HAS_BIAS=False, SILU_AND_MUL=False,
                                                      BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=False,
                                                      num_warps=num_warps)


COLD_BYTES = 256 * 2**20


def cold_time_us(fn, weights: list[torch.Tensor]) -> float:
    """Mean device time of fn(w), each call on the next of `weights`, over two passes in one CUDA graph."""
    return calls_time_us([partial(fn, w) for w in weights] * 2)


def cold_matmul_times(matmuls: dict = MATMULS) -> list[dict]:
    rows = []
    for name, (n, k) in matmuls.items():
        if name == "lm_head":
            continue
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
                   for _ in range(-(-COLD_BYTES // (n * k * 2)))]
        weight_gb = n * k * 2 / 1e9
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        y = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        row = dict(matmul=name, n=n, k=k, copies=len(weights))
        row["cublas_us"] = round(cold_time_us(partial(F.linear, x), weights), 2)
        expected = F.linear(x, weights[0])[0].float()
        timings = {}
        for block_n in (1, 2, 4, 8):
            for block_k in (256, 512, 1024, 2048, 4096):
                for num_warps in (2, 4, 8):
                    if block_k > triton.next_power_of_2(k) or block_n * block_k > 16384:
                        continue
                    one_row_matmul(x, weights[0], y, block_n, block_k, num_warps)
                    torch.testing.assert_close(y.float(), expected, atol=2e-2, rtol=2e-2)
                    kernel = partial(one_row_matmul, x, y=y, block_n=block_n, block_k=block_k, num_warps=num_warps)
                    timings[(block_n, block_k, num_warps)] = cold_time_us(kernel, weights)
        best = min(timings, key=timings.get)
        engine = (BLOCK_N, *blocks_for(k))
        row.update(engine_us=round(timings[engine], 2), best_us=round(timings[best], 2), best=best,
                   best_gb_s=round(weight_gb / timings[best] * 1e6),
                   all={f"{bn}x{bk}w{nw}": round(t, 2) for (bn, bk, nw), t in sorted(timings.items())})
        rows.append(row)
        print({key: value for key, value in row.items() if key != "all"}, flush=True)
    return rows


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
    parser.add_argument("--parts", default="attention,matmuls,cold_matmuls")
    args = parser.parse_args()
    parts = dict(attention=attention_times, matmuls=matmul_times, cold_matmuls=cold_matmul_times,
                 cold_moe_matmuls=partial(cold_matmul_times, MOE_MATMULS),
                 bench_attention=bench_attention_times, sampler=sampler_times)
    report = dict(gpu=torch.cuda.get_device_name())
    for name in args.parts.split(","):
        report[name] = parts[name]()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
