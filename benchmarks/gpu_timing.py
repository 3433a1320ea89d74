import torch


def mean_replay_ms(graph: torch.cuda.CUDAGraph, warmup: int, replays: int) -> float:
    """Mean device time of one replay of `graph`, after `warmup` untimed replays."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays
