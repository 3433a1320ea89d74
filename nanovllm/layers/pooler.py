"""A pooling engine's prompt states: of each prompt that ends in a step, its last token's hidden state (LAST), the
mean of its tokens' (MEAN) or its first token's (CLS), as vLLM's pooling types."""
import torch


def pool_prompts(hidden_states: torch.Tensor, cu_seqlens_q: torch.Tensor, sample_indices: torch.Tensor,
                 pooling_type: str) -> torch.Tensor:
    """[num_sampled, hidden] in the step's row order. MEAN and CLS run with each prompt whole in its step, from its
    first token (no chunks, no prefix cache): the step's prompts are then its rows, in order. MEAN sums in float32,
    then rounds to the states' dtype."""
    if pooling_type == "LAST":
        return hidden_states[sample_indices]
    starts, lengths = cu_seqlens_q[:-1], cu_seqlens_q.diff()
    assert len(sample_indices) == len(lengths), "MEAN and CLS pooling prefill each prompt whole"
    if pooling_type == "CLS":
        return hidden_states[starts]
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths,
                                   output_size=hidden_states.size(0))
    sums = hidden_states.new_zeros(len(lengths), hidden_states.size(1), dtype=torch.float32)
    return (sums.index_add_(0, rows, hidden_states.float()) / lengths[:, None]).to(hidden_states.dtype)
