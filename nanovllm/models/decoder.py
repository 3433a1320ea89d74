"""The decoder-only transformer the supported checkpoints share (`models/registry.py`): pre-norm layers of
self-attention (fused q/k/v, optional biases, optional per-head RMSNorm of the query and key heads,
rotary) and a SiLU-gated MLP, under vLLM's parameter names. What differs between Qwen3, Qwen2 and Llama
is a DecoderSpec, not code; Qwen3-MoE's sparse layers put a mixture of experts (`layers/moe.py`) where
the MLP is.
"""
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.kernels import on_cuda
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.moe import SparseMoeBlock, expert_route
from nanovllm.layers.rotary_embedding import rotary_embedding
from nanovllm.models.classifier_from_token import score_weight
from nanovllm.utils.loader import copy_weight
from nanovllm.utils.parallel import get_tp_size


@dataclass(frozen=True)
class DecoderSpec:
    """What one architecture's layers have: biases on q/k/v, on the output projection and on the MLP, and
    a per-head RMSNorm of the query and key heads before the rotary; the layers whose MLP is a mixture of
    experts."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sparse_layers: frozenset[int] = frozenset()


def attention_head_dim(config: PretrainedConfig) -> int:
    """The attention heads' width: the config's head_dim, else hidden_size split over the query heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, prefix: str):
        super().__init__()
        tp_size = get_tp_size()
        head_dim = attention_head_dim(config)
        num_heads, num_kv_heads = config.num_attention_heads // tp_size, config.num_key_value_heads // tp_size
        self.head_dim, self.q_size, self.kv_size = head_dim, num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=spec.qkv_bias,
                                          modules=[f"{prefix}.{p}_proj" for p in "qkv"])
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps) if spec.qk_norm else None
        self.rotary_emb = rotary_embedding(config, head_dim)
        self.attn = Attention(num_heads, num_kv_heads, scale=head_dim**-0.5)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=spec.o_bias,
                                        modules=[f"{prefix}.o_proj"])
        self.fused = on_cuda()

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        if self.fused:  # on CUDA one kernel takes the steps of the other branch
            q, k, v = self.attn.prepare_qkv_fused(qkv, positions, self.q_norm, self.k_norm, self.rotary_emb)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k, v = (x.unflatten(-1, (-1, self.head_dim)) for x in (q, k, v))  # [num_tokens, heads, head_dim]
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
            self.attn.store_kv(k, v)
        return self.o_proj(self.attn(q, k, v).flatten(1, -1))


class DecoderMLP(nn.Module):

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=spec.mlp_bias,
                                                       modules=[f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=spec.mlp_bias,
                                           takes_gate_up=True,  # silu(gate) * up, then the projection
                                           modules=[f"{prefix}.down_proj"])
        self.takes_quantized_rows = self.gate_up_proj.takes_quantized_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class DecoderLayer(nn.Module):

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, index: int, prefix: str):
        super().__init__()
        self.self_attn = DecoderAttention(config, spec, f"{prefix}.self_attn")
        mlp = f"{prefix}.mlp"
        self.mlp = SparseMoeBlock(config, mlp) if index in spec.sparse_layers else DecoderMLP(config, spec, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                       quantize_rows=self.self_attn.qkv_proj.takes_quantized_rows)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                                quantize_rows=self.mlp.takes_quantized_rows)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    """The decoder's layers, built under `prefix`, their names' start in the checkpoint (its modules left
    unquantized are named so: `fp8_weights`)."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, prefix: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, spec, i, f"{prefix}.layers.{i}")
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Decoder(nn.Module):
    """The decoder under vLLM's parameter names, as the loader fills it; a head on top makes it a model."""
    # checkpoint name -> (our parameter, shard id): q/k/v and gate/up are stored fused
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec):
        super().__init__()
        self.model = DecoderModel(config, spec, prefix="model")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @staticmethod
    def route_weight(weight_name: str) -> tuple[str, tuple[int, str]] | None:
        """The loader's route for a per-expert checkpoint tensor (into the stacked experts); None for the others,
        which packed_modules_mapping routes."""
        return expert_route(weight_name)


class DecoderForCausalLM(Decoder):

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec):
        super().__init__(config, spec)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Rank 0's logits of the hidden states (None on the other ranks), written into `out` where given."""
        return self.lm_head(hidden_states, out)


class DecoderForSequenceClassification(Decoder):
    """transformers' *ForSequenceClassification: the decoder and a score head, [num_labels, hidden] without a
    bias, which a pooling engine applies to each prompt's last token; no LM head."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec):
        super().__init__(config, spec)
        self.config = config
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.score.weight.requires_grad_(False)

    def score_source(self) -> tuple[str, ...]:
        """The checkpoint tensors the score head is made from (`classifier_from_token.py`): the LM head's, or the
        embedding tied to it; none for a checkpoint with a score head of its own."""
        if getattr(self.config, "classifier_from_token_ids", None) is None:
            return ()
        tied = getattr(self.config, "tie_word_embeddings", False)
        return ("model.embed_tokens.weight", "embed_tokens.weight") if tied else ("lm_head.weight",)

    def load_score_from_head(self, head: torch.Tensor):
        copy_weight(self.score.weight.data, score_weight(head, self.config).to(self.score.weight.dtype))

    def classify(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.score(hidden_states)
