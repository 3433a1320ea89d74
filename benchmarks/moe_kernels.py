"""The fused MoE kernels at Qwen3-30B-A3B's layer shape (128 experts of 768, 8 a token, hidden 2048) for a
range of token counts and tile configurations: microseconds a call (replayed as a CUDA graph, as decode
runs it, so no launch cost of the host's counts; CUDA events, median of 20), the weight bytes it must read
over that time, and its matmul rate; and the alignment alone. What `fused_moe.choose_tiles` is chosen from.
Up to `FEW_PAIRS` pairs also `fused_moe_few`'s kernels, for each of FEW_CANDIDATES (columns a program of
gate/up and of down computes, and warps; None: the reduction's default), what its constants are chosen from.

    python -m benchmarks.moe_kernels [--tokens 1,2,4,8,64,256,1024,4096,16384] [--out results.json]
"""
import argparse
import itertools
import json
import statistics

import torch

from nanovllm.layers.fused_moe import Tiles, align, choose_tiles, fused_experts
from nanovllm.layers.fused_moe_few import FEW_PAIRS, GATE_UP_ROWS, down_rows_for, few_token_experts
from nanovllm.layers.moe import route

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 128, 2048, 768, 8
CANDIDATES = [Tiles(16, 32, 64, 4, 4), Tiles(16, 64, 64, 4, 3), Tiles(16, 64, 128, 4, 3), Tiles(16, 128, 64, 4, 3),
              Tiles(32, 64, 64, 4, 3), Tiles(64, 64, 64, 4, 3), Tiles(64, 128, 64, 4, 3), Tiles(64, 128, 64, 8, 4),
              Tiles(128, 128, 64, 8, 3), Tiles(32, 128, 64, 4, 3), Tiles(128, 64, 64, 4, 4)]

FEW_CANDIDATES = list(itertools.product([1, 2, 4, 8], [1, 2, 4], [None, 4]))


def microseconds(fn, *args, repeats: int = 20) -> float:
    fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def layer_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's stacked experts, w13 and w2, in bf16, seeded."""
    torch.manual_seed(0)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda") / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device="cuda") / INTERMEDIATE**0.5).bfloat16()
    return w13, w2


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,2,4,8,64,256,1024,4096,16384")
    parser.add_argument("--out")
    args = parser.parse_args()
    w13, w2 = layer_weights()
    expert_bytes = 3 * HIDDEN * INTERMEDIATE * 2
    rows = []
    for num_tokens in map(int, args.tokens.split(",")):
        x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights, expert_ids = route(torch.randn(num_tokens, NUM_EXPERTS, device="cuda"), TOP_K, renormalise=True)
        touched = expert_ids.unique().numel()
        flops = 2 * num_tokens * TOP_K * 3 * HIDDEN * INTERMEDIATE
        chosen = choose_tiles(num_tokens * TOP_K, NUM_EXPERTS)
        for tiles in CANDIDATES:
            us = microseconds(fused_experts, x, w13, w2, weights, expert_ids, tiles)
            row = dict(tokens=num_tokens, tiles=list(tiles), us=round(us, 1), chosen=tiles == chosen,
                       weight_tb_s=round(touched * expert_bytes / us / 1e6, 2), tflops=round(flops / us / 1e6, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
        if num_tokens * TOP_K <= FEW_PAIRS:
            for gate_up_rows, down_rows, warps in FEW_CANDIDATES:
                us = microseconds(few_token_experts, x, w13, w2, weights, expert_ids, gate_up_rows, down_rows, warps)
                row = dict(tokens=num_tokens, few=[gate_up_rows, down_rows, warps], us=round(us, 1),
                           chosen=(gate_up_rows, down_rows, warps) == (GATE_UP_ROWS, down_rows_for(num_tokens), None),
                           weight_tb_s=round(touched * expert_bytes / us / 1e6, 2))
                rows.append(row)
                print(json.dumps(row), flush=True)
        align_us = microseconds(align, expert_ids, NUM_EXPERTS, 16)
        print("align", json.dumps(dict(tokens=num_tokens, us=round(align_us, 1))), flush=True)
        best = min((r for r in rows if r["tokens"] == num_tokens), key=lambda r: r["us"])
        print("best", json.dumps(best), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
