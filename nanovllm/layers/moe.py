"""A sparse mixture-of-experts block (Qwen3-MoE's): a router picks each token's top-k experts, whose
SiLU-gated MLPs run on it and are summed by the router's weights.

The experts' weights are stacked, `w13` [experts, 2 * intermediate, hidden] (gate rows, then up rows) and
`w2` [experts, hidden, intermediate], each rank holding its slice of every expert's intermediate
dimension (one all-reduce after the block, as a row-parallel linear). On a CPU the experts that received
tokens run one after another; on CUDA the fused Triton kernels of `kernels/fused_moe.py` run them all at once.
"""
import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanovllm.kernels import on_cuda
from nanovllm.layers.activation import silu_and_mul
from nanovllm.utils.loader import copy_weight
from nanovllm.utils.parallel import all_reduce, get_tp_rank, get_tp_size

# A checkpoint's per-expert tensors, e.g. model.layers.3.mlp.experts.17.up_proj.weight.
EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_route(weight_name: str) -> tuple[str, tuple[int, str]] | None:
    """The stacked parameter a per-expert checkpoint tensor loads into, and (expert, projection); None for
    any other tensor."""
    match = EXPERT_TENSOR.match(weight_name)
    if match is None:
        return None
    prefix, expert, projection = match.groups()
    return f"{prefix}.{'w2' if projection == 'down_proj' else 'w13'}", (int(expert), projection)


def route(router_logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts and their float32 weights: the softmax over all experts, renormalised over
    the chosen ones where asked (Qwen3's norm_topk_prob). [tokens, experts] -> ([tokens, top_k] twice)."""
    probabilities = router_logits.float().softmax(dim=-1)
    weights, expert_ids = probabilities.topk(top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def router_logits(x: torch.Tensor, float_weight: torch.Tensor) -> torch.Tensor:
    """The router's logits in float32: x [tokens, hidden] (any float dtype) by the float32 weight [experts, hidden]."""
    return F.linear(x.float(), float_weight)


def experts_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 expert_ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for each token t, an expert at a time (transformers'
    order: experts ascending, each added into the output in x's dtype)."""
    out = torch.zeros_like(x)
    for expert in expert_ids.unique().tolist():
        tokens, slots = torch.where(expert_ids == expert)
        hidden = F.linear(silu_and_mul(F.linear(x[tokens], w13[expert])), w2[expert])
        out.index_add_(0, tokens, (hidden * weights[tokens, slots, None]).to(out.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """The router (replicated on every rank) and the experts; under Qwen3-MoE's parameter names."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        tp_size, num_experts = get_tp_size(), config.num_experts
        assert config.moe_intermediate_size % tp_size == 0
        self.top_k, self.renormalise = config.num_experts_per_tok, config.norm_topk_prob
        self.tp_size, self.tp_rank = tp_size, get_tp_rank()
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = StackedExperts(num_experts, config.hidden_size, config.moe_intermediate_size // tp_size)
        self.router_logits, self.route, self.run_experts = router_logits, route, experts_loop
        if on_cuda():
            from nanovllm.kernels import fused_moe
            self.router_logits, self.route, self.run_experts = (fused_moe.router_logits, fused_moe.route,
                                                                fused_moe.fused_experts)
        self.float_gate: torch.Tensor | None = None  # the router's weight in float32, made at the first forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Made at the first forward, the warm-up's many tokens: the weights are loaded by then, a graph's capture
        # comes later, and the one-row router kernel (which reads its weight before waiting, `kernels/pdl.py`)
        # later still.
        if self.float_gate is None:
            self.float_gate = self.gate.weight.float()
        weights, expert_ids = self.route(self.router_logits(x, self.float_gate), self.top_k, self.renormalise)
        out = self.run_experts(x, self.experts.w13, self.experts.w2, weights, expert_ids)
        return all_reduce(out) if self.tp_size > 1 else out


class StackedExperts(nn.Module):
    """Every expert's gate/up and down projections in two stacked parameters, loaded a checkpoint tensor at
    a time (`expert_route`); `intermediate` is this rank's share of an expert's intermediate size."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate, self.num_experts = intermediate, num_experts
        self.tp_rank = get_tp_rank()
        self.loaded: set[tuple[int, str]] = set()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard: tuple[int, str]):
        expert, projection = shard
        rows = self.intermediate
        if not 0 <= expert < self.num_experts:
            raise RuntimeError(f"expert {expert} of a model of {self.num_experts} experts")  # the loader names it
        mine = loaded_weight.narrow(0 if projection != "down_proj" else 1, self.tp_rank * rows, rows)
        if projection == "down_proj":
            copy_weight(param.data[expert], mine)
        else:
            copy_weight(param.data[expert].narrow(0, 0 if projection == "gate_proj" else rows, rows), mine)
        self.loaded.add(shard)

    def missing_tensors(self) -> list[str]:
        """The experts' projections no checkpoint tensor was loaded into (a parameter loads in pieces)."""
        return [f"{expert}.{projection}" for expert in range(self.num_experts)
                for projection in ("gate_proj", "up_proj", "down_proj") if (expert, projection) not in self.loaded]
