"""Compiles the FP8 KV cache's kernel variants, decode attention at head_dim 256, the one-row kernel's pipeline
and the MoE routing kernel under programmatic dependent launch, and the grouped MoE kernels over FP8 experts,
for an H200 (sm_90) with Triton's compiler and ptxas, in a process of its own (the interpreted kernel tests set
TRITON_INTERPRET=1 for theirs): prints a JSON object, each case's name -> null where it compiled, else the error. Run by
tests/test_kernels_compile.py."""
import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY = 232448  # bytes of shared memory a program may take on an H100 or H200


def compile_for_hopper(fn, types: dict, constexprs: dict, multiples_of_16: tuple = (), **options):
    """The kernel compiled for sm_90: every argument's type, or its constexpr value; options such as num_warps.
    Pointers are taken as 16-byte aligned, as a launch on torch's tensors finds them, and the integers named in
    multiples_of_16 as multiples of 16, as a launch specialises them, so loads vectorize as there."""
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
               if kind.startswith("*") or name in multiples_of_16}
    source = ASTSource(fn=fn, signature=signature, attrs=aligned,
                       constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=HOPPER, options=options)


def prepare_qkv(dtype: str, fp8_kv: bool) -> str:
    from nanovllm.kernels.prepare_qkv import prepare_qkv_kernel
    cache = "*fp8e4nv" if fp8_kv else f"*{dtype}"
    types = dict(qkv_ptr=f"*{dtype}", qkv_stride="i64", positions_ptr="*i64", q_weight_ptr=f"*{dtype}",
                 k_weight_ptr=f"*{dtype}", eps="fp32", cos_sin_ptr="*fp32", q_ptr=f"*{dtype}", k_ptr=f"*{dtype}",
                 v_ptr=f"*{dtype}", k_cache_ptr=cache, v_cache_ptr=cache, slot_mapping_ptr="*i32",
                 k_scales_ptr="*fp32", v_scales_ptr="*fp32")
    return compile_for_hopper(prepare_qkv_kernel, types, dict(
        NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, QK_ROWS=32, V_ROWS=8, KEEP_KV=True, STORE=True, QK_NORM=True,
        FP8_KV=fp8_kv, BLOCK_SIZE=256, FP8_MAX=448.0, MIN_SCALE=1e-12, USE_PDL=False)).asm["ptx"]


def decode_attention(dtype: str, head_dim: int, fp8_kv: bool) -> str:
    """The engine's launch at 256 sequences of 8 KV heads; it must fit an SM's shared memory, and an FP8 cache's
    must hold two tiles in flight."""
    from nanovllm.kernels.decode_attention import (
        MIN_GROUP_ROWS,
        MIN_GROUP_ROWS_FP8,
        split_and_tile_keys,
        split_blocks_and_stages,
        split_kernel,
    )
    cache = "*fp8e4nv" if fp8_kv else f"*{dtype}"
    types = dict(q_ptr=f"*{dtype}", k_cache_ptr=cache, v_cache_ptr=cache, k_scales_ptr="*fp32",
                 v_scales_ptr="*fp32", block_tables_ptr="*i32", block_tables_stride="i32", context_lens_ptr="*i32",
                 seq_order_ptr="*i32", partial_out_ptr="*fp32", partial_max_ptr="*fp32", partial_sum_ptr="*fp32",
                 arrivals_ptr="*i32", out_ptr=f"*{dtype}", scale="fp32", num_splits="i32")
    cache_bytes = 1 if fp8_kv else {"bf16": 2, "fp32": 4}[dtype]
    split_keys, tile_keys = split_and_tile_keys(256, 8, fp8_kv, head_dim * cache_bytes)
    split_blocks, num_stages = split_blocks_and_stages(split_keys, tile_keys, 256, fp8_kv)
    compiled = compile_for_hopper(split_kernel, types, dict(
        NUM_KV_HEADS=8, GROUP=2, GROUP_ROWS=MIN_GROUP_ROWS_FP8 if fp8_kv else MIN_GROUP_ROWS, HEAD_DIM=head_dim,
        BLOCK_SIZE=256, SPLIT_KEYS=split_keys, TILE_KEYS=tile_keys, MAX_SPLITS=8, SPLIT_BLOCKS=split_blocks,
        FP8_KV=fp8_kv, ORDERED=True, USE_PDL=False),
        num_stages=num_stages)
    tile_bytes = 2 * tile_keys * head_dim * cache_bytes  # a tile's keys and values
    if compiled.metadata.shared > SHARED_MEMORY:
        raise AssertionError(f"{compiled.metadata.shared} bytes of shared memory: more than an SM has")
    if fp8_kv and compiled.metadata.shared < 2 * tile_bytes:
        raise AssertionError(f"{compiled.metadata.shared} bytes of shared memory: fewer tiles in flight than meant")
    return compiled.asm["ptx"]


