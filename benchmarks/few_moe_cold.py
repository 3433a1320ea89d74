"""The few-token MoE kernels (`fused_moe_few`) with cold weights, as a decode step meets them: each call routes
to other experts (a fresh random top 8 of 128 per call, 48 calls in one CUDA graph), so no call finds its
experts' 75 MB in the 50 MB L2 cache. Each kernel alone, for every output columns a program, reduction block
and warp count tried; at Qwen3-30B-A3B's layer (hidden 2048, experts of 768).

    python -m benchmarks.few_moe_cold [--tokens 1,2,4] [--out FILE]
"""
import argparse
import itertools
import json
from functools import partial

import torch
import triton

from benchmarks.decode_kernels import calls_time_us
from benchmarks.moe_kernels import HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K, layer_weights
from nanovllm.layers.fused_moe_few import GATE_UP_ROWS, down_rows_for, few_down_kernel, few_gate_up_kernel
from nanovllm.layers.moe import route
from nanovllm.layers.one_row_linear import blocks_for

CALLS = 48
ROWS, BLOCK_KS, WARPS = (1, 2, 4), (256, 512, 1024, 2048), (2, 4, 8)


def gate_up(x, w13, h, expert_ids, rows, block_k, warps):
    few_gate_up_kernel[(expert_ids.numel(), triton.cdiv(INTERMEDIATE, rows))](
        x, w13, expert_ids, h, TOP_K=TOP_K, HIDDEN=HIDDEN, INTERMEDIATE=INTERMEDIATE, BLOCK_N=rows, BLOCK_K=block_k,
        USE_PDL=False, num_warps=warps)


def down(h, w2, weights, expert_ids, out, rows, block_k, warps):
    few_down_kernel[(out.size(0), triton.cdiv(HIDDEN, rows))](
        h, w2, weights, expert_ids, out, TOP_K=TOP_K, HIDDEN=HIDDEN, INTERMEDIATE=INTERMEDIATE, BLOCK_N=rows,
        BLOCK_K=block_k, USE_PDL=False, num_warps=warps)


def sweep(kernel, routes, k: int, engine: tuple) -> dict:
    times = {}
    for rows, block_k, warps in itertools.product(ROWS, BLOCK_KS, WARPS):
        if block_k <= triton.next_power_of_2(k) and rows * block_k <= 8192:
            times[(rows, block_k, warps)] = calls_time_us([partial(kernel, *route_, rows=rows, block_k=block_k,
                                                                   warps=warps) for route_ in routes])
    best = min(times, key=times.get)
    return dict(engine=engine, engine_us=round(times[engine], 2), best=best, best_us=round(times[best], 2),
                all={"x".join(map(str, key)): round(t, 2) for key, t in sorted(times.items())})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,2,4")
    parser.add_argument("--out")
    args = parser.parse_args()
    w13, w2 = layer_weights()
    report = {}
    for num_tokens in map(int, args.tokens.split(",")):
        x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(num_tokens * TOP_K, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        routes = [route(torch.randn(num_tokens, NUM_EXPERTS, device="cuda"), TOP_K, True) for _ in range(CALLS)]
        gate_up_engine = (GATE_UP_ROWS, *blocks_for(HIDDEN))
        down_engine = (down_rows_for(num_tokens), *blocks_for(INTERMEDIATE))
        rows = dict(gate_up=sweep(gate_up, [(x, w13, h, ids) for _, ids in routes], HIDDEN, gate_up_engine),
                    down=sweep(down, [(h, w2, weights, ids, out) for weights, ids in routes], INTERMEDIATE,
                               down_engine))
        report[num_tokens] = rows
        for name, row in rows.items():
            print(json.dumps(dict(tokens=num_tokens, kernel=name, **{k: v for k, v in row.items() if k != "all"})),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
