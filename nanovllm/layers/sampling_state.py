"""The sampling state of every running request, on the sampling rank's device, row by sampling slot.

A request's parameters, token counts, logit biases and bad words are written once, when it takes a slot
(`join`), and after that only by the steps themselves (`record`): no step uploads or reads them back, so
a step samples from its rows' slots alone, inside a CUDA graph as well as outside. The last row is a
scratch slot for a graph's padding rows, greedy.

Memory: two [num_slots + 1, vocab_size] tables of 4-byte entries (the counts and the biases), 1.2 GiB
at 1,024 slots over Qwen3's vocabulary, taken before the KV cache is sized.
"""
from dataclasses import dataclass

import numpy as np
import torch

# A slot's sampling flags (SlotJoins.flags): which of its per-token state the sampler reads.
HAS_BIAS, HAS_PENALTIES, HAS_BAD_WORDS = 1, 2, 4
# Bad words of two or more tokens a completion may carry, and their longest spelling, in tokens.
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 32, 8
IN_PROMPT = 1 << 30  # a slot's token count has this bit where the token is in the prompt (repetition penalty)

PARAMETERS = {"temperature": (torch.float32, 1.0), "top_k": (torch.int32, 0), "top_p": (torch.float32, 1.0),
              "min_p": (torch.float32, 0.0), "seed": (torch.int64, 0), "seeded": (torch.int32, 0),
              "presence_penalty": (torch.float32, 0.0), "frequency_penalty": (torch.float32, 0.0),
              "repetition_penalty": (torch.float32, 1.0), "flags": (torch.int32, 0), "generated": (torch.int32, 0)}


@dataclass(slots=True)
class SlotJoins:
    """Sequences taking sampling slots in a step: each one's parameters and per-token state, which the
    sampling rank writes into its slot before the step runs (`SamplingState.join`), as host arrays or as
    tensors on its device. Token entries are (index into `slots`, token id, value) triples."""

    slots: np.ndarray  # [num_joins] int64
    temperature: np.ndarray  # [num_joins] float32, 0 = greedy
    top_k: np.ndarray  # [num_joins] int32, 0 = off
    top_p: np.ndarray  # [num_joins] float32
    min_p: np.ndarray  # [num_joins] float32
    seed: np.ndarray  # [num_joins] int64
    seeded: np.ndarray  # [num_joins] int32
    presence_penalty: np.ndarray  # [num_joins] float32
    frequency_penalty: np.ndarray  # [num_joins] float32
    repetition_penalty: np.ndarray  # [num_joins] float32
    flags: np.ndarray  # [num_joins] int32: HAS_BIAS | HAS_PENALTIES | HAS_BAD_WORDS
    generated: np.ndarray  # [num_joins] int32: completion tokens so far
    bias_fill: np.ndarray  # [num_joins] float32: the bias of a token no entry names (-inf: allowed_token_ids)
    bias_entries: tuple[np.ndarray, np.ndarray, np.ndarray]  # (join, token, float32 bias)
    count_entries: tuple[np.ndarray, np.ndarray, np.ndarray]  # (join, token, int32 count)
    bad_prefixes: np.ndarray  # [num_joins, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS - 1] int32, right-aligned, -2 pads
    bad_last: np.ndarray  # [num_joins, MAX_BAD_WORDS] int32: each word's last token, -1 where no word
    recent: np.ndarray  # [num_joins, MAX_BAD_WORD_TOKENS - 1] int64: the last completion tokens, -1 padded


class SamplingState:
    """Per-slot tensors: PARAMETERS ([num_slots + 1] each), `counts` (int32 [num_slots + 1, vocab_size]:
    each token's count in the completion, with IN_PROMPT set for prompt tokens), `bias` (float32, same
    shape: what is added to the logits, -inf where a token is forbidden), the bad words of two or more
    tokens (`bad_prefixes`, `bad_last`) and the completion's last tokens they match (`recent`). The kernels that
    read them take the flags' layout from here (`kernels/sampling.py`)."""

    HAS_BIAS, HAS_PENALTIES, HAS_BAD_WORDS, IN_PROMPT = HAS_BIAS, HAS_PENALTIES, HAS_BAD_WORDS, IN_PROMPT

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        rows = num_slots + 1
        self.scratch_slot = num_slots
        for name, (dtype, default) in PARAMETERS.items():
            setattr(self, name, torch.full((rows,), default, dtype=dtype, device=device))
        self.temperature[self.scratch_slot] = 0.0  # padding rows draw no noise and leave the counter
        self.counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=device)
        self.bias = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        self.bad_prefixes = torch.full((rows, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS - 1), -2, dtype=torch.int32,
                                       device=device)
        self.bad_last = torch.full((rows, MAX_BAD_WORDS), -1, dtype=torch.int32, device=device)
        self.recent = torch.full((rows, MAX_BAD_WORD_TOKENS - 1), -1, dtype=torch.int64, device=device)

    def join(self, joins: SlotJoins):
        """Write the joining sequences' rows (`joins` as tensors on this device)."""
        slots = joins.slots
        for name in PARAMETERS:
            getattr(self, name)[slots] = getattr(joins, name)
        self.bias[slots] = joins.bias_fill.unsqueeze(1)
        join, token_ids, bias = joins.bias_entries
        self.bias[slots[join], token_ids] = bias
        self.counts[slots] = 0
        join, token_ids, counts = joins.count_entries
        self.counts.index_put_((slots[join], token_ids), counts, accumulate=True)
        self.bad_prefixes[slots] = joins.bad_prefixes
        self.bad_last[slots] = joins.bad_last
        self.recent[slots] = joins.recent

    def update_bias(self, updates: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        slots, token_ids, bias = updates
        self.bias[slots, token_ids] = bias

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor):
        """A step's samples into its rows' slots: their counts, their last tokens, and one more generated."""
        self.counts.index_put_((slots, token_ids), torch.ones_like(token_ids, dtype=torch.int32), accumulate=True)
        self.recent[slots] = torch.cat([self.recent[slots, 1:], token_ids.unsqueeze(1)], dim=1)
        self.generated.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
