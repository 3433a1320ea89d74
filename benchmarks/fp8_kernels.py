"""The FP8 weights' kernels against bf16's, on one GPU, each call replayed from a CUDA graph as decode runs it
(the mean of 20 replays): its µs and the weight bytes it reads over that time.

- linears (`--model`'s projections, Qwen3-0.6B's or Qwen3-8B's): for each row count, the bf16 path the engine
  takes (the one-row kernel, else cuBLAS) against `fp8_linear.linear` with each scheme's scales (activations
  quantized, then the matmul) and, with --sweep, `fp8_matmul` alone at every tile configuration of CANDIDATES
  (one row too) and `quantize_groups` alone;
- experts (Qwen3-30B-A3B's layer: 128 of 768, top 8, hidden 2048): `fused_moe.fused_experts` in bf16 and with
  FP8 experts, each scheme; with --sweep, the grouped kernels at every tile configuration of
  FP8_MOE_CANDIDATES (bf16's at `moe_kernels.CANDIDATES` unless --no-bf16-sweep), few tokens too; with
  --sweep-down, the down kernel alone at every DOWN_CANDIDATES beside the gate/up kernel's chosen tiles (its sum
  is 768 columns long, gate/up's 2,048), in bf16 and with block scales; with --sweep-swapped, both kernels
  with their products transposed (`Tiles.swap_ab`) at every SWAPPED_CANDIDATES, then the down kernel at every
  SWAPPED_DOWN_CANDIDATES beside gate/up's SWAPPED_GATE_UP of each block_m, in bf16 and with block scales.

With --cold, only the linears, with block scales and weights read from memory (not L2): the engine's path and
fp8_matmul at each of COLD_CANDIDATES against torch's block-scaled matmul and bf16's cuBLAS.

With --decode-cold, only the linears at decode batches (--rows), weights cold, activations quantized beforehand,
per channel and (up to 64 rows) per block: bf16's cuBLAS, `fp8_matmul` on the tiles and split of the sum it
chooses and unsplit, torch's row-wise matmul (row scales), and whether the engine takes torch's.

With --split-sweep, only the linears with block scales, weights cold, activations quantized beforehand: torch's
block-scaled matmul against `fp8_matmul` at every SPLIT_CANDIDATES tiles and SPLITS split of the sum.

With --one-row, only the one-row kernel (a decode step of one sequence), weights read from memory: bf16's and
block FP8's as the engine launches them, and FP8 at every ONE_ROW_CANDIDATES in Triton's pipeline.

    python -m benchmarks.fp8_kernels [--model qwen3-8b] [--rows 1,2,4,...] [--tokens 1,4,...] [--sweep]
        [--sweep-down] [--sweep-swapped] [--cold] [--decode-cold] [--split-sweep] [--one-row]
"""
import argparse
import json
from functools import partial

import torch
import triton

from benchmarks.gpu_timing import COLD_BYTES, graph_us
from benchmarks.moe_kernels import CANDIDATES as MOE_CANDIDATES
from benchmarks.moe_kernels import stacked_fp8
from nanovllm.kernels import fp8_linear, fp8_tiles, one_row_linear, pdl
from nanovllm.kernels.fp8_linear import quantize_groups
from nanovllm.kernels.fp8_tiles import Tiles
from nanovllm.kernels.fused_moe import FEW_PAIRS, choose_tiles, fused_experts
from nanovllm.kernels.fused_moe import Tiles as MoeTiles
from nanovllm.layers.moe import route
from nanovllm.utils.fp8_weights import FP8, FP8_MAX, quantize

LINEARS = {"qwen3-0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
           "qwen3-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)},
           "qwen3-30b-a3b": {"qkv": (2048, 5120), "o": (4096, 2048)}}  # its experts: expert_rows
CANDIDATES = [Tiles(16, 32), Tiles(16, 64), Tiles(16, 128), Tiles(32, 64), Tiles(64, 32), Tiles(64, 64),
              Tiles(64, 128, 128, 4, 3), Tiles(128, 64, 128, 4, 3), Tiles(128, 128, 128, 8, 3),
              Tiles(128, 128, 64, 8, 4), Tiles(128, 256, 128, 8, 3), Tiles(64, 256, 128, 8, 3)]
