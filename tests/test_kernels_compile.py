"""The FP8 KV cache's kernel variants compiled for an H200 (sm_90) on a CPU, with Triton's own compiler and ptxas:
the interpreter runs what the compiler may refuse (a value whose type a run-time branch changes), and the engine
would fail at start-up there. fp8 -> e4m3 conversion and the scaled loads must lower for Hopper."""
import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(fn, types: dict, constexprs: dict) -> str:
    """The kernel's PTX for sm_90: every argument's type, or its constexpr value."""
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=HOPPER).asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("fp8_kv", [True, False])
def test_prepare_qkv_compiles_for_hopper(dtype, fp8_kv):
    from nanovllm.kernels.prepare_qkv import prepare_qkv_kernel
    cache = "*fp8e4nv" if fp8_kv else f"*{dtype}"
    types = dict(qkv_ptr=f"*{dtype}", qkv_stride="i64", positions_ptr="*i64", q_weight_ptr=f"*{dtype}",
                 k_weight_ptr=f"*{dtype}", eps="fp32", cos_sin_ptr="*fp32", q_ptr=f"*{dtype}", k_ptr=f"*{dtype}",
                 v_ptr=f"*{dtype}", k_cache_ptr=cache, v_cache_ptr=cache, slot_mapping_ptr="*i32",
                 k_scales_ptr="*fp32", v_scales_ptr="*fp32")
    ptx = compile_for_hopper(prepare_qkv_kernel, types, dict(
        NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, QK_ROWS=32, V_ROWS=8, KEEP_KV=True, STORE=True, QK_NORM=True,
        FP8_KV=fp8_kv, FP8_MAX=448.0, MIN_SCALE=1e-12, USE_PDL=False))
    assert ("e4m3x2" in ptx) == fp8_kv  # the cast to e4m3 (cvt.rn.satfinite.e4m3x2.f32)


@pytest.mark.parametrize("fp8_kv", [True, False])
def test_decode_attention_compiles_for_hopper(fp8_kv):
    from nanovllm.kernels.decode_attention import split_kernel
    cache = "*fp8e4nv" if fp8_kv else "*bf16"
    types = dict(q_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, k_scales_ptr="*fp32", v_scales_ptr="*fp32",
                 block_tables_ptr="*i32", block_tables_stride="i32", context_lens_ptr="*i32",
                 partial_out_ptr="*fp32", partial_max_ptr="*fp32", partial_sum_ptr="*fp32", arrivals_ptr="*i32",
                 out_ptr="*bf16", scale="fp32", num_splits="i32")
    compile_for_hopper(split_kernel, types, dict(
        NUM_KV_HEADS=8, GROUP=2, GROUP_ROWS=16, HEAD_DIM=128, BLOCK_SIZE=256, SPLIT_KEYS=1024, TILE_KEYS=128,
        MAX_SPLITS=8, FP8_KV=fp8_kv, USE_PDL=False))


@pytest.mark.parametrize("fp8_kv", [True, False])
def test_paged_prompt_attention_compiles_for_hopper(fp8_kv):
    from nanovllm.kernels.prefill_attention import prefill_kernel
    cache = "*fp8e4nv" if fp8_kv else "*bf16"
    strides = {name: "i32" for name in ("block_tables_stride", "q_token_stride", "q_head_stride", "k_token_stride",
                                        "k_head_stride", "out_token_stride", "out_head_stride")}
    types = dict(q_ptr="*bf16", k_ptr=cache, v_ptr=cache, k_scales_ptr="*fp32", v_scales_ptr="*fp32", out_ptr="*bf16",
                 cu_seqlens_q_ptr="*i32", cu_seqlens_k_ptr="*i32", block_tables_ptr="*i32", scale="fp32", **strides)
    compile_for_hopper(prefill_kernel, types, dict(
        NUM_KV_HEADS=8, GROUP=2, HEAD_DIM=128, PADDED_DIM=128, BLOCK_M=64, BLOCK_N=64, PAGED=True, BLOCK_SIZE=256,
        FP8_KV=fp8_kv, PRECISION="tf32"))
