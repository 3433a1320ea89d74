"""The harness's markdown report: each engine's runs per workload, their medians, the ratio of the first
engine's median to the second's, and the medians of start-up, memory and step counts, all of plain
sampling; then, with --sampling, each variant's runs on the first engine and their ratio to plain's."""
import os
from statistics import median

NONE = "-"
# (column, result key, how to show it); medians over an engine's successful runs of a workload.
DETAILS = [
    ("start-up s", "startup_seconds", lambda x: f"{x:.1f}"),
    ("import s", "import_seconds", lambda x: f"{x:.1f}"),
    ("generate s", "seconds", lambda x: f"{x:.2f}"),
    ("ms per output token", "ms_per_output_token", lambda x: f"{x:.3g}"),
    ("steps", "num_steps", lambda x: f"{x:,.0f}"),
    ("in step s", "step_seconds", lambda x: f"{x:.2f}"),
    ("peak GPU reserved GiB", "peak_reserved_bytes", lambda x: f"{x / 2**30:.1f}"),
    ("peak GPU allocated GiB", "peak_allocated_bytes", lambda x: f"{x / 2**30:.1f}"),
]


def format_tok_s(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def format_ratio(x: float) -> str:
    return f"{x:.3f}"


def format_report(results: list[dict], header: list[str], labels: list[str]) -> str:
    plain = [r for r in results if sampling_of(r) == "plain"]
    sections = ["\n".join(f"- {line}" for line in header), throughput_table(plain, labels),
                details_table(plain, labels), sampling_table(results, labels), failures(results)]
    return "\n\n".join(section for section in sections if section) + "\n"


def sampling_of(result: dict) -> str:
    return result.get("sampling", "plain")


def task_label(result: dict) -> str:
    """The workload's name, with its sampling variant unless plain: "bench" or "bench (min_p)"."""
    variant = sampling_of(result)
    return result["workload"] if variant == "plain" else f"{result['workload']} ({variant})"


def describe(result: dict) -> str:
    """One line for a result as the harness gets it."""
    if result["status"] == "skipped":
        return f"[{task_label(result)}] skipped: {result['reason']}"
    where = f"[{task_label(result)} {result['run']}] {result['engine']}"
    if result.get("gpus") is not None:
        where += f" on GPU {result['gpus']}" + (", concurrently" if result["concurrent"] else "")
    if result["status"] == "failed":
        return f"{where}: failed, {result['error']} (log: {result['log']})"
    then = f"; then the process failed: {result['process_error']}" if "process_error" in result else ""
    return (f"{where}: {result['output_tok_per_s']:,.1f} output tok/s ({result['output_tokens']:,} tokens in "
            f"{result['seconds']:.2f} s), start-up {result['startup_seconds']:.1f} s{host_of(result)}{then}")


def host_of(result: dict) -> str:
    """Where the run's host loop ran (`host_threads.py`), where the run says."""
    host = result.get("host")
    if not host:
        return ""
    cpus = ",".join(f"{cpu}:{share:.0%}" for cpu, share in host["main_processors"].items())
    busiest = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in host["busiest_other_threads"].items())
    return (f"; main thread {host['main_cpu_s']:.2f} s CPU, {host['main_involuntary_switches']} involuntary "
            f"switches, on CPUs {cpus}; other threads {host['other_threads_cpu_s']:.2f} s ({busiest or 'none'})")


def workload_names(results: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["workload"] for r in results))


def runs_of(results: list[dict], workload: str, label: str, sampling: str = "plain") -> list[dict]:
    return [r for r in results if r["workload"] == workload and r.get("engine") == label and sampling_of(r) == sampling]


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r["status"] == "ok" and r.get(key) is not None]
    return median(values) if values else None


def show(value: float | None, fmt) -> str:
    return NONE if value is None else fmt(value)


