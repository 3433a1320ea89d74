"""The router of a mixture-of-experts block on CUDA, before `fused_moe` runs the experts: each token's logits in
float32 (one kernel for one token, tensor cores for more), then in one kernel its softmax over the experts and its
top_k, renormalised where the model says so."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels import pdl
from nanovllm.kernels.one_row_linear import one_row_linear, takes_one_row

MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm's out_dtype (torch 2.8 and later)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`moe.router_logits` from the router's weight as loaded: the product of two bf16 (or fp16) values is exact
    in float32, so a float32 sum of them gives float32's logits (to the sum's rounding) without a float32 copy of
    either: for one token in one kernel, else cuBLAS's bf16 matmul with a float32 output on tensor cores."""
    if takes_one_row(x, weight):
        return one_row_linear(x, weight, out_dtype=torch.float32)
    if MM_OUT_DTYPE and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


@triton.jit
def route_kernel(logits_ptr, weights_ptr, expert_ids_ptr, NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr,
                 TOP_K: tl.constexpr, SLOTS: tl.constexpr, RENORMALISE: tl.constexpr, USE_PDL: tl.constexpr):
    # One program a token: the softmax over its experts, the top TOP_K one at a time (the lowest id of a tie).
    token = tl.program_id(0).to(tl.int64)
    pdl.wait_for_previous(USE_PDL)  # the logits come from the kernel before
    experts = tl.arange(0, EXPERTS)
    logits = tl.load(logits_ptr + token * NUM_EXPERTS + experts, mask=experts < NUM_EXPERTS, other=float("-inf"))
    exps = tl.exp(logits.to(tl.float32) - tl.max(logits.to(tl.float32), axis=0))
    probabilities = exps / tl.sum(exps, axis=0)
    slots = tl.arange(0, SLOTS)
    chosen_weights = tl.zeros((SLOTS,), tl.float32)
    chosen_ids = tl.zeros((SLOTS,), tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probabilities, axis=0)
        expert = tl.min(tl.where(probabilities == best, experts, EXPERTS), axis=0)
        expert = tl.minimum(expert, NUM_EXPERTS - 1)  # NaN logits match no expert: still a real one's weights
        chosen_weights = tl.where(slots == slot, best, chosen_weights)
        chosen_ids = tl.where(slots == slot, expert, chosen_ids)
        probabilities = tl.where(experts == expert, -1.0, probabilities)
    if RENORMALISE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_weights, mask=slots < TOP_K)
    tl.store(expert_ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one kernel."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    expert_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    route_kernel[(num_tokens,)](router_logits.contiguous(), weights, expert_ids, NUM_EXPERTS=num_experts,
                                EXPERTS=triton.next_power_of_2(num_experts), TOP_K=top_k,
                                SLOTS=triton.next_power_of_2(top_k), RENORMALISE=renormalise, num_warps=1,
                                **pdl.launch_options(router_logits.device))
    return weights, expert_ids
