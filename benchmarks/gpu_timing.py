"""Device time of work replayed from a CUDA graph, as the engine's decode steps run: no host launch cost counts."""
import torch

COLD_BYTES = 256 << 20  # weight copies no L2 cache holds: a call on the next copy reads its weight from memory


def graph_us(calls: list, replays: int = 5) -> float:
    """Mean device time in µs of one of `calls`, all of them captured in turn in one CUDA graph and replayed
    `replays` times after one untimed replay; each distinct call is made once before the capture, where Triton
    compiles and the engine's kernels make their scratch."""
    for call in dict.fromkeys(calls):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / replays / len(calls)
