"""The GPU kernels: Triton, and flash-attn's varlen attention where it is installed and serves. Each serves a
layer of `nanovllm/layers/`, whose plain PyTorch function beside it is the reference its tests compare against
and what a CPU runs.

Chosen when the model is built: a layer built on CUDA (`on_cuda()`: `ModelRunner` builds the model under
`torch.device(...)`) imports its kernel there, so `import nanovllm` needs neither Triton nor flash-attn.
Some choose again when called, by the shape of what they are given:

- `elementwise.residual_rms_norm` serves `layernorm.RMSNorm`, with or without the residual add; before a
  per-channel FP8 matmul (`quantize_rows`) it also rounds more than one row to e4m3 per token (`FP8Rows`).
- `one_row_linear.linear` serves `linear.*ParallelLinear`: one row (`takes_one_row`, a decode step of one
  sequence) goes to the one-row kernel, more to cuBLAS.
- `one_row_linear.silu_and_mul_linear` serves the MLP's down projection (`RowParallelLinear(takes_gate_up=True)`):
  one row in one kernel that takes the activation as it reads the row; more through `elementwise.silu_and_mul`,
  then cuBLAS.
- `fp8_linear.linear` and `.silu_and_mul_linear` serve the same layers where their weights are FP8 (built under
  `utils/fp8_weights.fp8_weights`): one row to the one-row kernel, which reads e4m3 rows and their scales; more
  rows quantized by `quantize_groups` (e4m3, a scale per row and 128 columns for block scales, per row for row
  scales) unless the norm did, then `fp8_matmul` on FP8 tensor cores, or on Hopper (`takes_torch_matmul`) above
  `TORCH_MATMUL_ROWS` / `TORCH_ROWWISE_ROWS` rows torch's FP8 matmul (cuBLAS, block-scaled / row-wise; not where
  `fp8_tiles.keeps_decode_tiles`). `fp8_tiles` chooses `fp8_matmul`'s tiles by rows, and splits the sums of an
  output of few tiles over several programs a tile (`choose_split_k`).
- `prepare_qkv.prepare_qkv` replaces `models/decoder.DecoderAttention`'s steps from the split into heads to the
  cache write, in one kernel (through `attention.Attention.prepare_qkv_fused`); it keeps k and v for a prompt's
  own attention, stores them in the cache, or both.
- `flash_attn.cuda_attention` serves `attention.Attention`: prompt chunks through `prefill_attention` (Triton, tiles
  by case: `tile_config`), or flash-attn's varlen kernel where `flash_attn_serves` (installed, on a GPU before
  Hopper), over the step's own keys or, where earlier keys are cached, through the block table; decodes through
  `decode_attention`, whose splits are one tile up to `SMALL_BATCH` sequences, 512, 1,024 or 2,048 keys above
  (`split_and_tile_keys`), the sequences' programs started longest first (`Context.seq_order`). Both read an FP8
  cache's tiles through `fp8_kv_tile` (the layout: `utils/fp8_kv.py`).
- `moe_route.router_logits`, `.route` and `fused_moe.fused_experts` serve `moe.SparseMoeBlock`: the router's
  logits for one token in the one-row kernel, else cuBLAS's bf16 matmul (float32 out either way); up to
  `FEW_PAIRS` (token, expert) pairs the experts run in `fused_moe_few`'s two kernels, else grouped by expert
  (`moe_align`: one program up to `ALIGN_BLOCK` pairs, three kernels above) with tiles by pairs per expert
  (`choose_tiles`). FP8 experts: the same kernels, the few-token ones reading e4m3 rows in tiles of their own
  (`fused_moe_few.FP8_TILES`), the grouped ones on activations quantized by `fp8_linear.quantize_groups`, with
  tiles of their own (`FP8_TILES_BY_PAIRS_PER_EXPERT`: their products transposed at decode batches).
- `sampling.process`, `.race` and `.record` serve `sampler.Sampler`; each row reads what its slot's flags name.

Programmatic dependent launch (Hopper and later; `pdl.py`, `NANOVLLM_PDL=0` turns it off): the kernels of `elementwise`,
`one_row_linear`, `prepare_qkv`, `decode_attention`, `fused_moe_few` and `moe_route.route` start while the kernel before
them still runs. The rule each of them keeps: nothing it reads that an earlier kernel writes (activations, the KV cache,
a step's inputs), and nothing it writes that an earlier kernel reads, before `pdl.wait_for_previous` (or, for the loads
in a loop Triton pipelines, before the `pdl.after_wait` that masks them); only weights and constants are loaded before
it. A kernel that waits has had every earlier kernel finish, since the one before it waited in turn. cuBLAS, flash-attn,
the grouped MoE kernels and the sampler's launch as usual, after the kernel before has finished.

The measurements behind each choice are in docs/benchmarks.md.
"""
import torch


def on_cuda() -> bool:
    """Whether the layers being built run on CUDA, and so take their kernels from this package."""
    return torch.get_default_device().type == "cuda"
