"""Which configuration `fp8_linear.fp8_matmul` runs a product in: its tiles by rows, and over how many programs a
tile's sum splits; with row scales, also the decode batches it keeps from torch's row-wise FP8 matmul. Each rule is
the fastest measured on an H200 (benchmarks/fp8_kernels.py, docs/benchmarks.md)."""
from typing import NamedTuple

import triton


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int = 128  # a divisor of 128, so that a step of the sum lies in one group of block scales
    num_warps: int = 4
    num_stages: int = 4


# (most rows, tiles): the first whose bound the rows are within. Above 64 rows, the fastest over Qwen3-8B's four
# projections at 256 and 2,048 rows, with block scales and within 2% of the fastest with row scales
# (benchmarks/fp8_kernels.py --sweep, docs/benchmarks.md).
DECODE_TILES = (Tiles(16, 32), Tiles(64, 32))
TILES_BY_ROWS = ((16, DECODE_TILES[0]), (64, DECODE_TILES[1]), (None, Tiles(64, 128, 128, 4, 3)))
# With row scales above `fp8_linear.TORCH_ROWWISE_ROWS`, fp8_matmul's 64-row tiles keep the products where cuBLAS's
# row-wise FP8 kernel (128x128 tiles at decode batches) is slower, measured on an H200: an output of at most
# FEW_TILES such tiles (about an eighth of its 132 multiprocessors) up to FEW_TILES_ROWS rows, as Qwen3-0.6B's o and
# down are up to 256 rows and Qwen3-30B-A3B's o up to 128; and sums of at most SHORT_SUM columns up to SHORT_SUM_ROWS
# rows, Qwen3-0.6B's and Qwen3-30B-A3B's q/k/v and gate/up (each 64x32 program reads its 64 rows of x over the whole
# sum, so Qwen3-8B's longer sums, 4,096 columns, run faster row-wise).
FEW_TILES, FEW_TILES_ROWS = 16, 256
SHORT_SUM, SHORT_SUM_ROWS = 2048, 128
# An output of few tiles splits its sum over up to MAX_SPLIT_K programs a tile, towards SPLIT_PROGRAMS programs in
# all (about two an H200 multiprocessor), MIN_SPLIT_STEPS steps of the sum a program or more on average: at 4-256
# rows, Qwen3-0.6B's o and down from 6.6-9.2 us to 4.6-7.7, Qwen3-30B-A3B's o from 11.5-11.7 to 6.5-9.0, block
# scales alike up to 64 rows; Qwen3-8B's o and down up to 64 rows from 12.4-38.4 to 9.3-26.9 (docs/benchmarks.md).
SPLIT_PROGRAMS, MIN_SPLIT_STEPS, MAX_SPLIT_K = 256, 5, 4


def choose_tiles(rows: int, columns: int, k: int, row_scales: bool) -> Tiles:
    """fp8_matmul's tiles for an output of rows x columns summing k columns: by rows (TILES_BY_ROWS), but the 64-row
    ones with row scales where `keeps_decode_tiles`."""
    by_rows = min(rows, 64) if row_scales and keeps_decode_tiles(rows, columns, k) else rows
    return next(tiles for most, tiles in TILES_BY_ROWS if most is None or by_rows <= most)


def keeps_decode_tiles(rows: int, columns: int, k: int) -> bool:
    """Whether a product with row scales keeps fp8_matmul's 64-row tiles above `fp8_linear.TORCH_ROWWISE_ROWS` rows:
    an output of at most FEW_TILES tiles of 128x128 up to FEW_TILES_ROWS rows, or a sum of at most SHORT_SUM columns
    up to SHORT_SUM_ROWS rows."""
    few_tiles = rows <= FEW_TILES_ROWS and triton.cdiv(rows, 128) * triton.cdiv(columns, 128) <= FEW_TILES
    return few_tiles or (rows <= SHORT_SUM_ROWS and k <= SHORT_SUM)


def choose_split_k(rows: int, columns: int, k: int, tiles: Tiles) -> int:
    """Programs a tile sums its k columns over: for DECODE_TILES, towards SPLIT_PROGRAMS programs, MIN_SPLIT_STEPS
    steps of the sum a program or more on average (the last may take fewer); one for others."""
    if tiles not in DECODE_TILES:
        return 1
    num_tiles = triton.cdiv(rows, tiles.block_m) * triton.cdiv(columns, tiles.block_n)
    return max(1, min(SPLIT_PROGRAMS // num_tiles, triton.cdiv(k, tiles.block_k) // MIN_SPLIT_STEPS, MAX_SPLIT_K))
