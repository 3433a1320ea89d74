import torch
from torch import nn

from nanovllm.utils.compile import compile_if_cuda


def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """One token per row: argmax where the temperature is 0, else a draw from softmax(logits / T)."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    safe_temperatures = torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
    probs = torch.softmax(logits / safe_temperatures, dim=-1)
    # Gumbel-max in exponential form: argmax(p / E) with E ~ Exp(1) draws from p.
    sampled = probs.div_(torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy)


class Sampler(nn.Module):

    def __init__(self):
        super().__init__()
        self.sample = compile_if_cuda(sample)

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        return self.sample(logits, temperatures)
