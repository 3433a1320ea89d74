"""config.json's `architectures` to the model that runs them: each supported one is a DecoderSpec of the
shared decoder (`models/decoder.py`), read from its config. Checked when the engine's config is made, so
an unsupported checkpoint is refused before any process starts."""
from transformers import PretrainedConfig

from nanovllm.layers.rotary_embedding import rope_parameters
from nanovllm.models.decoder import (
    Decoder,
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    DecoderSpec,
    attention_head_dim,
)


def _qwen3(config) -> DecoderSpec:
    return DecoderSpec(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)


def _qwen3_moe(config) -> DecoderSpec:
    """Qwen3's attention; a mixture of experts every decoder_sparse_step-th layer but mlp_only_layers."""
    sparse = frozenset(i for i in range(config.num_hidden_layers) if config.num_experts > 0
                       and (i + 1) % config.decoder_sparse_step == 0 and i not in config.mlp_only_layers)
    return DecoderSpec(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True,
                       sparse_layers=sparse)


def _qwen2(config) -> DecoderSpec:
    return DecoderSpec(qkv_bias=True)


def _llama(config) -> DecoderSpec:  # Llama 2 and 3.x, SmolLM2, TinyLlama; Mistral without a sliding window
    bias = getattr(config, "attention_bias", False)
    return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=getattr(config, "mlp_bias", False))


ARCHITECTURES = {
    "Qwen3ForCausalLM": _qwen3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Qwen2ForCausalLM": _qwen2,
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    # The same decoders with a score head on the last token in place of the LM head (a pooling engine's).
    "Qwen3ForSequenceClassification": _qwen3,
    "Qwen2ForSequenceClassification": _qwen2,
    "LlamaForSequenceClassification": _llama,
}


def is_classifier(config: PretrainedConfig) -> bool:
    """Whether the checkpoint's architecture is a *ForSequenceClassification (a score head, no LM head)."""
    return any(a.endswith("ForSequenceClassification") and a in ARCHITECTURES for a in config.architectures or [])


def check_architecture(config: PretrainedConfig, max_model_len: int):
    """A ValueError naming what of the config this engine cannot run."""
    architectures = getattr(config, "architectures", None) or []
    supported = [a for a in architectures if a in ARCHITECTURES]
    if not supported:
        raise ValueError(f"architecture {', '.join(architectures) or '(none in config.json)'} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported, only 'silu'")
    rope_parameters(config)  # raises on a rope type the rotary does not have
    window = sliding_window(config)
    if window is not None and window < max_model_len:
        raise ValueError(f"sliding_window={window} is below max_model_len={max_model_len}: sliding-window "
                         f"attention is not supported; give max_model_len <= {window}")


def split_sizes(config: PretrainedConfig) -> dict[str, int]:
    """The sizes tensor parallelism splits into a share a rank, by name: the rows of q and of k and v (heads by
    head_dim), of the MLPs' gate and up where a layer has one, of the experts' where a layer has them."""
    spec = decoder_spec(config)
    head_dim = attention_head_dim(config)
    sizes = {"num_attention_heads x head_dim": config.num_attention_heads * head_dim,
             "num_key_value_heads x head_dim": config.num_key_value_heads * head_dim}
    if len(spec.sparse_layers) < config.num_hidden_layers:
        sizes["intermediate_size"] = config.intermediate_size
    if spec.sparse_layers:
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    return sizes


def sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window, where the config uses one (Qwen2's only with use_sliding_window)."""
    if not getattr(config, "use_sliding_window", True):
        return None
    return getattr(config, "sliding_window", None)


def build_model(config: PretrainedConfig, pooling: bool = False) -> Decoder:
    """The model of the config's architecture: with its LM head, or its score head; for a pooling engine, a
    generative checkpoint's decoder alone (no LM head to load or hold)."""
    if is_classifier(config):
        model = DecoderForSequenceClassification
    else:
        model = Decoder if pooling else DecoderForCausalLM
    return model(config, decoder_spec(config))


def decoder_spec(config: PretrainedConfig) -> DecoderSpec:
    """The DecoderSpec of the config's (first supported) architecture."""
    return ARCHITECTURES[next(a for a in config.architectures if a in ARCHITECTURES)](config)