def paged_prompt_attention(block_size: int, fp8_kv: bool) -> str:
    import torch

    from nanovllm.kernels.prefill_attention import prefill_kernel, tile_config
    cache = "*fp8e4nv" if fp8_kv else "*bf16"
    strides = {name: "i32" for name in ("block_tables_stride", "q_token_stride", "q_head_stride", "k_token_stride",
                                        "k_head_stride", "out_token_stride", "out_head_stride")}
    types = dict(q_ptr="*bf16", k_ptr=cache, v_ptr=cache, k_scales_ptr="*fp32", v_scales_ptr="*fp32", out_ptr="*bf16",
                 cu_seqlens_q_ptr="*i32", cu_seqlens_k_ptr="*i32", block_tables_ptr="*i32", scale="fp32", **strides)
    block_m, block_n, num_warps, num_stages = tile_config(128, torch.bfloat16, paged=True, max_seqlen_q=1,
                                                          fp8_kv=fp8_kv)
    return compile_for_hopper(prefill_kernel, types, dict(
        NUM_KV_HEADS=8, GROUP=2, HEAD_DIM=128, PADDED_DIM=128, BLOCK_M=block_m, BLOCK_N=block_n, PAGED=True,
        BLOCK_SIZE=block_size, FP8_KV=fp8_kv, PRECISION="tf32"), num_warps=num_warps, num_stages=num_stages).asm["ptx"]


def one_row_linear(silu_and_mul: bool, _fp8: bool) -> tuple[str, int]:
    """The one-row kernel as a decode step of Qwen3-8B launches it on FP8 gate/up weights (with silu_and_mul, on
    down's), with programmatic dependent launch (bf16 weights take no pipeline): its PTX, and the cp.async copies
    of its first block of weights."""
    from nanovllm.kernels.one_row_linear import FP8_BLOCK_N, FP8_STAGES, fp8_blocks_for, one_row_linear_kernel
    types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", bias_ptr="*bf16", y_ptr="*bf16", N="i32", K="i32",
                 scale_ptr="*fp32", stride_sn="i32", stride_sk="i32")
    block_k, num_warps = fp8_blocks_for(12288 if silu_and_mul else 4096)
    ptx = compile_for_hopper(one_row_linear_kernel, types, dict(
        SCALE_ROWS=128, GROUP_K=128, HAS_BIAS=False, SILU_AND_MUL=silu_and_mul, BLOCK_N=FP8_BLOCK_N, BLOCK_K=block_k,
        STAGES=FP8_STAGES, USE_PDL=True), ("N", "K", "stride_sn"), num_warps=num_warps).asm["ptx"]
    first_block_copies = FP8_BLOCK_N * block_k // (16 * 32 * num_warps)  # 16 bytes a cp.async
    return ptx, first_block_copies


def route(_fp8: bool) -> tuple[str, int]:
    """The MoE routing kernel as Qwen3-30B-A3B's layer launches it, under programmatic dependent launch: its PTX, and
    the loads it may issue before waiting for the kernel that writes its logits (none)."""
    from nanovllm.kernels.moe_route import route_kernel
    types = dict(logits_ptr="*fp32", weights_ptr="*fp32", expert_ids_ptr="*i64")
    ptx = compile_for_hopper(route_kernel, types, dict(NUM_EXPERTS=128, EXPERTS=128, TOP_K=8, SLOTS=8,
                                                       RENORMALISE=True, USE_PDL=True), num_warps=1).asm["ptx"]
    return ptx, 0


