"""FP8 weights kept as FP8, as CUDA keeps them for its kernels, loaded here on a CPU: each tensor-parallel rank
holds e4m3 weights and scales whose product is exactly its share of the weights the tests' own packer
dequantizes (`test_fp8_checkpoints.py`'s, from each format's published layout); quantization="fp8" gives the
weights a per-row rounding done here gives; a split that cuts a 128x128 block of scales is refused by name, from
the config before any process starts and by the loader; the modules a checkpoint leaves unquantized keep its
weights (matched as compressed-tensors' own package matches its ignore list); the layers' CPU matmul on kept
weights is F.linear on the dequantized ones. The kernels that read them are tested under Triton's interpreter
(test_kernels_interpreted.py) and on the GPU (test_gpu_fp8.py)."""
import os
import re

import pytest
import torch
from safetensors.torch import load_file
from test_fp8_checkpoints import PER_TENSOR_FP8, QWEN_FP8, compressed_tensors_config, pack_channels, quantized_pair
from transformers import AutoConfig

from nanovllm.layers.linear import LinearBase, dequantized_linear
from nanovllm.layers.moe import StackedExperts
from nanovllm.models.registry import build_model, split_sizes
from nanovllm.utils.checkpoint import MODEL_TYPES, REAL_DIMENSIONS, TINY, write_random_checkpoint
from nanovllm.utils.fp8_weights import FP8, dequantize, fp8_weights, get_fp8_scheme, scheme_for
from nanovllm.utils.loader import load_model
from nanovllm.utils.parallel import tensor_parallel
from nanovllm.utils.quantization import check_block_splits, unquantized_modules

from conftest import TINY_MOE

# Every rank's share of q, k, v, o, gate, up and down a whole number of 128-blocks at two ranks.
DIMS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512,
            num_hidden_layers=2)
MOE = dict(DIMS, **{**TINY_MOE, "num_hidden_layers": 2, "mlp_only_layers": [], "moe_intermediate_size": 256})


def kept_model(path: str, rank: int, tp_size: int, quantization: str | None = None):
    """The model as a CUDA rank builds and loads it, on the CPU."""
    config = AutoConfig.from_pretrained(path)
    quantization_config = getattr(config, "quantization_config", None)
    scheme = scheme_for(quantization or (quantization_config or {}).get("quant_method"), quantization_config)
    with torch.device("cpu"), tensor_parallel(rank, tp_size), \
            fp8_weights(scheme, unquantized_modules(quantization_config)):
        model = build_model(config)
    load_model(model, path, config, quantization)
    return model


def expected_shares(weights: dict, rank: int, tp_size: int) -> dict:
    """Each kept parameter's share of rank `rank`, from the full weights by checkpoint name."""
    def rows(name):
        return weights[name].chunk(tp_size, 0)[rank]

    def cols(name):
        return weights[name].chunk(tp_size, 1)[rank]
    shares = {}
    for name in weights:
        prefix, _, projection = name.removesuffix(".weight").rpartition(".")
        if projection == "q_proj":
            shares[f"{prefix}.qkv_proj.weight"] = torch.cat([rows(f"{prefix}.{p}_proj.weight") for p in "qkv"])
        elif projection in ("o_proj", "down_proj") and ".experts." not in name:
            shares[name] = cols(name)
        elif projection == "gate_proj" and ".experts." not in name:
            shares[f"{prefix}.gate_up_proj.weight"] = torch.cat([rows(name), rows(f"{prefix}.up_proj.weight")])
        elif projection == "gate_proj":
            experts, _, expert = prefix.rpartition(".")
            shares.setdefault(f"{experts}.w13", {})[int(expert)] = torch.cat([rows(name),
                                                                              rows(f"{prefix}.up_proj.weight")])
            shares.setdefault(f"{experts}.w2", {})[int(expert)] = cols(f"{prefix}.down_proj.weight")
    return shares


def kept_weights(model) -> dict:
    """Each FP8 parameter dequantized, by its name (stacked experts expert by expert)."""
    kept = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            assert module.weight.dtype == FP8
            kept[f"{name}.weight"] = dequantize(module.weight, module.weight_scale)
        elif isinstance(module, StackedExperts):
            for weight in ("w13", "w2"):
                stacked = dequantize(getattr(module, weight), getattr(module, f"{weight}_scale"))
                kept[f"{name}.{weight}"] = dict(enumerate(stacked))
    return kept


def assert_same(kept: dict, expected: dict):
    assert kept.keys() == expected.keys()
    for name, want in expected.items():
        pairs = [(kept[name][e], want[e]) for e in want] if isinstance(want, dict) else [(kept[name], want)]
        for got, wanted in pairs:
            assert torch.equal(got, wanted.float()), name


FORMATS = {"block": QWEN_FP8, "fp8-tensor": PER_TENSOR_FP8, "channel": compressed_tensors_config("channel"),
           "tensor": compressed_tensors_config("tensor", dynamic=False)}


@pytest.mark.parametrize("dims", [DIMS, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("quantization_format", list(FORMATS))
def test_each_rank_keeps_its_share_of_the_dequantized_weights(tmp_path, quantization_format, tp_size, dims):
    source = write_random_checkpoint(str(tmp_path / "source"), torch.bfloat16, initializer_range=0.1, seed=5, **dims)
    quantized, reference = quantized_pair(source, str(tmp_path), FORMATS[quantization_format])
    weights = load_file(os.path.join(reference, "model.safetensors"))
    for rank in range(tp_size):
        assert_same(kept_weights(kept_model(quantized, rank, tp_size)), expected_shares(weights, rank, tp_size))


@pytest.mark.parametrize("dims", [DIMS, MOE], ids=["dense", "moe"])
def test_online_fp8_keeps_each_row_rounded_as_the_reference_rounds_it(tmp_path, dims):
    source = write_random_checkpoint(str(tmp_path), torch.bfloat16, initializer_range=0.1, seed=6, **dims)
    weights = {name: pack_channels(tensor.float(), "channel") for name, tensor in
               load_file(os.path.join(source, "model.safetensors")).items() if name.endswith("proj.weight")}
    weights = {name: packed.float() * scale for name, (packed, scale) in weights.items()}
    for rank in range(2):
        assert_same(kept_weights(kept_model(source, rank, 2, "fp8")), expected_shares(weights, rank, 2))


def published_config(dims: str):
    fields = {**TINY, **REAL_DIMENSIONS[dims]}
    architecture = fields.pop("architecture", "Qwen3ForCausalLM")
    return AutoConfig.for_model(MODEL_TYPES[architecture], **fields, architectures=[architecture])


@pytest.mark.parametrize("dims, tp_size, refused", [
    ("qwen3-8b-fp8", 1, None), ("qwen3-8b-fp8", 8, None), ("qwen3-30b-a3b-fp8", 2, None),
    # Qwen3-30B-A3B's 768 expert rows are 6 blocks: 192 a rank at 4
    ("qwen3-30b-a3b-fp8", 4, "moe_intermediate_size = 768 gives a rank 192 rows, not whole 128x128 blocks of FP8 "
                             "scales; tensor_parallel_size=1 or 2 splits every size so"),
    ("qwen3-0.6b", 8, None),
    ("qwen3-0.6b", 16, "num_key_value_heads x head_dim = 1024 gives a rank 64 rows, not whole 128x128 blocks of FP8 "
                       "scales; tensor_parallel_size=1 or 2 or 4 or 8 splits every size so"),
])
def test_a_split_into_parts_of_blocks_is_checked_from_the_config(dims, tp_size, refused):
    """On CUDA, before any process starts (`config_builder`): each rank's share of q, k/v, gate/up and the experts'
    rows whole 128-blocks of scales, as the loader's check below needs them."""
    sizes = split_sizes(published_config(dims))
    if refused is None:
        check_block_splits(sizes, tp_size)
    else:
        with pytest.raises(ValueError, match=re.escape(f"block FP8 at tensor_parallel_size={tp_size}: {refused}")):
            check_block_splits(sizes, tp_size)


def test_a_split_that_cuts_a_block_of_scales_is_refused_by_name(tmp_path):
    dims = dict(DIMS, intermediate_size=384)  # 192 rows of gate, of up and columns of down a rank
    source = write_random_checkpoint(str(tmp_path / "source"), torch.bfloat16, initializer_range=0.1, **dims)
    quantized, _ = quantized_pair(source, str(tmp_path), QWEN_FP8)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.(gate|down)_proj.weight_scale_inv': "
                                         r"\w+ParallelLinear of rank 1 of 2: (rows|columns) 192-384 of 384 cut a "
                                         r"128x128 block of its FP8 scales"):
        kept_model(quantized, 1, 2)


EXPERTS = [f"model.layers.1.mlp.experts.{e}.{p}_proj" for e in range(MOE["num_experts"]) for p in ("gate", "up",
                                                                                                   "down")]


@pytest.mark.parametrize("dims, quantization_config, unquantized", [
    (DIMS, {**QWEN_FP8, "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate",
                                                   "model.layers.1.mlp.down_proj"]},
     ["model.layers.1.mlp.down_proj"]),
    (DIMS, {**compressed_tensors_config("channel"), "ignore": ["lm_head", r"re:.*layers\.0\.self_attn\..*"]},
     [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"]),
    (MOE, {**QWEN_FP8, "modules_to_not_convert": ["model.layers.0.mlp.gate", "model.layers.1.mlp.experts"]}, EXPERTS),
], ids=["qwen-down", "compressed-tensors-attention", "qwen-experts"])
def test_the_modules_a_checkpoint_leaves_unquantized_keep_its_weights(tmp_path, dims, quantization_config,
                                                                       unquantized):
    """Qwen's modules_to_not_convert and compressed-tensors' ignore: those linears keep the checkpoint's bf16 weights
    bit for bit, the others are e4m3 (a plain name matches at dots only: "mlp.gate", a MoE router, is not
    "mlp.gate_proj")."""
    source = write_random_checkpoint(str(tmp_path / "source"), torch.bfloat16, initializer_range=0.1, seed=7, **dims)
    weights = tuple(f"{module}.weight" for module in unquantized)
    quantized, _ = quantized_pair(source, str(tmp_path), quantization_config, keep=weights)
    stored = load_file(os.path.join(quantized, "model.safetensors"))
    expected = expected_shares({name: stored[name] for name in weights}, 0, 1)
    model = kept_model(quantized, 0, 1)
    params = dict(model.named_parameters())
    for name, want in expected.items():
        pairs = [(params[name][e], want[e]) for e in want] if isinstance(want, dict) else [(params[name], want)]
        assert all(got.dtype != FP8 and torch.equal(got, wanted.to(got.dtype)) for got, wanted in pairs), name
    quantized_weights = {name for name, param in params.items() if param.dtype == FP8}
    assert quantized_weights and not quantized_weights & expected.keys()
    linears = {name for name in params if name.endswith(("proj.weight", "w13", "w2"))}
    assert quantized_weights | expected.keys() == linears
    assert {f"{name.removesuffix('.weight')}.weight_scale" if name.endswith("weight") else f"{name}_scale"
            for name in quantized_weights} == {name for name in params if name.endswith("scale")}


def test_an_fp8_configs_unquantized_names_match_at_dots():
    config = {**QWEN_FP8, "modules_to_not_convert": ["layers.1", "mlp.gate"]}
    expected = {"model.layers.1.mlp.down_proj": True, "model.layers.10.mlp.down_proj": False,
                "model.sublayers.1.mlp.down_proj": False, "model.layers.2.mlp.gate": True,
                "model.layers.2.mlp.gate_proj": False}
    with fp8_weights("block", unquantized_modules(config)):
        assert {name: get_fp8_scheme([name]) is None for name in expected} == expected


def test_an_unquantized_module_the_config_does_not_name_is_refused_by_name(tmp_path):
    """Rather than rounded to e4m3 without a word."""
    source = write_random_checkpoint(str(tmp_path / "source"), torch.bfloat16, initializer_range=0.1, **DIMS)
    quantized, _ = quantized_pair(source, str(tmp_path), QWEN_FP8, keep=("model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.down_proj.weight' is torch.bfloat16, not FP8, "
                                         r"and the quantization_config's unquantized modules .* do not name its "
                                         r"module \(the engine's 'model.layers.1.mlp.down_proj'\)"):
        kept_model(quantized, 0, 1)


def test_an_fp8_module_the_config_names_unquantized_is_dequantized(tmp_path):
    """An "fp8" config's name covers the modules under it, which this checkpoint stores in FP8 all the same: their
    layers hold them dequantized, as the packer dequantizes them."""
    source = write_random_checkpoint(str(tmp_path / "source"), torch.bfloat16, initializer_range=0.1, **DIMS)
    quantized, reference = quantized_pair(source, str(tmp_path), {**QWEN_FP8, "modules_to_not_convert": [
        "model.layers.1.mlp"]})
    params = dict(kept_model(quantized, 0, 1).named_parameters())
    expected = expected_shares(load_file(os.path.join(reference, "model.safetensors")), 0, 1)
    for name in ("model.layers.1.mlp.gate_up_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert params[name].dtype != FP8 and torch.equal(params[name], expected[name].to(params[name].dtype))
    assert params["model.layers.0.mlp.down_proj.weight"].dtype == FP8


def test_compressed_tensors_ignore_leaves_the_modules_its_package_matches():
    """The names and patterns of an ignore list against compressed-tensors' own matching of them."""
    from compressed_tensors.utils.match import match_name
    ignore = ["lm_head", "model.layers.1.mlp", "model.layers.0.self_attn.o_proj", r"re:.*layers\.2\..*down_proj$",
              r"re:model\.layers\.1[0-9]\.", r"re:layers\.3\."]
    names = [f"model.layers.{layer}.{module}" for layer in (0, 1, 2, 3, 10, 12)
             for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
    config = {"quant_method": "compressed-tensors", "ignore": ignore}
    with fp8_weights("channel", unquantized_modules(config)):
        left = [name for name in names if get_fp8_scheme([name]) is None]
    assert left == [name for name in names if any(match_name(name, target) for target in ignore)]
    assert len(left) == 10  # layer 0's o, layer 2's down, layers 10's and 12's four each


def test_compressed_tensors_ignore_names_whole_modules(tmp_path):
    """compressed-tensors matches a plain name in ignore to a whole module name: "model.layers.1.mlp" leaves no
    linear unquantized (its projections are stored in FP8)."""
    source = write_random_checkpoint(str(tmp_path / "source"), torch.bfloat16, initializer_range=0.1, **DIMS)
    config = {**compressed_tensors_config("channel"), "ignore": ["lm_head", "model.layers.1.mlp"]}
    quantized, _ = quantized_pair(source, str(tmp_path), config)
    model = kept_model(quantized, 0, 1)
    assert all(module.fp8_scheme == "channel" for module in model.modules() if isinstance(module, LinearBase))


def test_a_fused_layer_the_checkpoint_leaves_part_unquantized_is_refused_by_name(tmp_path):
    source = write_random_checkpoint(str(tmp_path / "source"), torch.bfloat16, initializer_range=0.1, **DIMS)
    config = {**QWEN_FP8, "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]}
    quantized, _ = quantized_pair(source, str(tmp_path), config, keep=("model.layers.0.self_attn.q_proj.weight",))
    with pytest.raises(ValueError, match=r"the checkpoint leaves model.layers.0.self_attn.q_proj unquantized but not "
                                         r"model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj"):
        kept_model(quantized, 0, 1)


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_the_cpu_matmul_on_kept_weights_is_f_linear_on_the_dequantized_ones(scheme):
    torch.manual_seed(0)
    weight = torch.randn(300, 200)
    packed, scale = pack_channels(weight, "channel") if scheme == "channel" else quantized_blocks(weight)
    x, bias = torch.randn(5, 200), torch.randn(300)
    reference = x.double() @ (packed.double() * scale_rows(scale, weight.shape).double()).T + bias.double()
    assert torch.allclose(dequantized_linear(x, packed, scale, bias).double(), reference, atol=1e-4)


def quantized_blocks(weight):
    from test_fp8_checkpoints import pack_blocks
    return pack_blocks(weight)


def scale_rows(scale: torch.Tensor, shape) -> torch.Tensor:
    """A scale in either layout, as one value per weight element (the test's own expansion)."""
    if scale.shape == (shape[0], 1):
        return scale.expand(shape)
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]
