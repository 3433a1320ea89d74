"""The experts of a mixture-of-experts block for a few tokens (a decode step of a few sequences) in two
Triton kernels, without `moe_align.align`'s grouping: at one token each of its top_k experts is read once
anyway, and the grouping, its zeroed counts and the sum over a token's experts (a kernel each) were a fifth
of the experts' time in a one-sequence decode step of Qwen3-30B-A3B (docs/benchmarks.md).

1. `few_gate_up_kernel`: per (token, slot) pair and BLOCK_N intermediate columns, the token's row times its
   expert's gate and up rows, then silu(gate) * up, into a row per pair;
2. `few_down_kernel`: per token and BLOCK_N output columns, each of its pairs' rows times the expert's down
   projection, scaled by the pair's routing weight, summed over the pairs.

Both round where `fused_moe`'s kernels round, so the two paths give the same sums. Under Triton's
interpreter in the CPU tests.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.kernels.one_row_linear import blocks_for, row_sums, scale_args

FEW_PAIRS = 32  # (token, slot) pairs up to which the experts take this path: 4 tokens of Qwen3-MoE's top 8
GATE_UP_ROWS = 2  # output columns a program of few_gate_up_kernel computes


@triton.jit
def few_gate_up_kernel(x_ptr, w13_ptr, expert_ids_ptr, h_ptr, scale_ptr, stride_se, stride_sn, stride_sk,
                       SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                       INTERMEDIATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
    # FP8 weights (GROUP_K > 0) are summed a group of columns at a time, each group times its scale (row_sums).
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < INTERMEDIATE
    pdl.wait_for_previous(USE_PDL)  # the expert comes from the routing kernel
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K) * HIDDEN
    gate_rows = w13_ptr + expert * (2 * INTERMEDIATE * HIDDEN) + cols[:, None] * HIDDEN
    up_rows = gate_rows + INTERMEDIATE * HIDDEN
    scales = scale_ptr + expert * stride_se
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < HIDDEN
        x = tl.load(x_row + ks, mask=in_k, other=0.0).to(tl.float32)[None, :]
        w_mask = in_cols[:, None] & in_k[None, :]
        gate += row_sums(tl.load(gate_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32) * x, scales, cols,
                         k0, 2 * INTERMEDIATE, HIDDEN, stride_sn, stride_sk, SCALE_ROWS, GROUP_K, BLOCK_N, BLOCK_K)
        up += row_sums(tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32) * x, scales,
                       cols + INTERMEDIATE, k0, 2 * INTERMEDIATE, HIDDEN, stride_sn, stride_sk, SCALE_ROWS, GROUP_K,
                       BLOCK_N, BLOCK_K)
    dtype = h_ptr.dtype.element_ty
    gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)  # rounded as the linear's output is
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(h_ptr + pair * INTERMEDIATE + cols, (silu * up).to(dtype), mask=in_cols)


@triton.jit
def few_down_kernel(h_ptr, w2_ptr, weights_ptr, expert_ids_ptr, out_ptr, scale_ptr, stride_se, stride_sn, stride_sk,
                    SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                    INTERMEDIATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    USE_PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < HIDDEN
    pdl.wait_for_previous(USE_PDL)
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
        rows = w2_ptr + expert * (HIDDEN * INTERMEDIATE) + cols[:, None] * INTERMEDIATE
        scales = scale_ptr + expert * stride_se
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, INTERMEDIATE, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            in_k = ks < INTERMEDIATE
            h = tl.load(h_ptr + pair * INTERMEDIATE + ks, mask=in_k, other=0.0).to(tl.float32)[None, :]
            w = tl.load(rows + ks[None, :], mask=in_cols[:, None] & in_k[None, :], other=0.0).to(tl.float32)
            acc += row_sums(w * h, scales, cols, k0, HIDDEN, INTERMEDIATE, stride_sn, stride_sk, SCALE_ROWS, GROUP_K,
                            BLOCK_N, BLOCK_K)
        weight = tl.load(weights_ptr + pair)
        # The projection's output rounded, then its weighted share (as fused_moe's per-pair rows are)
        total += (acc.to(h_ptr.dtype.element_ty).to(tl.float32) * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + cols, total.to(dtype), mask=in_cols)


def down_rows_for(num_tokens: int) -> int:
    """Output columns a program of few_down_kernel computes: one at one token (2,048 programs at Qwen3-30B-A3B's
    hidden size), four above, the fastest of `benchmarks/moe_kernels.py`'s sweep (docs/benchmarks.md)."""
    return 1 if num_tokens == 1 else 4


def few_token_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      expert_ids: torch.Tensor, gate_up_rows: int = GATE_UP_ROWS, down_rows: int | None = None,
                      num_warps: int | None = None, w13_scale: torch.Tensor | None = None,
                      w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe.fused_experts` for few tokens (up to FEW_PAIRS pairs): the same arguments and result; the
    columns a program computes and its warps (`one_row_linear.blocks_for`'s unless given) are for benchmarks."""
    num_tokens, hidden = x.shape
    intermediate, top_k = w2.size(2), expert_ids.size(1)
    x, weights, expert_ids = x.contiguous(), weights.contiguous(), expert_ids.contiguous()
    options = pdl.launch_options(x.device)
    h = x.new_empty(num_tokens * top_k, intermediate)
    block_k, warps = blocks_for(hidden)
    few_gate_up_kernel[(num_tokens * top_k, triton.cdiv(intermediate, gate_up_rows))](
        x, w13, expert_ids, h, **expert_scales(w13, w13_scale, block_k), TOP_K=top_k, HIDDEN=hidden,
        INTERMEDIATE=intermediate, BLOCK_N=gate_up_rows, BLOCK_K=block_k, num_warps=num_warps or warps, **options)
    out = torch.empty_like(x)
    block_k, warps = blocks_for(intermediate)
    down_rows = down_rows or down_rows_for(num_tokens)
    few_down_kernel[(num_tokens, triton.cdiv(hidden, down_rows))](
        h, w2, weights, expert_ids, out, **expert_scales(w2, w2_scale, block_k), TOP_K=top_k, HIDDEN=hidden,
        INTERMEDIATE=intermediate, BLOCK_N=down_rows, BLOCK_K=block_k, num_warps=num_warps or warps, **options)
    return out


def expert_scales(w: torch.Tensor, scale: torch.Tensor | None, block_k: int) -> dict:
    """`one_row_linear.scale_args` for stacked expert weights [experts, N, K], with the stride between experts."""
    return dict(**scale_args(w, scale, block_k), stride_se=0 if scale is None else scale.stride(0))