def fused_moe(scales: int, _fp8: bool) -> str:
    """The grouped MoE kernels over FP8 experts (SCALES 1: row scales, 2: block scales) on the tiles a
    256-sequence decode step of Qwen3-30B-A3B takes: both kernels' PTX."""
    from nanovllm.kernels.fused_moe import choose_tiles, down_kernel, gate_up_kernel, launch_blocks
    tiles = choose_tiles(256 * 8, 128, fp8=True)
    blocks = launch_blocks(tiles, 128)
    options = dict(num_warps=blocks.pop("num_warps"), num_stages=blocks.pop("num_stages"))
    common = dict(sorted_pairs_ptr="*i32", ends_ptr="*i32", num_pairs="i32", scale_ptr="*fp32", stride_se="i32",
                  stride_sn="i32", stride_sk="i32")
    gate_up = compile_for_hopper(gate_up_kernel, dict(
        x_ptr="*fp8e4nv", w13_ptr="*fp8e4nv", out_ptr="*bf16", x_scale_ptr="*fp32", X_GROUPS="i32", **common),
        dict(TOP_K=8, HIDDEN=2048, INTERMEDIATE=768, SCALES=scales, **blocks), **options)
    down = compile_for_hopper(down_kernel, dict(
        h_ptr="*fp8e4nv", w2_ptr="*fp8e4nv", weights_ptr="*fp32", out_ptr="*bf16", h_scale_ptr="*fp32",
        H_GROUPS="i32", **common), dict(HIDDEN=2048, INTERMEDIATE=768, SCALES=scales, **blocks), **options)
    return gate_up.asm["ptx"] + down.asm["ptx"]


CASES = {f"prepare_qkv-{dtype}-{'fp8' if fp8 else 'own'}": (prepare_qkv, dtype, fp8)
         for dtype in ("bf16", "fp16") for fp8 in (True, False)}
CASES |= {f"decode_attention-{'fp8' if fp8 else 'own'}": (decode_attention, "bf16", 128, fp8) for fp8 in (True, False)}
CASES |= {f"decode_attention-{dtype}-256": (decode_attention, dtype, 256, False) for dtype in ("bf16", "fp32")}
CASES |= {f"paged_prompt_attention-{'fp8' if fp8 else 'own'}": (paged_prompt_attention, 256, fp8)
          for fp8 in (True, False)}
CASES["paged_prompt_attention-fp8-blocks-of-16"] = (paged_prompt_attention, 16, True)
CASES |= {f"one_row_linear-fp8{'-silu' if silu else ''}": (one_row_linear, silu, True) for silu in (False, True)}
CASES["route"] = (route, False)
CASES |= {f"fused_moe-fp8-{name}": (fused_moe, scales, True) for name, scales in (("rows", 1), ("blocks", 2))}


def check(name: str, ptx: str | tuple[str, int], fp8: bool) -> str | None:
    """What is wrong with a case's PTX: an FP8 store without e4m3 casts, FP8 attention reading its 8-bit tiles
    from shared memory a byte at a time (no ldmatrix), as values laid out by slot were, the one-row kernel's
    pipeline (or the routing kernel) loading more than its first block of weights (or anything) before the wait
    (`loads_before_the_wait`), or the grouped MoE kernels summing FP8 experts off FP8 tensor cores."""
    if name.startswith("prepare_qkv"):
        return None if ("e4m3x2" in ptx) == fp8 else "no e4m3 cast in the PTX"
    if name.startswith(("one_row_linear", "route")):
        return loads_before_the_wait(*ptx)
    if name.startswith("fused_moe"):
        return None if re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx) else "no FP8 wgmma in the PTX"
    return "byte loads from shared memory" if fp8 and "ld.shared.b8" in ptx else None


def loads_before_the_wait(ptx: str, first_block_copies: int) -> str | None:
    """What is wrong with what a kernel does before its first wait for the kernel before (griddepcontrol.wait): the
    one-row kernel's pipeline must copy the first block of weights there and nothing else, and wait before its loop;
    a kernel that copies nothing ahead (first_block_copies 0, the routing kernel) must wait before any load or
    store."""
    first_wait, loop = ptx.find("griddepcontrol.wait"), ptx.find("Loop Header")
    if first_wait < 0 or (first_block_copies and not first_wait < loop):
        return "no wait for the kernel before in the pipeline's prologue"
    copies = ptx[:first_wait].count("cp.async.cg")
    loads = sum(ptx[:first_wait].count(op) for op in ("ld.global", "cp.async.ca", "st.global", "atom.global"))
    if copies != first_block_copies or loads:
        return f"{copies} copies and {loads} other loads before the wait, not the first block's {first_block_copies}"
    return None


def main():
    results = {}
    for name, (build, *args) in CASES.items():
        try:
            results[name] = check(name, build(*args), fp8=args[-1])
        except Exception as error:  # the compiler's, whatever its kind
            results[name] = f"{type(error).__name__}: {error}"[:2000]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
