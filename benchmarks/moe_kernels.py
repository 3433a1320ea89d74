"""The fused MoE kernels at Qwen3-30B-A3B's layer shape (128 experts of 768, 8 a token, hidden 2048), on one GPU:
for each token count, every tile configuration of CANDIDATES (what `fused_moe.choose_tiles` chooses from), and
the alignment alone. Each call is replayed from a CUDA graph, as decode runs it (the mean of 20 replays): its µs,
the weight bytes it must read over that time, and its matmul rate.

Up to FEW_PAIRS (token, expert) pairs, `fused_moe_few`'s kernels in bf16 and with FP8 experts (block and row
scales): a graph of COLD_CALLS calls, each routed at random, so that the weights are read from memory as a
decode step's layers read theirs; each gate/up setting of FEW_GATE_UP with down at the engine's, then each down
setting of FEW_DOWN with gate/up at the engine's (`FewTiles`).

    python -m benchmarks.moe_kernels [--tokens 1,2,4,8,64,256,1024,4096,16384] [--out FILE]
"""
import argparse
import itertools
import json
from functools import partial

import torch

from benchmarks.gpu_timing import graph_us
from nanovllm.kernels.fused_moe import Tiles, choose_tiles, fused_experts
from nanovllm.kernels.fused_moe_few import BF16_TILES, FEW_PAIRS, FP8_TILES, few_token_experts
from nanovllm.kernels.moe_align import align
from nanovllm.layers.moe import route
from nanovllm.utils.fp8_weights import quantize

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 128, 2048, 768, 8
EXPERT_BYTES = 3 * HIDDEN * INTERMEDIATE * 2
CANDIDATES = [Tiles(16, 32, 64, 4, 4), Tiles(16, 64, 64, 4, 3), Tiles(16, 64, 128, 4, 3), Tiles(16, 128, 64, 4, 3),
              Tiles(32, 64, 64, 4, 3), Tiles(64, 64, 64, 4, 3), Tiles(64, 128, 64, 4, 3), Tiles(64, 128, 64, 8, 4),
              Tiles(128, 128, 64, 8, 3), Tiles(32, 128, 64, 4, 3), Tiles(128, 64, 64, 4, 4)]
FEW_GATE_UP = list(itertools.product([1, 2, 4, 8, 16], [2, 4, 8]))  # (rows, warps)
# (rows, warps, step bytes)
FEW_DOWN = list(itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [256])) + [(2, 8, 128), (2, 8, 512)]
COLD_CALLS = 48


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
    print("best tiles", json.dumps(min(rows, key=lambda r: r["us"])), flush=True)
    print("align", json.dumps(dict(tokens=num_tokens, us=round(microseconds(align, expert_ids, NUM_EXPERTS, 16), 1))))
    if num_tokens * TOP_K <= FEW_PAIRS:
        rows += few_token_rows(num_tokens, w13, w2)
    return rows


def few_token_rows(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor) -> list[dict]:
    """fused_moe_few's kernels at each setting around the engine's, per weights' format, weights read from memory."""
    calls = [(torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16),
              *route(torch.randn(num_tokens, NUM_EXPERTS, device="cuda"), TOP_K, renormalise=True))
             for _ in range(COLD_CALLS)]
    rows = []
    for scheme in ("bf16", "block", "channel"):
        (q13, s13), (q2, s2) = ((w13, None), (w2, None)) if scheme == "bf16" else (stacked_fp8(w13, scheme),
                                                                                  stacked_fp8(w2, scheme))
        engine = BF16_TILES if scheme == "bf16" else FP8_TILES
        settings = [engine._replace(gate_up_rows=columns, gate_up_warps=warps) for columns, warps in FEW_GATE_UP]
        settings += [engine._replace(down_rows=columns, down_warps=warps, down_step_bytes=step)
                     for columns, warps, step in FEW_DOWN]
        for tiles in dict.fromkeys([engine] + settings):
            us = graph_us([partial(few_token_experts, x, q13, q2, weights, expert_ids, s13, s2, tiles)
                           for x, weights, expert_ids in calls], replays=10)
            rows.append(dict(tokens=num_tokens, scheme=scheme, few=list(tiles), us=round(us, 1),
                             chosen=tiles == engine))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def stacked_fp8(stacked: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's weight in e4m3 and its scales in `scheme`'s layout ("block" or "channel"), stacked."""
    pairs = [quantize(weight, scheme) for weight in stacked]
    return torch.stack([weight for weight, _ in pairs]), torch.stack([scale for _, scale in pairs])


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