def table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table; short rows are padded with empty cells."""
    lines = [head, ["---"] * len(head)] + [row + [""] * (len(head) - len(row)) for row in rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def throughput_table(results: list[dict], labels: list[str]) -> str:
    head = ["workload", "max_model_len", "output tokens"]
    for label in labels:
        head += [f"{label}: output tok/s", "median"]
    if len(labels) == 2:
        head.append(f"{labels[0]}/{labels[1]}")
    return table(head, [throughput_row(results, name, labels) for name in workload_names(results)])


def throughput_row(results: list[dict], workload: str, labels: list[str]) -> list[str]:
    first = next(r for r in results if r["workload"] == workload)
    row = [workload, window(results, workload, labels), f"{first['workload_output_tokens']:,}"]
    if first["status"] == "skipped":
        return row + [f"skipped: {first['reason']}"]
    medians = []
    for label in labels:
        runs = runs_of(results, workload, label)
        medians.append(median_of(runs, "output_tok_per_s"))
        row += [runs_cell(runs), show(medians[-1], format_tok_s)]
    if len(labels) == 2:
        row.append(format_ratio(medians[0] / medians[1]) if None not in medians else NONE)
    return row


def runs_cell(runs: list[dict]) -> str:
    return " / ".join(format_tok_s(r["output_tok_per_s"]) if r["status"] == "ok" else "failed" for r in runs)


def window(results: list[dict], workload: str, labels: list[str]) -> str:
    """The max_model_len the engines ran the workload with ("default": each engine's own, 4096 for both
    engines, capped at the model's max_position_embeddings); "this 8192, other default" where they differ."""
    def shown(result: dict) -> str:
        return f"{result['max_model_len']}" if result.get("max_model_len") is not None else "default"

    first = next(r for r in results if r["workload"] == workload)
    by_label = {label: shown(runs[0]) for label in labels if (runs := runs_of(results, workload, label))}
    if len(set(by_label.values())) > 1:
        return ", ".join(f"{label} {value}" for label, value in by_label.items())
    return shown(first)


def details_table(results: list[dict], labels: list[str]) -> str:
    rows = []
    for name in workload_names(results):
        for label in labels:
            runs = runs_of(results, name, label)
            if runs:
                rows.append([name, label] + [show(median_of(runs, key), fmt) for _, key, fmt in DETAILS])
    if not rows:
        return ""
    head = ["workload", "engine"] + [column for column, _, _ in DETAILS]
    return "Medians over each engine's successful runs:\n\n" + table(head, rows)


def sampling_table(results: list[dict], labels: list[str]) -> str:
    """With --sampling: each variant's runs on the first engine, their median, and its ratio to the median
    of plain's runs of the same engine and workload (which ran in the same processes)."""
    variants = list(dict.fromkeys(sampling_of(r) for r in results))
    if variants == ["plain"]:
        return ""
    label = labels[0]
    head = ["workload", "sampling", f"{label}: output tok/s", "median", "ratio to plain"]
    rows = []
    for name in workload_names(results):
        skipped = next((r for r in results if r["workload"] == name and r["status"] == "skipped"), None)
        if skipped:
            rows.append([name, ", ".join(variants), f"skipped: {skipped['reason']}"])
            continue
        plain = median_of(runs_of(results, name, label), "output_tok_per_s")
        for variant in variants:
            runs = runs_of(results, name, label, variant)
            tok_s = median_of(runs, "output_tok_per_s")
            ratio = format_ratio(tok_s / plain) if None not in (tok_s, plain) else NONE
            rows.append([name, variant, runs_cell(runs), show(tok_s, format_tok_s), ratio])
    note = f"Sampling variants, on {label} only"
    if len(labels) > 1:
        note += f" ({', '.join(labels[1:])} ran only plain: the table above)"
    return note + "; ratio: a variant's median over plain's, of the same processes:\n\n" + table(head, rows)


def failures(results: list[dict]) -> str:
    """Failed runs, and runs whose figures stand but whose process failed afterwards (in shut-down, say)."""
    lines = [f"- {r['engine']} {task_label(r)} run {r['run']}: {r['error']} (log: {r['log']})"
             for r in results if r["status"] == "failed"]
    lines += [f"- {r['engine']} {task_label(r)} run {r['run']}: ok, then the process failed: {r['process_error']} "
              f"(log: {r['log']})" for r in results if r["status"] == "ok" and "process_error" in r]
    return "Failed runs:\n\n" + "\n".join(lines) if lines else ""


def machine(results: list[dict]) -> str:
    """The GPUs and package versions the successful runs report."""
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return "unknown (no run succeeded)"
    first = ok[0]
    versions = {name: v for r in ok for name, v in r.get("versions", {}).items()}
    if "gpu" in first:
        # What a run sees: with --parallel-gpus each run is pinned to one GPU of the machine's.
        device = f"{first['num_gpus']}x {first['gpu']} ({first['total_gpu_memory_bytes'] / 2**20:.0f} MiB) per run"
    else:
        device = f"no GPU used, {os.cpu_count()} CPU cores"
    return ", ".join([device] + [f"{name} {v}" for name, v in sorted(versions.items())])
