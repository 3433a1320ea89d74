"""Device time of the kernels a decode step is made of, at Qwen3-0.6B's shapes, on one GPU: each figure the mean
of the calls captured in one CUDA graph, as the decode graph runs them.

    python -m benchmarks.decode_kernels [--parts attention,bench_attention,fp8_attention,kv_store,cold_matmuls]
        [--out FILE]
        [--attention-dims qwen3-30b-a3b]

Parts (default: attention, cold_matmuls):
- `attention`: the Triton `decode_attention` at the engine's launch, per batch size and keys a sequence, given the
  block table's full width (max_model_len keys) as in a decode graph; µs and TB/s of K/V read.
- `bench_attention`: decode attention at the batches bench.py's decode steps meet (every 192nd step), the engine's
  launch against TRIED_LAUNCHES, and each one's attention time over the whole run, estimated from them.
- `fp8_attention`: the same batches over an e4m3 cache against the bf16 one, the engine's launch and FP8_LAUNCHES,
  with each one's estimate over the run.
- `kv_store`: `prepare_qkv` at a decode step of STORE_SEQS sequences, storing into each layer's cache in turn
  (cold, as a step's layers write them), bf16 and e4m3; µs a layer.
- `cold_matmuls`: each of a layer's matmuls at one row, as a decode step of one sequence runs them, in cuBLAS and
  in the one-row kernel (`nanovllm.kernels.one_row_linear`) at every block size and warp count, the figure its
  blocks were chosen by; µs and GB/s of weights read (the H200 peaks at 4.8 TB/s). Each call reads another copy
  of the weight (256 MB of copies), so none finds it in the 50 MB L2 cache, as in a decode step, whose 28 layers
  read 0.9 GB. `cold_moe_matmuls`: the same at Qwen3-30B-A3B's attention matmuls.
"""
import argparse
import json
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
import triton

