"""The fused MoE kernels at Qwen3-30B-A3B's layer shape (128 experts of 768, 8 a token, hidden 2048), on one GPU:
for each token count, every tile configuration of CANDIDATES (what `fused_moe.choose_tiles` chooses from) and, up
to FEW_PAIRS (token, expert) pairs, `fused_moe_few`'s kernels at each of FEW_CANDIDATES (columns a program of
gate/up and of down computes, and warps; None: `one_row_linear.blocks_for`'s); and the alignment alone. Each call
is replayed from a CUDA graph, as decode runs it (the mean of 20 replays): its µs, the weight bytes it must read
over that time, and its matmul rate.

    python -m benchmarks.moe_kernels [--tokens 1,2,4,8,64,256,1024,4096,16384] [--out FILE]
"""
import argparse
import itertools
import json

import torch

from benchmarks.gpu_timing import graph_us
from nanovllm.kernels.fused_moe import Tiles, choose_tiles, fused_experts
from nanovllm.kernels.fused_moe_few import FEW_PAIRS, GATE_UP_ROWS, down_rows_for, few_token_experts
from nanovllm.kernels.moe_align import align
from nanovllm.layers.moe import route

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 128, 2048, 768, 8
EXPERT_BYTES = 3 * HIDDEN * INTERMEDIATE * 2
CANDIDATES = [Tiles(16, 32, 64, 4, 4), Tiles(16, 64, 64, 4, 3), Tiles(16, 64, 128, 4, 3), Tiles(16, 128, 64, 4, 3),
              Tiles(32, 64, 64, 4, 3), Tiles(64, 64, 64, 4, 3), Tiles(64, 128, 64, 4, 3), Tiles(64, 128, 64, 8, 4),
              Tiles(128, 128, 64, 8, 3), Tiles(32, 128, 64, 4, 3), Tiles(128, 64, 64, 4, 4)]
FEW_CANDIDATES = list(itertools.product([1, 2, 4, 8], [1, 2, 4], [None, 4]))


def microseconds(fn, *args) -> float:
    return graph_us([lambda: fn(*args)], replays=20)


def layer_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's stacked experts, w13 and w2, in bf16, seeded."""
    torch.manual_seed(0)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda") / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device="cuda") / INTERMEDIATE**0.5).bfloat16()
    return w13, w2


def token_count_rows(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor) -> list[dict]:
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weights, expert_ids = route(torch.randn(num_tokens, NUM_EXPERTS, device="cuda"), TOP_K, renormalise=True)
    experts = (x, w13, w2, weights, expert_ids)
    weight_bytes = expert_ids.unique().numel() * EXPERT_BYTES
    flops = 2 * num_tokens * TOP_K * 3 * HIDDEN * INTERMEDIATE
    rows = []
    chosen = choose_tiles(num_tokens * TOP_K, NUM_EXPERTS)
    for tiles in CANDIDATES:
        us = microseconds(fused_experts, *experts, tiles)
        rows.append(dict(tokens=num_tokens, tiles=list(tiles), us=round(us, 1), chosen=tiles == chosen,
                         weight_tb_s=round(weight_bytes / us / 1e6, 2), tflops=round(flops / us / 1e6, 1)))
        print(json.dumps(rows[-1]), flush=True)
    if num_tokens * TOP_K <= FEW_PAIRS:
        engine = (GATE_UP_ROWS, down_rows_for(num_tokens), None)
        for few in FEW_CANDIDATES:
            us = microseconds(few_token_experts, *experts, *few)
            rows.append(dict(tokens=num_tokens, few=list(few), us=round(us, 1), chosen=few == engine,
                             weight_tb_s=round(weight_bytes / us / 1e6, 2)))
            print(json.dumps(rows[-1]), flush=True)
    print("align", json.dumps(dict(tokens=num_tokens, us=round(microseconds(align, expert_ids, NUM_EXPERTS, 16), 1))))
    print("best", json.dumps(min(rows, key=lambda r: r["us"])), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,2,4,8,64,256,1024,4096,16384")
    parser.add_argument("--out", help="a JSON file for the rows")
    args = parser.parse_args()
    w13, w2 = layer_weights()
    rows = [row for num_tokens in map(int, args.tokens.split(",")) for row in token_count_rows(num_tokens, w13, w2)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
