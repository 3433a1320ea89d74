"""Arrival counters for kernels whose last program to finish a piece of work completes it: decode attention's
splits of a sequence, a split-K matmul's partial sums of a tile. Each program counts itself in with an atomic add;
the one that sees the count complete combines the others' results and zeroes the counter for the next call.

Two launches of one kernel must not overlap, as they do not on one stream: a kernel launched with programmatic
dependent launch touches its counters only after `pdl.wait_for_previous`."""
import torch

_counters: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def arrival_counters(kernel: str, device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed int32 counters on `device` for `kernel`'s launches, which leave them zeroed. Made
    outside any CUDA graph capture (a graph's first, eager pass makes them) and never freed: a captured graph
    keeps the address it was given."""
    made = _counters.setdefault((kernel, device), [])
    if not made or made[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{kernel}'s arrival counters must be made before a CUDA graph captures it: call it "
                               "once outside the capture at the largest launch first")
        made.append(torch.zeros(max(count, 8192), dtype=torch.int32, device=device))
    return made[-1]
