"""FP8 checkpoints on a CPU, the reference path: tiny checkpoints quantized here by a packer written from each
format's published layout (Qwen's block FP8: float8_e4m3fn weights and a float32 weight_scale_inv per 128x128
block; vLLM's older "fp8": a scale per tensor; compressed-tensors FP8: a weight_scale per output channel or per
tensor), loaded by the engine, on one rank and on two, whose greedy tokens are transformers' float32 tokens on the
same weights dequantized here, block by block; online quantization="fp8" near the unquantized model; every format
this engine does not serve refused by name."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import write_random_checkpoint

from conftest import TINY_MOE, assert_greedy_matches_transformers, mixed_prompts, reference_logits, smollm2_file

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value (OCP FP8 spec)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Two blocks of 128 and a partial third along each side: q/o [192, 192], k/v [96, 192], gate/up [320, 192].
DIMS = dict(hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=48, intermediate_size=320)
ENGINE_ARGS = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256, max_num_seqs=16)
QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# vLLM's older "fp8" checkpoints (AutoFP8's): a float32 weight_scale and input_scale per tensor, no block size.
PER_TENSOR_FP8 = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"],
                  "kv_cache_scheme": "static"}  # amd's "-FP8-KV": the KV cache's scales, read past


def compressed_tensors_config(strategy: str, dynamic: bool = True) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token" if dynamic else "tensor",
                                      "symmetric": True, "dynamic": dynamic}}}}


def pack_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's layout: per 128x128 block, scale = amax / 448, stored as weight_scale_inv; weight / scale in e4m3."""
    rows, cols = -(-weight.shape[0] // 128), -(-weight.shape[1] // 128)
    scales = torch.empty(rows, cols)
    packed = torch.empty(weight.shape, dtype=FP8)
    for i in range(rows):
        for j in range(cols):
            block = weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scales[i, j] = block.abs().max() / E4M3_MAX
            packed[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scales[i, j]).to(FP8)
    return packed, scales


def unpack_blocks(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    weight = torch.empty(packed.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            weight[rows, cols] = packed[rows, cols].float() * scales[i, j]
    return weight


def pack_channels(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' layout: weight_scale [out, 1] per channel, [1] per tensor."""
    amax = weight.abs().amax(dim=1, keepdim=True) if strategy == "channel" else weight.abs().max().reshape(1)
    scale = amax / E4M3_MAX
    return (weight / scale).to(FP8), scale


def quantized_pair(source: str, folder: str, quantization_config: dict, keep: tuple = ()) -> tuple[str, str]:
    """`folder`/fp8: `source` quantized as `quantization_config` says (but the weights named in `keep`);
    `folder`/reference: those weights dequantized here, in float32, for transformers."""
    quantized, reference = os.path.join(folder, "fp8"), os.path.join(folder, "reference")
    for path in (quantized, reference):
        shutil.copytree(source, path)
        os.remove(os.path.join(path, "model.safetensors"))
    tensors, stored, dequantized = load_file(os.path.join(source, "model.safetensors")), {}, {}
    for name, tensor in tensors.items():
        if not name.endswith(tuple(f"{linear}.weight" for linear in LINEARS)) or name in keep:
            stored[name] = dequantized[name] = tensor
        elif quantization_config.get("weight_block_size"):
            stored[name], stored[name + "_scale_inv"] = pack_blocks(tensor.float())
            dequantized[name] = unpack_blocks(stored[name], stored[name + "_scale_inv"])
        elif quantization_config["quant_method"] == "fp8":  # vLLM's older format: a scalar scale, static inputs
            packed, scale = pack_channels(tensor.float(), "tensor")
            stored[name], stored[name + "_scale"] = packed, scale.reshape(())
            stored[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
            dequantized[name] = packed.float() * scale
        else:
            strategy = quantization_config["config_groups"]["group_0"]["weights"]["strategy"]
            stored[name], stored[name + "_scale"] = pack_channels(tensor.float(), strategy)
            dequantized[name] = stored[name].float() * stored[name + "_scale"]
            if not quantization_config["config_groups"]["group_0"]["input_activations"]["dynamic"]:
                stored[name.replace(".weight", ".input_scale")] = torch.tensor([0.05])
    if quantization_config.get("kv_cache_scheme"):
        for attention in {name.rpartition(".k_proj")[0] for name in stored if ".k_proj." in name}:
            stored[f"{attention}.k_scale"], stored[f"{attention}.v_scale"] = torch.tensor(0.1), torch.tensor(0.2)
    save_file(stored, os.path.join(quantized, "model.safetensors"))
    save_file(dequantized, os.path.join(reference, "model.safetensors"))
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(quantized, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f)
    return quantized, reference


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("fp8_source")), torch.bfloat16, initializer_range=0.1,
                                   seed=3, **DIMS)


def test_the_packer_round_trips_and_one_block_by_hand():
    weight = torch.randn(300, 200)
    packed, scales = pack_blocks(weight)
    assert packed.dtype == FP8 and scales.shape == (3, 2)
    assert (unpack_blocks(packed, scales) - weight).abs().max() <= weight.abs().max() / 16  # e4m3: 3 mantissa bits
    # One block worked by hand: amax 448 gives scale 1; 1.0625 is not e4m3 (it rounds to 1.0), 0.5 and -448 are.
    block = torch.tensor([[448.0, 1.0625], [0.5, -448.0]])
    packed, scales = pack_blocks(block)
    assert scales.tolist() == [[1.0]] and packed.float().tolist() == [[448.0, 1.0], [0.5, -448.0]]


@pytest.mark.parametrize("quantization_config", [
    QWEN_FP8, PER_TENSOR_FP8, compressed_tensors_config("channel"), compressed_tensors_config("tensor", dynamic=False),
], ids=["qwen-block", "fp8-tensor-static", "compressed-tensors-channel", "compressed-tensors-tensor-static"])
def test_an_fp8_checkpoint_gives_transformers_tokens_on_its_dequantized_weights(
        bf16_source, tmp_path, hf_model_cache, quantization_config):
    quantized, reference = quantized_pair(bf16_source, str(tmp_path), quantization_config)
    prompts = mixed_prompts()
    args = dict(ENGINE_ARGS, max_num_batched_tokens=64)  # chunked prompts; the mixed prompts share prefixes
    with LLM(quantized, **args) as llm:
        completions = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
        assert llm.config.quantization == quantization_config["quant_method"]
    assert_greedy_matches_transformers(hf_model_cache, reference, prompts, completions)


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8"])  # per channel, dynamic; per tensor, static
def test_compressed_tensors_own_checkpoint_gives_tokens_of_its_own_decompression(bf16_source, tmp_path,
                                                                                hf_model_cache, preset):
    """A checkpoint written by compressed-tensors' ModelCompressor (scales from each weight's amax here, as a
    calibration would set them) and the reference its decompress_model gives: the format as its own package
    writes and reads it, not as these tests' packer does."""
    quantized, reference = compressed_tensors_pair(bf16_source, str(tmp_path), preset)
    prompts = mixed_prompts()
    with LLM(quantized, **ENGINE_ARGS) as llm:
        completions = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
        assert llm.config.quantization == "compressed-tensors"
    assert_greedy_matches_transformers(hf_model_cache, reference, prompts, completions)


def compressed_tensors_pair(source: str, folder: str, preset: str) -> tuple[str, str]:
    """`folder`/fp8: `source` compressed by compressed-tensors in `preset`'s scheme; `folder`/reference: the
    weights compressed-tensors decompresses from it, in float32."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from transformers import AutoModelForCausalLM
    quantized, reference = os.path.join(folder, "fp8"), os.path.join(folder, "reference")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(
        preset, ["Linear"])}, ignore=["lm_head"], format="float-quantized"))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                amax = module.weight.float().abs().amax(dim=1, keepdim=True)
                amax = amax if module.weight_scale.numel() > 1 else amax.max().reshape(module.weight_scale.shape)
                module.weight_scale.copy_(amax / E4M3_MAX)
            if hasattr(module, "input_scale"):
                module.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(quantized)
    compressor.update_config(quantized)
    shutil.copytree(source, reference, ignore=shutil.ignore_patterns("model.safetensors"))
    for module in model.modules():  # float32 scales: the products exact, not rounded to bf16
        if hasattr(module, "weight_scale"):
            module.weight_scale.data = module.weight_scale.data.float()
    compressor.decompress_model(model)
    save_file({name: tensor.float().contiguous() for name, tensor in model.state_dict().items()
               if not name.endswith(("_scale", "_zero_point"))}, os.path.join(reference, "model.safetensors"))
    for name in os.listdir(source):
        if name not in os.listdir(quantized):
            shutil.copy(os.path.join(source, name), quantized)
    return quantized, reference


def test_an_fp8_moe_checkpoint_gives_transformers_tokens(tmp_path, hf_model_cache):
    """Qwen3-MoE with every expert's projections in block FP8 (the router stays bf16, as Qwen's files keep it)."""
    source = write_random_checkpoint(str(tmp_path / "moe"), torch.bfloat16, initializer_range=0.1, seed=6,
                                     **{**TINY_MOE, "moe_intermediate_size": 160})
    quantized, reference = quantized_pair(source, str(tmp_path), QWEN_FP8)
    assert any(name.endswith("experts.7.down_proj.weight_scale_inv")
               for name in load_file(os.path.join(quantized, "model.safetensors")))
    prompts = mixed_prompts()[:6]
    with LLM(quantized, **ENGINE_ARGS) as llm:
        completions = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    assert_greedy_matches_transformers(hf_model_cache, reference, prompts, completions)


def test_a_linear_the_checkpoint_leaves_unquantized_stays_as_it_is(bf16_source, tmp_path, hf_model_cache):
    """Qwen's modules_to_not_convert: a bf16 projection among FP8 ones is read as it is, not rounded to FP8."""
    kept = "model.layers.1.mlp.down_proj.weight"
    config = {**QWEN_FP8, "modules_to_not_convert": ["model.layers.1.mlp.down_proj"]}
    quantized, reference = quantized_pair(bf16_source, str(tmp_path), config, keep=(kept,))
    assert load_file(os.path.join(quantized, "model.safetensors"))[kept].dtype == torch.bfloat16
    prompt = mixed_prompts()[5]
    expected = reference_logits(hf_model_cache, reference, prompt[:1], prompt[1:]).log_softmax(-1)
    expected = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    for quantization in (None, "fp8"):
        with LLM(quantized, **ENGINE_ARGS, quantization=quantization) as llm:
            output = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        got = torch.tensor([p[t].logprob for p, t in zip(output.prompt_logprobs[1:], prompt[1:])])
        assert (got - expected).abs().max() < 1e-3


@pytest.mark.parametrize("quantization_config, moe", [
    (QWEN_FP8, False), (compressed_tensors_config("channel"), False), (QWEN_FP8, True),
], ids=["qwen-block", "compressed-tensors-channel", "qwen-block-moe"])
def test_two_ranks_give_transformers_tokens_on_the_dequantized_weights(bf16_source, tmp_path, hf_model_cache,
                                                                       quantization_config, moe):
    """Tensor parallelism on gloo, with chunked prompts and prefix hits: each rank's share of every weight."""
    source = bf16_source
    if moe:
        source = write_random_checkpoint(str(tmp_path / "moe"), torch.bfloat16, initializer_range=0.1, seed=8,
                                         **{**TINY_MOE, "moe_intermediate_size": 160})
    quantized, reference = quantized_pair(source, str(tmp_path), quantization_config)
    prompts = [mixed_prompts()[i] for i in (1, 6, 7, 8, 9)]  # 8 and 9 share cached blocks with 7 and 6
    args = dict(ENGINE_ARGS, max_num_batched_tokens=64, tensor_parallel_size=2)
    with LLM(quantized, **args) as llm:
        completions = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    assert_greedy_matches_transformers(hf_model_cache, reference, prompts, completions)


def test_online_fp8_rounds_each_channel_and_stays_near_the_unquantized_model(bf16_source, tmp_path, hf_model_cache):
    """quantization="fp8" on a bf16 checkpoint: greedy tokens are transformers' on the weights rounded here to e4m3
    per output channel (amax / 448), and prompt log-probabilities move from the unquantized model's, a little."""
    reference = rounded_per_row(bf16_source, str(tmp_path))
    prompts, logprobs = mixed_prompts(), []
    for quantization in (None, "fp8"):
        with LLM(bf16_source, **ENGINE_ARGS, quantization=quantization) as llm:
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                           prompt_logprobs=0), use_tqdm=False)
        logprobs.append(torch.tensor([p[t].logprob for p, t in zip(outputs[4].prompt_logprobs[1:], prompts[4][1:])]))
    assert_greedy_matches_transformers(hf_model_cache, reference, prompts, [o.outputs[0].token_ids for o in outputs])
    difference = (logprobs[0] - logprobs[1]).abs()
    assert 0 < difference.mean() < 0.2, difference


