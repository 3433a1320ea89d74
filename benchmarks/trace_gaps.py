"""Where a decode step's device time goes between kernels, from a Chrome trace of a single sequence
(`profile_engine --parts single_sequence_trace`, or `benchmarks/trace_single.py` for another tree):
per step, the kernels' own time, the idle time between them inside the step, and the time between steps.

    python -m benchmarks.trace_gaps TRACE.json.gz [TRACE.json.gz ...]
"""
import argparse
import gzip
import json
import statistics

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def decode_steps(path: str) -> list[list[dict]]:
    """The device events of each decode step: a step begins with its input upload (a host-to-device copy)."""
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in DEVICE_EVENTS and "dur" in e]
    events.sort(key=lambda e: e["ts"])
    steps, current = [], []
    for event in events:
        if event["name"].startswith("Memcpy HtoD") and current:
            steps.append(current)
            current = []
        current.append(event)
    steps.append(current)
    typical = statistics.median(len(step) for step in steps)
    return [step for step in steps if len(step) == typical][2:-1]  # decode steps, not the prefill or the last


def end(event: dict) -> float:
    return event["ts"] + event["dur"]


def summary(path: str) -> dict:
    steps = decode_steps(path)
    inside = [[b["ts"] - end(a) for a, b in zip(step, step[1:])] for step in steps]
    return dict(steps=len(steps), kernels_per_step=len(steps[0]),
                kernel_us=round(statistics.median(sum(e["dur"] for e in step) for step in steps), 1),
                gaps_inside_us=round(statistics.median(sum(g) for g in inside), 1),
                median_gap_us=round(statistics.median(g for gaps in inside for g in gaps), 3),
                between_steps_us=round(statistics.median(b[0]["ts"] - end(a[-1]) for a, b in zip(steps, steps[1:])), 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    for path in parser.parse_args().traces:
        print(path, json.dumps(summary(path)))


if __name__ == "__main__":
    main()
