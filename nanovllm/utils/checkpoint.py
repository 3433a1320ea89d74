"""Random-weight checkpoints (Qwen3 by default) with a small trained tokenizer, for tests, the example and benchmarks
on machines with no model hub. Speed does not depend on the weights' values."""
import json
import os

import torch

# Qwen3-0.6B's real dimensions.
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
# Two more real shapes, of the registry's other families (GPU tests and bench.py --random-dims).
LLAMA_3_2_1B = dict(architecture="LlamaForCausalLM", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                    tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    rope_scaling=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192))
QWEN2_5_1_5B = dict(architecture="Qwen2ForCausalLM", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, head_dim=128, intermediate_size=8960, vocab_size=151936,
                    tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
# Qwen3's mixture of experts: 30B parameters, 3B a token (61 GB in bf16: benchmarked with load_format="dummy").
QWEN3_30B_A3B = dict(architecture="Qwen3MoeForCausalLM", hidden_size=2048, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6)
# The quantization_config of Qwen's FP8 releases (Qwen/Qwen3-30B-A3B-FP8, Qwen/Qwen3-8B-FP8): for load_format="dummy".
QWEN_BLOCK_FP8 = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128],
                      modules_to_not_convert=["lm_head", "gate"])
REAL_DIMENSIONS = {"qwen3-0.6b": QWEN3_0_6B, "llama-3.2-1b": LLAMA_3_2_1B, "qwen2.5-1.5b": QWEN2_5_1_5B,
                   "qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B,
                   "qwen3-8b-fp8": dict(QWEN3_8B, quantization_config=QWEN_BLOCK_FP8),
                   "qwen3-30b-a3b-fp8": dict(QWEN3_30B_A3B, quantization_config=QWEN_BLOCK_FP8)}
# A model small enough to run on a CPU in milliseconds.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=1024,
            rope_theta=10000.0, rms_norm_eps=1e-6)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = ("the model reads a prompt and writes the next token one at a time while the cache keeps "
          "keys and values of every earlier token in blocks that sequences with the same prefix share "
          "introduce yourself list all prime numbers within one hundred hello world a quick brown fox "
          "jumps over the lazy dog inference engines batch many requests on one machine").split()


def _corpus() -> list[str]:
    n = len(_WORDS)
    return [" ".join(_WORDS[(i * 7 + j * 3) % n] for j in range(12)) for i in range(400)]


def build_tokenizer(vocab_size: int):
    """A byte-level BPE trained on a small built-in text, padded with filler tokens to `vocab_size`
    so that any id the model may sample decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 1000), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"fill{i}"] = i
    tokenizer = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2ForCausalLM": "qwen2",
               "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen3ForSequenceClassification": "qwen3",
               "Qwen2ForSequenceClassification": "qwen2", "LlamaForSequenceClassification": "llama"}


def write_random_checkpoint(path: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                            initializer_range: float = 0.02, architecture: str = "Qwen3ForCausalLM",
                            weights: bool = True, tokenizer=None, **dims) -> str:
    """Write config.json, model.safetensors, generation_config.json and a tokenizer into `path`: a random
    `architecture` (one of MODEL_TYPES) written by transformers. `dims` override TINY's config fields (pass
    **QWEN3_0_6B for Qwen3-0.6B's shapes) or add others (rope_scaling, attention_bias, ...). With
    weights=False, no model.safetensors: a checkpoint for load_format="dummy". `tokenizer`, a transformers
    tokenizer, in place of the small built one; vocab_size should then be its length."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    dims = {**TINY, **dims}
    tokenizer = tokenizer or build_tokenizer(dims["vocab_size"])
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = AutoConfig.for_model(MODEL_TYPES[architecture], **dims, initializer_range=initializer_range,
                                  eos_token_id=eos_ids[0], pad_token_id=eos_ids[1], bos_token_id=None,
                                  architectures=[architecture])
    os.makedirs(path, exist_ok=True)
    if weights:
        torch.manual_seed(seed)
        classifier = architecture.endswith("ForSequenceClassification")
        model = (AutoModelForSequenceClassification if classifier else AutoModelForCausalLM).from_config(config)
        model = model.to(dtype)
        with torch.no_grad():  # transformers initialises biases to zero: random ones are read and added, or tests fail
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0.0, initializer_range)
        model.save_pretrained(path)
    else:
        config.dtype = dtype
        config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos_ids, "pad_token_id": eos_ids[1]}, f)
    return path


def random_checkpoint(path: str, dimensions: str = "qwen3-0.6b", weights: bool = True,
                      tokenizer: str | None = None) -> str:
    """`path`, holding a random bf16 checkpoint of one of REAL_DIMENSIONS (without its weights file where
    weights=False), with the tokenizer of folder `tokenizer` where given (its length the vocabulary size):
    written there unless it has one. The "-fp8" dimensions carry Qwen's FP8 config: for load_format="dummy" only."""
    if weights and "quantization_config" in REAL_DIMENSIONS[dimensions]:
        raise ValueError(f"{dimensions!r} is an FP8 config without FP8 weights: use it with load_format='dummy'")
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"writing a random {dimensions}-sized checkpoint into {path}", flush=True)
        dims = dict(REAL_DIMENSIONS[dimensions])
        if tokenizer is not None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
            dims["vocab_size"] = len(tokenizer)
        write_random_checkpoint(path, torch.bfloat16, weights=weights, tokenizer=tokenizer, **dims)
    return path


def random_qwen3_0_6b_checkpoint(path: str) -> str:
    return random_checkpoint(path, "qwen3-0.6b")