# For FP8 experts beside moe_kernels' (tuned on bf16): a tile of e4m3 weights holds half the bytes of bf16's.
# A step of the sum (block_k) spans at most one group of 128 columns, whose scales it applies.
FP8_MOE_CANDIDATES = MOE_CANDIDATES + [
    MoeTiles(16, 128, 128, 4, 4), MoeTiles(32, 64, 128, 4, 4), MoeTiles(32, 128, 128, 4, 3),
    MoeTiles(64, 64, 128, 4, 3), MoeTiles(64, 64, 128, 4, 4), MoeTiles(64, 128, 128, 4, 3),
    MoeTiles(64, 128, 128, 8, 4), MoeTiles(128, 128, 128, 8, 3)]
# The down kernel's (block_n, block_k, warps, stages); steps of at most 128 columns, one group of block scales.
DOWN_CANDIDATES = [(32, 128, 4, 3), (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5),
                   (128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (256, 128, 8, 3),
                   (64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 5), (256, 64, 8, 4)]
# Transposed products: the weight's rows (block_n) on the tensor cores' M, 16-64 pairs (block_m) on N.
SWAPPED_CANDIDATES = [MoeTiles(*t, swap_ab=True) for t in [
    (16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 3), (32, 64, 128, 4, 4),
    (32, 64, 128, 4, 5), (32, 128, 128, 4, 3), (32, 128, 128, 4, 4), (32, 128, 128, 8, 3), (64, 64, 128, 4, 3),
    (64, 128, 128, 4, 3), (64, 128, 128, 8, 3)]]
SWAPPED_GATE_UP = {16: MoeTiles(16, 64, 128, 4, 4, True), 32: MoeTiles(32, 64, 128, 4, 4, True)}
# (block_n, block_k, warps, stages, swap_ab) of the down kernel
SWAPPED_DOWN_CANDIDATES = [(64, 128, 4, 3, True), (64, 128, 4, 4, True), (64, 128, 4, 5, True),
                           (128, 128, 4, 3, True), (128, 128, 4, 4, True), (128, 128, 8, 3, True),
                           (256, 128, 8, 3, True), (64, 128, 4, 3, False), (128, 128, 4, 4, False)]
COLD_CANDIDATES = [Tiles(64, 32), Tiles(64, 128, 128, 4, 3)]  # fp8_matmul's tiles for --cold: by rows
# fp8_matmul's tiles and splits of the sum for --split-sweep, against torch's block-scaled matmul above 64 rows
SPLIT_CANDIDATES = [Tiles(64, 32), Tiles(64, 64, 128, 4, 3), Tiles(64, 64, 128, 4, 4), Tiles(64, 128, 128, 4, 3),
                    Tiles(64, 128, 128, 8, 3), Tiles(128, 64, 128, 4, 3), Tiles(128, 128, 128, 8, 3),
                    Tiles(32, 128, 128, 4, 3)]
SPLITS = (1, 2, 4, 8)
# The one-row kernel's (rows a program, BLOCK_K, warps) for --one-row: 16 to 128 weights a thread
ONE_ROW_CANDIDATES = [(n, k, w) for n in (4, 8, 16) for k in (512, 1024, 2048) for w in (2, 4, 8)
                      if 16 <= n * k // (32 * w) <= 128]
NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 128, 2048, 768, 8


def microseconds(fn, *args, **kwargs) -> float:
    return graph_us([lambda: fn(*args, **kwargs)], replays=20)


def fitting_us(fn, *args, **kwargs) -> float | str:
    """microseconds, or "too large" for tiles past the GPU's shared memory."""
    try:
        return round(microseconds(fn, *args, **kwargs), 1)
    except triton.runtime.errors.OutOfResources:
        return "too large"


def linear_rows(model: str, row_counts: list[int], sweep: bool) -> list[dict]:
    rows = []
    for name, (k, n) in LINEARS[model].items():
        torch.manual_seed(0)
        weight = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        packed = {scheme: quantize(weight, scheme) for scheme in ("channel", "block")}
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = microseconds(one_row_linear.linear, x, weight)
            row = dict(model=model, linear=name, rows=m, bf16_us=round(bf16, 1))
            for scheme, (w, s) in packed.items():
                us = microseconds(fp8_linear.linear, x, w, s)
                row[f"{scheme}_us"], row[f"{scheme}_speedup"] = round(us, 1), round(bf16 / us, 2)
                if sweep:
                    xq, xs = quantize_groups(x)
                    row["quantize_us"] = round(microseconds(quantize_groups, x), 1)
                    row[f"{scheme}_sweep"] = {tiles_name(t): round(microseconds(
                        fp8_linear.fp8_matmul, xq, xs, w, s, tiles=t), 1) for t in CANDIDATES}
                    row[f"{scheme}_torch_us"] = torch_scaled_mm_us(x, w, s, scheme)
            row["fp8_weight_tb_s"] = round(n * k / row["block_us"] / 1e6, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def cold_linear_rows(model: str, row_counts: list[int]) -> list[dict]:
    """Block-scaled FP8 linears with cold weights (each call a different copy of COLD_BYTES' worth), the
    activations' quantization included: bf16's cuBLAS, the engine's path, torch's block-scaled matmul, and
    fp8_matmul at every COLD_CANDIDATES with its relative difference from torch's output."""
    rows = []
    for name, (k, n), m, x, weights, packed in cold_block_linears(model, row_counts):
        row = dict(model=model, linear=name, rows=m, weight_mb=round(n * k / 1e6, 1),
                   bf16_us=cold_us(torch.nn.functional.linear, x, [(w,) for w in weights]),
                   engine_us=cold_us(fp8_linear.linear, x, packed))
        reference = torch_block_matmul(x, *packed[0]).float()
        row["torch_us"] = cold_us(torch_block_matmul, x, packed)
        for tiles in COLD_CANDIDATES:
            run = partial(quantized_fp8_matmul, tiles)
            error = relative_difference(run(x, *packed[0]), reference)
            row[tiles_name(tiles)] = (cold_us(run, x, packed), round(error, 4))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cold_block_linears(model: str, row_counts: list[int]):
    """For each of the model's linears and each row count: its name, (in, out) features, the rows, random bf16
    activations, the weight's cold copies (`cold_weight_copies`) and those packed with block scales."""
    for name, (k, n) in LINEARS[model].items():
        weights = cold_weight_copies(n, k)
        packed = [quantize(weight, "block") for weight in weights]
        for m in row_counts:
            yield name, (k, n), m, torch.randn(m, k, device="cuda", dtype=torch.bfloat16), weights, packed


def relative_difference(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got.float() - reference).norm() / reference.norm()).item()


def decode_cold_rows(model: str, row_counts: list[int]) -> list[dict]:
    """--decode-cold's rows: each linear at each row count, per channel and (up to TORCH_MATMUL_ROWS rows) per
    block, with cold weights."""
    rows = []
    for name, (k, n) in LINEARS[model].items():
        weights = cold_weight_copies(n, k)
        for scheme in ("channel", "block"):
            packed = [quantize(weight, scheme) for weight in weights]
            for m in row_counts:
                if scheme == "block" and m > fp8_linear.TORCH_MATMUL_ROWS:
                    continue
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                xq, xs = quantize_groups(x, per_token=scheme == "channel")
                tiles = fp8_tiles.choose_tiles(m, n, k, scheme == "channel")
                row = dict(model=model, linear=name, scheme=scheme, rows=m, tiles=tiles_name(tiles),
                           split_k=fp8_tiles.choose_split_k(m, n, k, tiles),
                           takes_torch=fp8_linear.takes_torch_matmul(x, *packed[0]),
                           bf16_us=cold_us(torch.nn.functional.linear, x, [(w,) for w in weights]),
                           chosen_us=cold_us(prequantized_matmul, (xq, xs), packed),
                           unsplit_us=cold_us(partial(prequantized_matmul, split_k=1), (xq, xs), packed))
                if scheme == "channel":
                    row["row_wise_us"] = cold_us(prequantized_torch, (xq, xs), packed)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def split_sweep_rows(model: str, row_counts: list[int]) -> list[dict]:
    """--split-sweep's rows: each linear with block scales at each row count, weights cold, activations quantized
    beforehand: torch's block-scaled matmul, and fp8_matmul at every SPLIT_CANDIDATES and SPLITS (the ten
    fastest), checked against torch's output."""
    rows = []
    for name, (k, _), m, x, weights, packed in cold_block_linears(model, row_counts):
        xq, xs = quantize_groups(x)
        for_torch = quantize_groups(x, for_torch=True)
        reference = prequantized_torch(for_torch, *packed[0])[:m].float()
        row = dict(model=model, linear=name, rows=m, takes_torch=fp8_linear.takes_torch_matmul(x, *packed[0]),
                   bf16_us=cold_us(torch.nn.functional.linear, x, [(w,) for w in weights]),
                   torch_us=cold_us(prequantized_torch, for_torch, packed))
        sweep = {}
        for tiles in SPLIT_CANDIDATES:
            for split_k in SPLITS:
                if triton.cdiv(k, tiles.block_k) < split_k:
                    continue
                run = partial(prequantized_matmul, split_k=split_k, tiles=tiles)
                error = relative_difference(run((xq, xs), *packed[0]), reference)
                assert error < 1e-2, (tiles, split_k, error)
                sweep[f"{tiles_name(tiles)}/{split_k}"] = cold_us(run, (xq, xs), packed)
        row["fastest"] = sorted(sweep.items(), key=lambda item: item[1])[:10]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def prequantized_matmul(quantized: tuple, weight: torch.Tensor, scale: torch.Tensor,
                        split_k: int | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    return fp8_linear.fp8_matmul(*quantized, weight, scale, split_k=split_k, tiles=tiles)


def prequantized_torch(quantized: tuple, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's FP8 matmul on activations quantized beforehand: block-scaled or row-wise, as the weight's scales are."""
    return fp8_linear.torch_matmul(quantized, quantized[0].size(0), weight, scale, None, torch.bfloat16)


def one_row_rows(model: str) -> list[dict]:
    """The one-row kernel with cold weights (down takes its activation, as the engine runs it): bf16's and block
    FP8's launches, and FP8 at every ONE_ROW_CANDIDATES fitting the row; µs, the 5 fastest candidates, all."""
    rows = []
    for name, (k, n) in LINEARS[model].items():
        silu = name == "down"
        weights = cold_weight_copies(n, k)
        packed = [quantize(weight, "block") for weight in weights]
        x = torch.randn(1, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)
        bf16_run = one_row_linear.silu_and_mul_linear if silu else one_row_linear.linear
        fp8_run = fp8_linear.silu_and_mul_linear if silu else fp8_linear.linear
        row = dict(model=model, linear=name, fp8_weight_mb=round(n * k / 1e6, 1),
                   bf16_us=cold_us(bf16_run, x, [(w,) for w in weights]), engine_us=cold_us(fp8_run, x, packed))
        reference = fp8_run(x, *packed[0]).float()
        sweep = {}
        for blocks in ONE_ROW_CANDIDATES:
            if blocks[1] <= max(512, triton.next_power_of_2(k)):
                run = partial(one_row_launch, blocks, silu)
                error = relative_difference(run(x, *packed[0]), reference)
                assert error < 1e-2, (blocks, error)
                sweep["x".join(map(str, blocks))] = cold_us(run, x, packed)
        row["fastest"] = sorted(sweep.items(), key=lambda item: item[1])[:5]
        rows.append(row | {"all": sweep})
        print(json.dumps(row), flush=True)
    return rows


def one_row_launch(blocks: tuple[int, int, int], silu_and_mul: bool, x: torch.Tensor, weight: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor:
    """The one-row kernel over an FP8 weight with (rows a program, BLOCK_K, warps) = blocks, in Triton's pipeline."""
    (n, k), (block_n, block_k, num_warps) = weight.shape, blocks
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    one_row_linear.one_row_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight, y, n, k, **one_row_linear.scale_args(weight, scale, block_k), HAS_BIAS=False,
        SILU_AND_MUL=silu_and_mul, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=one_row_linear.FP8_STAGES,
        num_warps=num_warps, **pdl.launch_options(x.device))
    return y


def cold_weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Random bf16 weights [n, k] (seed 0), COLD_BYTES' worth of copies: a call on the next copy reads it from
    memory."""
    torch.manual_seed(0)
    return [(torch.randn(n, k, device="cuda") / k**0.5).bfloat16() for _ in range(-(-COLD_BYTES // (n * k)))]


def cold_us(fn, x: torch.Tensor | tuple, weight_args: list[tuple]) -> float:
    """microseconds of fn(x, *args), each call with the next of weight_args."""
    return round(graph_us([partial(fn, x, *args) for args in weight_args], replays=10), 1)


def torch_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return fp8_linear.torch_matmul(quantize_groups(x, for_torch=True), x.size(0), weight, scale, None, x.dtype)


def quantized_fp8_matmul(tiles: Tiles, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return fp8_linear.fp8_matmul(*quantize_groups(x), weight, scale, tiles=tiles)


def torch_scaled_mm_us(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, scheme: str) -> float | str:
    """torch's FP8 matmul (cuBLAS) alone on the same weights, activations quantized beforehand: per 1x128
    group against 128x128 blocks as `fp8_linear.torch_matmul` runs it, or per row against per-row scales."""
    try:
        if scheme == "block":
            quantized = quantize_groups(x, for_torch=True)
            return round(microseconds(fp8_linear.torch_matmul, quantized, x.size(0), w, scale, None, torch.bfloat16), 1)
        xs = x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX
        xq = (x / xs).to(FP8)
        return round(microseconds(torch._scaled_mm, xq, w.t(), scale_a=xs, scale_b=scale.view(1, -1).float(),
                                  out_dtype=torch.bfloat16), 1)
    except Exception as error:  # not served by this torch or GPU
        return f"failed: {str(error)[:200]}"


def tiles_name(tiles) -> str:
    return "x".join(str(t) for t in tiles if not isinstance(t, bool)) + ("T" if tiles[-1] is True else "")


def expert_rows(token_counts: list[int], sweep: bool, bf16_sweep: bool = True, sweep_down: bool = False,
                sweep_swapped: bool = False) -> list[dict]:
    torch.manual_seed(0)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda") / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device="cuda") / INTERMEDIATE**0.5).bfloat16()
    packed = {scheme: (*stacked_fp8(w13, scheme), *stacked_fp8(w2, scheme)) for scheme in ("channel", "block")}
    rows = []
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights, expert_ids = route(torch.randn(num_tokens, NUM_EXPERTS, device="cuda"), TOP_K, renormalise=True)
        expert_bytes = expert_ids.unique().numel() * 3 * HIDDEN * INTERMEDIATE
        bf16 = microseconds(fused_experts, x, w13, w2, weights, expert_ids)
        row = dict(tokens=num_tokens, bf16_us=round(bf16, 1), bf16_tb_s=round(2 * expert_bytes / bf16 / 1e6, 2))
        for scheme, (q13, s13, q2, s2) in packed.items():
            us = microseconds(fused_experts, x, q13, q2, weights, expert_ids, w13_scale=s13, w2_scale=s2)
            row[f"{scheme}_us"], row[f"{scheme}_speedup"] = round(us, 1), round(bf16 / us, 2)
            row[f"{scheme}_tb_s"] = round(expert_bytes / us / 1e6, 2)
            if sweep:
                row[f"{scheme}_sweep"] = {tiles_name(t): round(microseconds(
                    fused_experts, x, q13, q2, weights, expert_ids, t, w13_scale=s13, w2_scale=s2), 1)
                    for t in FP8_MOE_CANDIDATES}
        if sweep and bf16_sweep:
            row["bf16_sweep"] = {tiles_name(t): round(microseconds(
                fused_experts, x, w13, w2, weights, expert_ids, t), 1) for t in MOE_CANDIDATES}
        if sweep_down and num_tokens * TOP_K > FEW_PAIRS:
            q13, s13, q2, s2 = packed["block"]
            for name, args, scales in (("bf16", (w13, w2), {}), ("block", (q13, q2), dict(w13_scale=s13, w2_scale=s2))):
                tiles = choose_tiles(num_tokens * TOP_K, NUM_EXPERTS, fp8=bool(scales))
                row[f"{name}_down_sweep"] = {tiles_name(down): fitting_us(
                    fused_experts, x, *args, weights, expert_ids, tiles, down_tiles=tiles._replace(
                        block_n=down[0], block_k=down[1], num_warps=down[2], num_stages=down[3],
                        swap_ab=down[4] if len(down) > 4 else False), **scales)
                    for down in [tiles[1:], *DOWN_CANDIDATES]}
        if sweep_swapped and num_tokens * TOP_K > FEW_PAIRS:
            row.update(swapped_sweeps(x, w13, w2, packed["block"], weights, expert_ids))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def swapped_sweeps(x, w13, w2, block_fp8, weights, expert_ids) -> dict:
    """fused_experts at every SWAPPED_CANDIDATES, then at SWAPPED_DOWN_CANDIDATES for the down kernel beside
    SWAPPED_GATE_UP, in bf16 and with block scales: µs, or "too large"; and the largest relative difference of
    any from the untransposed 64x64x128 tiles' output."""
    q13, s13, q2, s2 = block_fp8
    row = {}
    for name, args, scales in (("bf16", (w13, w2), {}), ("block", (q13, q2), dict(w13_scale=s13, w2_scale=s2))):
        run = partial(fused_experts, x, *args, weights, expert_ids, **scales)
        reference, errors = run(MoeTiles(64, 64, 128, 4, 3)).float(), []
        row[f"{name}_swapped"] = {tiles_name(t): checked_us(partial(run, t), reference, errors)
                                  for t in SWAPPED_CANDIDATES}
        for block_m, tiles in SWAPPED_GATE_UP.items():
            row[f"{name}_swapped_down_{block_m}"] = {tiles_name(down): checked_us(partial(run, tiles, down_tiles=(
                tiles._replace(block_n=down[0], block_k=down[1], num_warps=down[2], num_stages=down[3],
                               swap_ab=down[4]))), reference, errors) for down in SWAPPED_DOWN_CANDIDATES}
        row[f"{name}_swapped_max_error"] = max(errors, default=None)
    return row


def checked_us(run, reference: torch.Tensor, errors: list[float]) -> float | str:
    """fitting_us of run(), its relative difference from `reference` appended to errors."""
    try:
        errors.append(relative_difference(run(), reference))
    except triton.runtime.errors.OutOfResources:
        return "too large"
    return fitting_us(run)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(LINEARS))
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,2048,8192")
    parser.add_argument("--tokens", default="1,4,8,64,256,1024,4096")
    parser.add_argument("--sweep", action="store_true", help="every tile configuration of CANDIDATES too")
    parser.add_argument("--no-bf16-sweep", action="store_true", help="sweep the FP8 experts' tiles alone")
    parser.add_argument("--sweep-down", action="store_true", help="the down kernel's tiles alone, DOWN_CANDIDATES")
    parser.add_argument("--sweep-swapped", action="store_true",
                        help="both kernels with transposed products, SWAPPED_CANDIDATES and SWAPPED_DOWN_CANDIDATES")
    parser.add_argument("--cold", action="store_true",
                        help="only the linears, block scales, with cold weights: COLD_CANDIDATES against cuBLAS")
    parser.add_argument("--decode-cold", action="store_true",
                        help="only the linears at decode batches, cold weights: fp8_matmul split and not, cuBLAS")
    parser.add_argument("--split-sweep", action="store_true",
                        help="only the linears with block scales, cold weights: fp8_matmul's tiles and splits, cuBLAS")
    parser.add_argument("--one-row", action="store_true",
                        help="only the one-row kernel, cold weights: bf16's and FP8's launches, ONE_ROW_CANDIDATES")
    parser.add_argument("--out", help="a JSON file for the rows")
    args = parser.parse_args()
    row_counts = [int(m) for m in args.rows.split(",") if m]
    if args.one_row:
        rows = one_row_rows(args.model)
    elif args.cold:
        rows = cold_linear_rows(args.model, row_counts)
    elif args.split_sweep:
        rows = split_sweep_rows(args.model, row_counts)
    elif args.decode_cold:
        rows = decode_cold_rows(args.model, row_counts)
    else:
        rows = linear_rows(args.model, row_counts, args.sweep)
        rows += expert_rows([int(t) for t in args.tokens.split(",") if t], args.sweep, not args.no_bf16_sweep,
                            args.sweep_down, args.sweep_swapped)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