def rounded_per_row(source: str, folder: str) -> str:
    """`folder`/reference: `source` with each linear weight rounded to e4m3 per row by the packer, in float32: what
    quantization="fp8" stands for."""
    reference = shutil.copytree(source, os.path.join(folder, "reference"))
    tensors = load_file(os.path.join(source, "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(tuple(f"{linear}.weight" for linear in LINEARS)):
            weight, scale = pack_channels(tensor.float(), "channel")
            tensors[name] = weight.float() * scale
        else:
            tensors[name] = tensor.float()
    save_file(tensors, os.path.join(reference, "model.safetensors"))
    return reference


def edited_config(source: str, folder, quantization_config: dict) -> str:
    path = shutil.copytree(source, os.path.join(folder, "edited"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f)
    return path


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "awq", "bits": 4}, "the checkpoint's quantization 'awq' is not supported; served: Qwen's block"),
    ({"quant_method": "gptq", "bits": 4}, "quantization 'gptq' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization 'bitsandbytes' is not supported"),
    ({**QWEN_FP8, "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]: only \[128, 128\]"),
    ({**QWEN_FP8, "fmt": "e5m2"}, "fmt 'e5m2': only e4m3 is served"),
    ({**QWEN_FP8, "activation_scheme": "static"}, "block FP8 with activation_scheme 'static'"),
    ({**compressed_tensors_config("channel"), "kv_cache_scheme": {"num_bits": 8}},
     "compressed-tensors kv_cache_scheme is not served: remove it"),
    ({**compressed_tensors_config("channel"), "config_groups": {"g": {
        "targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     r"group 'g' targets \['re:.\*self_attn.\*'\]: only \['Linear'\]"),
    ({**compressed_tensors_config("channel"), "format": "pack-quantized"}, "format 'pack-quantized' is not served"),
    ({**compressed_tensors_config("channel"), "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, "4-bit int per group: only symmetric 8-bit float"),
    ({**compressed_tensors_config("channel"), "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": False}}}}, "per channel, asymmetric"),
    ({**compressed_tensors_config("channel"), "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 4, "type": "int", "strategy": "token", "dynamic": True}}}},
     "group 'g' quantizes input activations as 4-bit int: only 8-bit float"),
    ({**compressed_tensors_config("channel"), "sparsity_config": {"format": "sparse-24-bitmask"}},
     "sparsity_config of format 'sparse-24-bitmask' is not served"),
    # values of the wrong kind: a lone name would be read as a list of letters
    ({**QWEN_FP8, "modules_to_not_convert": "lm_head"},
     "modules_to_not_convert is str 'lm_head': a list of module names is served"),
    ({**compressed_tensors_config("channel"), "ignore": ["lm_head", 3]},
     r"ignore is list \['lm_head', 3\]: a list of module names is served"),
    ({**compressed_tensors_config("channel"), "config_groups": ["group_0"]},
     r"compressed-tensors: config_groups is list \['group_0'\], not a JSON object"),
    ({**compressed_tensors_config("channel"), "config_groups": {"g": {"weights": "fp8"}}},
     "compressed-tensors group 'g': weights is str 'fp8', not a JSON object"),
])
def test_a_format_not_served_is_refused_by_name_before_any_work(bf16_source, tmp_path, quantization_config, message):
    with pytest.raises(ValueError, match=message) as refusal:
        LLM(edited_config(bf16_source, tmp_path, quantization_config), **ENGINE_ARGS)
    assert str(refusal.value).count("served: Qwen's block FP8") == 1  # each refusal lists the formats served


def test_a_quantization_config_that_is_no_json_object_is_refused_by_name(bf16_source):
    """As hf_overrides can give it (a config.json holding one is refused as a config transformers cannot read)."""
    with pytest.raises(ValueError, match="the checkpoint's quantization_config is str 'fp8', not a JSON object"):
        LLM(bf16_source, **ENGINE_ARGS, hf_overrides={"quantization_config": "fp8"})


def test_a_quantization_that_does_not_match_the_checkpoint_is_refused(bf16_source, tmp_path):
    path = edited_config(bf16_source, tmp_path, QWEN_FP8)
    with pytest.raises(ValueError, match="quantization='compressed-tensors' does not match the checkpoint's "
                                         "quant_method 'fp8'"):
        LLM(path, **ENGINE_ARGS, quantization="compressed-tensors")
    with pytest.raises(ValueError, match="quantization='compressed-tensors' needs a checkpoint quantized that way"):
        LLM(bf16_source, **ENGINE_ARGS, quantization="compressed-tensors")


def test_kv_cache_scales_and_zero_points_are_read_past(bf16_source, tmp_path, hf_model_cache):
    """An "-FP8-KV" checkpoint's k/v scales and an older compressed-tensors file's all-zero zero points: the cache
    stays unquantized and the weights symmetric, so they change nothing (vLLM ignores them with kv_cache_dtype
    "auto")."""
    quantized, reference = quantized_pair(bf16_source, str(tmp_path), compressed_tensors_config("channel"))
    tensors = load_file(os.path.join(quantized, "model.safetensors"))
    for layer in range(2):
        attention = f"model.layers.{layer}.self_attn"
        tensors |= {f"{attention}.k_scale": torch.tensor(0.1), f"{attention}.v_scale": torch.tensor(0.1),
                    f"{attention}.q_proj.weight_zero_point": torch.zeros(192, 1, dtype=torch.int8)}
    save_file(tensors, os.path.join(quantized, "model.safetensors"))
    prompts = mixed_prompts()[:4]
    with LLM(quantized, **ENGINE_ARGS) as llm:
        completions = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    assert_greedy_matches_transformers(hf_model_cache, reference, prompts, completions)


def test_quantization_with_a_gguf_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="quantization='fp8' with a GGUF file"):
        LLM(smollm2_file(), **ENGINE_ARGS, quantization="fp8")


def test_an_fp8_weight_without_its_scale_is_refused_naming_it(bf16_source, tmp_path):
    quantized, _ = quantized_pair(bf16_source, str(tmp_path), QWEN_FP8)
    tensors = load_file(os.path.join(quantized, "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, os.path.join(quantized, "model.safetensors"))
    with pytest.raises(ValueError, match="FP8 weight 'model.layers.1.mlp.down_proj.weight' has no scale"):
        LLM(quantized, **ENGINE_ARGS)


def test_an_fp8_weight_in_another_8_bit_float_is_refused_naming_it(bf16_source, tmp_path):
    """A config of e4m3 over weights stored in e5m2: refused by the tensor's name and type, not read as e4m3's."""
    quantized, _ = quantized_pair(bf16_source, str(tmp_path), QWEN_FP8)
    tensors = load_file(os.path.join(quantized, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)
    save_file(tensors, os.path.join(quantized, "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' is torch.float8_e5m2: of 8-bit floats only e4m3"):
        LLM(quantized, **ENGINE_ARGS)


def test_a_block_scale_of_the_wrong_shape_is_refused_naming_it(bf16_source, tmp_path):
    quantized, _ = quantized_pair(bf16_source, str(tmp_path), QWEN_FP8)
    tensors = load_file(os.path.join(quantized, "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, os.path.join(quantized, "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight_scale_inv' of shape \(1, 1\) does "
                                         r"not give one scale per \[128, 128\] block .* \(expected \(2, 2\)\)"):
        LLM(quantized, **ENGINE_ARGS)


def test_load_format_dummy_takes_an_fp8_config(bf16_source, tmp_path):
    """Benchmarks run FP8 models from their config alone."""
    path = edited_config(bf16_source, tmp_path, QWEN_FP8)
    os.remove(os.path.join(path, "model.safetensors"))
    with LLM(path, **ENGINE_ARGS, load_format="dummy") as llm:
        assert llm.config.quantization == "fp8"
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids) == 4
