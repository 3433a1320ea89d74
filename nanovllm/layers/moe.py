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
from nanovllm.layers.linear import load_fp8_region
from nanovllm.utils.fp8_weights import FP8, dequantize, get_fp8_scheme, scale_shape
from nanovllm.utils.loader import copy_weight
from nanovllm.utils.parallel import all_reduce, get_tp_rank, get_tp_size

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's, in the checkpoint
# A checkpoint's per-expert tensors, e.g. model.layers.3.mlp.experts.17.up_proj.weight (or its FP8 scale).
EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                           r"(weight|weight_scale|weight_scale_inv)$")


def expert_route(weight_name: str) -> tuple[str, tuple[int, str]] | None:
    """The stacked parameter a per-expert checkpoint tensor loads into, and (expert, projection); None for
    any other tensor."""
    match = EXPERT_TENSOR.match(weight_name)
    if match is None:
        return None
    prefix, expert, projection, kind = match.groups()
    suffix = "" if kind == "weight" else "_scale"
    return f"{prefix}.{'w2' if projection == 'down_proj' else 'w13'}{suffix}", (int(expert), projection)


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
                 expert_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for each token t, an expert at a time (transformers'
    order: experts ascending, each added into the output in x's dtype); FP8 experts dequantized first."""
    out = torch.zeros_like(x)
    for expert in expert_ids.unique().tolist():
        tokens, slots = torch.where(expert_ids == expert)
        gate_up, down = w13[expert], w2[expert]
        if w13_scale is not None:
            gate_up = dequantize(gate_up, w13_scale[expert]).to(x.dtype)
            down = dequantize(down, w2_scale[expert]).to(x.dtype)
        hidden = F.linear(silu_and_mul(F.linear(x[tokens], gate_up)), down)
        out.index_add_(0, tokens, (hidden * weights[tokens, slots, None]).to(out.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """The router (replicated on every rank) and the experts; under Qwen3-MoE's parameter names."""
    takes_quantized_rows = False  # its norm's rows come plain (FP8 experts above FEW_PAIRS round them by groups)

    def __init__(self, config: PretrainedConfig, prefix: str):
        super().__init__()
        tp_size, num_experts = get_tp_size(), config.num_experts
        assert config.moe_intermediate_size % tp_size == 0
        self.top_k, self.renormalise = config.num_experts_per_tok, config.norm_topk_prob
        self.tp_size, self.tp_rank = tp_size, get_tp_rank()
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = StackedExperts(num_experts, config.hidden_size, config.moe_intermediate_size // tp_size,
                                      f"{prefix}.experts")
        self.router_logits, self.route, self.run_experts = router_logits, route, experts_loop
        if on_cuda():
            from nanovllm.kernels import fused_moe, moe_route
            self.router_logits, self.route, self.run_experts = (moe_route.router_logits, moe_route.route,
                                                                fused_moe.fused_experts)
        self.router_weight: torch.Tensor | None = None  # as router_logits takes it, made at the first forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_weight is None:  # the weights are loaded by then: in float32 for the PyTorch path
            float_path = self.router_logits is router_logits
            self.router_weight = self.gate.weight.float() if float_path else self.gate.weight
        weights, expert_ids = self.route(self.router_logits(x, self.router_weight), self.top_k, self.renormalise)
        out = self.run_experts(x, self.experts.w13, self.experts.w2, weights, expert_ids, **self.experts.scales)
        return all_reduce(out) if self.tp_size > 1 else out


class StackedExperts(nn.Module):
    """Every expert's gate/up and down projections in two stacked parameters, loaded a checkpoint tensor at
    a time (`expert_route`); `intermediate` is this rank's share of an expert's intermediate size. Built under
    an FP8 scheme, both are e4m3 with their scales, `w13_scale` and `w2_scale` (`utils/fp8_weights.py`), unless
    the checkpoint leaves the experts under `prefix` (the block's name in it) unquantized."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, prefix: str):
        super().__init__()
        self.intermediate, self.num_experts = intermediate, num_experts
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.fp8_scheme = get_fp8_scheme([f"{prefix}.{expert}.{projection}" for expert in range(num_experts)
                                          for projection in PROJECTIONS])
        self.loaded: set[tuple[int, str]] = set()
        dtype = FP8 if self.fp8_scheme else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.scales = {}  # what the experts' kernels take beside the weights
        if self.fp8_scheme:
            for name, weight in (("w13_scale", self.w13), ("w2_scale", self.w2)):
                shape = (num_experts, *scale_shape(self.fp8_scheme, *weight.shape[1:]))
                scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
                scale.weight_loader = self.weight_loader
                setattr(self, name, scale)
                self.scales[name] = scale

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard: tuple[int, str]):
        expert, projection = shard
        rows = self.intermediate
        if not 0 <= expert < self.num_experts:
            raise RuntimeError(f"expert {expert} of a model of {self.num_experts} experts")  # the loader names it
        dim = 0 if projection != "down_proj" else 1  # the intermediate dimension, which ranks split
        target_start = rows if projection == "up_proj" else 0
        if self.fp8_scheme:
            weight, scale = (self.w2, self.w2_scale) if projection == "down_proj" else (self.w13, self.w13_scale)
            load_fp8_region(weight.data[expert], scale.data[expert], self.fp8_scheme, loaded_weight,
                            param is scale, dim, self.tp_rank * rows, target_start, rows, rows * self.tp_size,
                            what=f"expert {expert}'s {projection} on rank {self.tp_rank} of {self.tp_size}")
        else:
            copy_weight(param.data[expert].narrow(dim, target_start, rows),
                        loaded_weight.narrow(dim, self.tp_rank * rows, rows))
        if param is self.w13 or param is self.w2:
            self.loaded.add(shard)

    def missing_tensors(self) -> list[str]:
        """The experts' projections no checkpoint tensor was loaded into (a parameter loads in pieces)."""
        return [f"{expert}.{projection}" for expert in range(self.num_experts)
                for projection in PROJECTIONS if (expert, projection) not in self.loaded]