from benchmarks.gpu_timing import COLD_BYTES, graph_us
from benchmarks.workloads import make_workload
from nanovllm.engine.step_io import longest_first
from nanovllm.kernels.decode_attention import decode_attention
from nanovllm.kernels.one_row_linear import BLOCK_N, blocks_for, one_row_linear_kernel, scale_args

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 1024, 16, 8, 128, 3072, 28
# A layer's matmuls as (output features, input features)
MATMULS = dict(qkv=((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), o=(HIDDEN, HEADS * HEAD_DIM),
               gate_up=(2 * INTERMEDIATE, HIDDEN), down=(HIDDEN, INTERMEDIATE))
# Qwen3-30B-A3B's attention (hidden 2048, 32 heads, 4 KV heads of 128), whose one-row matmuls its MoE decode runs
MOE_MATMULS = dict(qkv_30b=((32 + 2 * 4) * 128, 2048), o_30b=(2048, 32 * 128))
# Query heads, KV heads and layers the attention parts take (`--attention-dims`)
ATTENTION_DIMS = {"qwen3-0.6b": (HEADS, KV_HEADS, LAYERS), "qwen3-30b-a3b": (32, 4, 48)}
CALLS = 50
BLOCK_SIZE, MAX_MODEL_LEN = 256, 4096  # the engine's defaults
# (split keys, tile keys, warps, pipeline stages) tried over bench's batches beside the engine's own: of 30
# launches swept (8 warps and 1 stage too), the ones within 4% of the best; and 2,048-key splits, the fastest at
# Qwen3-30B-A3B's heads at 220 sequences and more.
TRIED_LAUNCHES = [(512, 64, 4, 2), (512, 128, 4, 2), (1024, 128, 4, 2), (1024, 128, 4, 3), (2048, 128, 4, 2)]


def time_us(fn, *args, **kwargs) -> float:
    """Mean device time of fn(*args, **kwargs) over CALLS calls replayed from one CUDA graph."""
    return graph_us([partial(fn, *args, **kwargs)] * CALLS)


def bf16(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16, device="cuda")


def table_width() -> int:
    """Blocks in a row of the block table: a sequence of max_model_len + 1 tokens, as the decode graphs hold."""
    return -(-(MAX_MODEL_LEN + 1) // BLOCK_SIZE)


def kv_tb_s(context_lens: torch.Tensor, us: float) -> float:
    kv_bytes = context_lens.sum().item() * KV_HEADS * HEAD_DIM * 2 * 2  # K and V in bf16
    return round(kv_bytes / us / 1e6, 2)


def attention_times() -> list[dict]:
    width, rows = table_width(), []
    for bs in (1, 2, 4, 8, 16, 32, 64):
        k_cache = bf16(bs * width, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        v_cache = torch.randn_like(k_cache)
        block_table = torch.randperm(bs * width, device="cuda").int().view(bs, width)
        q = bf16(bs, HEADS, HEAD_DIM)
        for context in (384, 1024, 4000):
            lens = torch.full((bs,), context, dtype=torch.int32, device="cuda")
            us = time_us(decode_attention, q, k_cache, v_cache, lens, block_table, HEAD_DIM**-0.5)
            rows.append(dict(batch=bs, context=context, us=round(us, 2), kv_tb_s=kv_tb_s(lens, us)))
            print(rows[-1], flush=True)
    return rows


def bench_decode_batches(every: int) -> tuple[int, Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The blocks a cache for bench.py's workload needs, and at every `every`-th decode step the sequences still
    running: (step, keys a sequence, a block table of random blocks, the rows longest first as the engine orders
    decode attention's programs)."""
    workload = make_workload("bench")
    prompt_lens, max_tokens = torch.tensor([len(p) for p in workload.prompts]), torch.tensor(workload.max_tokens)
    width = table_width()
    num_blocks = len(prompt_lens) * width

    def batches():
        for step in range(1, int(max_tokens.max()), every):
            lens = (prompt_lens + step)[max_tokens > step].int().cuda()
            bs = len(lens)
            table = torch.randperm(num_blocks, device="cuda")[:bs * width].int().view(bs, width)
            yield step, lens, table, torch.from_numpy(longest_first(lens.cpu().numpy())).cuda()
    return num_blocks, batches()


def bench_attention_times(every: int = 192) -> dict:
    """At every `every`-th decode step of bench.py's workload, the sequences still running, each attending to its
    prompt and the tokens so far: each launch's µs; their sum over the sampled steps, times `every` and the 28
    layers, estimates the launch's attention seconds over the run."""
    num_blocks, batches = bench_decode_batches(every)
    k_cache = bf16(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn_like(k_cache)
    launches = {"engine": {}} | {f"{keys}keys_tile{tile}_w{warps}_s{stages}": dict(
        split_keys=keys, tile_keys=tile, num_warps=warps, num_stages=stages)
        for keys, tile, warps, stages in TRIED_LAUNCHES}
    steps, totals = [], dict.fromkeys(launches, 0.0)
    for step, lens, block_table, order in batches:
        bs = len(lens)
        attention = partial(decode_attention, bf16(bs, HEADS, HEAD_DIM), k_cache, v_cache, lens, block_table,
                            HEAD_DIM**-0.5, seq_order=order)
        expected = attention().float()
        row = dict(step=step, batch=bs, mean_keys=round(lens.float().mean().item()))
        for name, launch in launches.items():
            try:
                out = attention(**launch).float()
            except triton.runtime.errors.OutOfResources:  # the pipeline stages' tiles overflow shared memory
                row[name], totals[name] = None, float("inf")
                continue
            assert (out - expected).norm() / expected.norm() < 1e-2, (name, row)
            us = time_us(attention, **launch)
            row[name] = round(us, 1)
            totals[name] += us * every * LAYERS / 1e6
        best = min((name for name in launches if row[name] is not None), key=row.get)
        row["best"], row["best_tb_s"] = best, kv_tb_s(lens, row[best])
        steps.append(row)
        print(row, flush=True)
    estimate = {name: round(seconds, 3) for name, seconds in sorted(totals.items(), key=lambda kv: kv[1])}
    print("estimated attention seconds over bench:", estimate, flush=True)
    return dict(steps=steps, estimated_seconds=estimate)


# (split keys, tile keys, warps, stages) over an e4m3 cache, against the engine's launch (1,024-key splits of
# 128-key tiles, 4 warps, 3 stages: two tiles in flight): one tile in flight, three, longer and shorter splits,
# smaller tiles, 8 warps (docs/benchmarks.md)
FP8_LAUNCHES = [(1024, 128, 4, 2), (1024, 128, 4, 4), (2048, 128, 4, 3), (512, 128, 4, 3), (1024, 64, 4, 4),
                (1024, 128, 8, 3)]


def fp8_attention_times(every: int = 192) -> dict:
    """Decode attention over an e4m3 cache (`kv_cache_dtype="fp8"`) against the bf16 cache at bench.py's batches
    (as `bench_attention`), the engine's launch and FP8_LAUNCHES; µs, each cache's TB/s of K/V read, and each
    launch's attention seconds over the run estimated as `bench_attention` does."""
    from nanovllm.utils.fp8_kv import quantize_cache
    num_blocks, batches = bench_decode_batches(every)
    k_cache, v_cache = (bf16(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(2))
    k_fp8, v_fp8, (k_scales, v_scales) = quantize_cache(k_cache, v_cache)
    rows, totals = [], {}
    for step, lens, block_table, order in batches:
        bs = len(lens)
        q = bf16(bs, HEADS, HEAD_DIM)
        bf16_us = time_us(decode_attention, q, k_cache, v_cache, lens, block_table, HEAD_DIM**-0.5, seq_order=order)
        fp8 = partial(decode_attention, q, k_fp8, v_fp8, lens, block_table, HEAD_DIM**-0.5,
                      kv_scales=(k_scales, v_scales), seq_order=order)
        expected = decode_attention(q, k_cache, v_cache, lens, block_table, HEAD_DIM**-0.5).float()
        row = dict(step=step, batch=bs, bf16_us=round(bf16_us, 1), bf16_tb_s=kv_tb_s(lens, bf16_us))
        for launch in [None, *FP8_LAUNCHES]:
            keys = dict(zip(("split_keys", "tile_keys", "num_warps", "num_stages"), launch or ()))
            try:
                error = ((fp8(**keys).float() - expected).norm() / expected.norm()).item()
                us = time_us(fp8, **keys)
            except triton.runtime.errors.OutOfResources:
                continue
            name = "engine" if launch is None else "x".join(map(str, launch))
            row[name] = (round(us, 1), round(error, 4))
            totals[name] = totals.get(name, 0.0) + us * every * LAYERS / 1e6
        totals["bf16"] = totals.get("bf16", 0.0) + bf16_us * every * LAYERS / 1e6
        rows.append(row)
        print(row, flush=True)
    estimate = {name: round(seconds, 3) for name, seconds in sorted(totals.items(), key=lambda kv: kv[1])}
    print("estimated attention seconds over bench:", estimate, flush=True)
    return dict(steps=rows, estimated_seconds=estimate)


STORE_SEQS, STORE_BLOCKS = 256, 1024  # bench.py's largest decode batch; blocks a layer's cache


def kv_store_times() -> dict:
    """`prepare_qkv` (norms, rotary, the K/V store) at a decode step of STORE_SEQS sequences, each in a block of
    its own, storing into the LAYERS layers' caches in turn; µs a layer, the least of three graphs' means."""
    from nanovllm.kernels.prepare_qkv import prepare_qkv
    from nanovllm.utils.fp8_kv import FP8_KV, value_cache
    qkv = bf16(STORE_SEQS, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    positions = torch.randint(0, MAX_MODEL_LEN, (STORE_SEQS,), device="cuda")
    norms = (bf16(HEAD_DIM), bf16(HEAD_DIM), 1e-6)
    cos_sin = torch.randn(MAX_MODEL_LEN, 1, HEAD_DIM, device="cuda")
    blocks = torch.randperm(STORE_BLOCKS, device="cuda")[:STORE_SEQS]
    slots = (blocks * BLOCK_SIZE + torch.randint(0, BLOCK_SIZE, (STORE_SEQS,), device="cuda")).int()
    report = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8_KV)):
        shape = (STORE_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        caches = []
        for _ in range(LAYERS):
            k, v = torch.zeros(shape, dtype=dtype, device="cuda"), torch.zeros(shape, dtype=dtype, device="cuda")
            scales = tuple(torch.zeros(STORE_BLOCKS, KV_HEADS, BLOCK_SIZE, device="cuda") for _ in range(2))
            caches.append((k, value_cache(v), scales) if dtype == FP8_KV else (k, v, None))
        calls = [partial(prepare_qkv, qkv, positions, HEADS, KV_HEADS, norms, cos_sin, k, v, slots, False, scales)
                 for k, v, scales in caches]
        report[name] = round(min(graph_us(calls) for _ in range(3)), 2)
        del caches, calls
        torch.cuda.empty_cache()
    print("prepare_qkv, us a layer:", report, flush=True)
    return report


def one_row_matmul(x: torch.Tensor, y: torch.Tensor, blocks: tuple[int, int, int], w: torch.Tensor):
    """The one-row kernel with (rows a program, BLOCK_K, warps) = blocks."""
    n, k = w.shape
    block_n, block_k, num_warps = blocks
    one_row_linear_kernel[(triton.cdiv(n, block_n),)](x, w, w, y, n, k, **scale_args(w, None, block_k),
                                                      HAS_BIAS=False, SILU_AND_MUL=False, BLOCK_N=block_n,
                                                      BLOCK_K=block_k, STAGES=1, USE_PDL=False,
                                                      num_warps=num_warps)


def tried_blocks(k: int) -> list[tuple[int, int, int]]:
    """(rows a program, BLOCK_K, warps): 1-8 rows of up to the whole row, at most 16,384 weights a program."""
    return [(block_n, block_k, num_warps) for block_n in (1, 2, 4, 8) for block_k in (256, 512, 1024, 2048, 4096)
            for num_warps in (2, 4, 8) if block_k <= triton.next_power_of_2(k) and block_n * block_k <= 16384]


def cold_us(fn, weights: list[torch.Tensor]) -> float:
    """Mean device time of fn(w), each call on the next of `weights`, over two passes in one CUDA graph."""
    return graph_us([partial(fn, w) for w in weights] * 2)


def cold_matmul_times(matmuls: dict = MATMULS) -> list[dict]:
    rows = []
    for name, (n, k) in matmuls.items():
        weights = [bf16(n, k) * 0.02 for _ in range(-(-COLD_BYTES // (n * k * 2)))]
        x, y = bf16(1, k), torch.empty(n, dtype=torch.bfloat16, device="cuda")
        expected = F.linear(x, weights[0])[0].float()
        timings = {}
        for blocks in tried_blocks(k):
            one_row_matmul(x, y, blocks, weights[0])
            torch.testing.assert_close(y.float(), expected, atol=2e-2, rtol=2e-2)
            timings[blocks] = cold_us(partial(one_row_matmul, x, y, blocks), weights)
        best, engine = min(timings, key=timings.get), (BLOCK_N, *blocks_for(k))
        cublas_us = cold_us(partial(F.linear, x), weights)
        row = dict(matmul=name, n=n, k=k, copies=len(weights), cublas_us=round(cublas_us, 2),
                   engine_us=round(timings[engine], 2), best_us=round(timings[best], 2), best=best,
                   best_gb_s=round(n * k * 2 / 1e9 / timings[best] * 1e6))
        print(row, flush=True)
        rows.append(row | {"all": {f"{bn}x{bk}w{nw}": round(t, 2) for (bn, bk, nw), t in sorted(timings.items())}})
    return rows


PARTS = dict(attention=attention_times, bench_attention=bench_attention_times, fp8_attention=fp8_attention_times,
             kv_store=kv_store_times, cold_matmuls=cold_matmul_times,
             cold_moe_matmuls=partial(cold_matmul_times, MOE_MATMULS))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="attention,cold_matmuls", help=f"any of {', '.join(PARTS)}")
    parser.add_argument("--out", help="a JSON file for the figures")
    parser.add_argument("--attention-dims", default="qwen3-0.6b", choices=sorted(ATTENTION_DIMS),
                        help="the heads and layers of the attention parts")
    args = parser.parse_args()
    global HEADS, KV_HEADS, LAYERS
    HEADS, KV_HEADS, LAYERS = ATTENTION_DIMS[args.attention_dims]
    if set(args.parts.split(",")) - set(PARTS):
        parser.error(f"unknown parts in {args.parts}; known: {', '.join(PARTS)}")
    report = dict(gpu=torch.cuda.get_device_name())
    for name in args.parts.split(","):
        report[name] = PARTS[name]()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
