"""What a harness call leaves in --out: its own folder (results.jsonl, table.md, logs/, profiles/), the
table's header lines, and flat copies and one archive beside the folder for machines that return few files."""
import argparse
import json
import shlex
import shutil
import tarfile
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.plan import Engine, Group
from benchmarks.report import machine
from benchmarks.run_one import git_commit


def make_out_dir(parent: str) -> Path:
    """A new folder for this call's results: harness-<UTC time> under `parent`."""
    out = Path(parent) / datetime.now(timezone.utc).strftime("harness-%Y%m%d-%H%M%S")
    for sub in ("logs", "profiles"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    return out


def header(args: argparse.Namespace, argv: list[str], engines: list[Engine], groups: list[Group], model: str,
           gpu_ids: list[str] | None, results: list[dict]) -> list[str]:
    lines = [f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", f"machine: {machine(results)}"]
    for engine in engines:
        commit = git_commit(engine.folder) or "not a git checkout"
        extra = f", extra engine args {json.dumps(engine.extra_args)}" if engine.extra_args else ""
        lines.append(f"{engine.label}: {engine.folder} ({commit}){extra}")
    order = "concurrent on two GPUs (below)" if gpu_ids and len(engines) == 2 else "interleaved (A B, B A, ...)"
    lines += [f"model: {model}", f"command: python -m benchmarks.harness {shlex.join(argv)}",
              f"runs: {args.runs} per engine and workload, {order}, each a new process; scale {args.scale:g}"]
    if gpu_ids:
        lines.append(concurrency_note(engines, gpu_ids))
    elif args.parallel_gpus:
        lines.append("--parallel-gpus: fewer than 2 GPUs visible, so the runs went one at a time")
    if args.group:
        lines.append("grouped: the workloads of a group share one process per engine and run, which starts the "
                     "engine once, so each shows that process's import and start-up; groups: "
                     + " | ".join(", ".join(w.name for w in group.workloads) for group in groups))
    return lines + window_notes(args, groups) + sampling_notes(args, engines)


def window_notes(args: argparse.Namespace, groups: list[Group]) -> list[str]:
    if args.max_model_len is None:
        return []
    lines = [f"max_model_len: {args.max_model_len} for every workload and engine (--max-model-len)"]
    for workload in (w for group in groups for w in group.workloads):
        if workload.longest_request > args.max_model_len:
            lines.append(f"{workload.name}: its longest request (prompt and output) is {workload.longest_request:,} "
                         f"tokens, more than max_model_len {args.max_model_len}, which an engine may refuse")
    return lines


def sampling_notes(args: argparse.Namespace, engines: list[Engine]) -> list[str]:
    if args.sampling == ["plain"]:
        return []
    others = ", ".join(e.label for e in engines if e.sampling == ["plain"])
    return [f"sampling: {', '.join(args.sampling)} on {engines[0].label}, each workload's variants in turn in "
            f"one process per run, each warmed up then timed" + (f"; {others} ran plain only" if others else "")]


def concurrency_note(engines: list[Engine], gpu_ids: list[str]) -> str:
    first, second = gpu_ids
    alone = f"workloads needing 2 GPUs ran one process at a time on GPUs {first},{second}"
    if len(engines) == 1:
        return (f"--parallel-gpus with one engine: {engines[0].label} ran on GPU {first} in odd runs and "
                f"{second} in even ones, one process at a time; {alone}")
    return (f"concurrent on two GPUs: the engines' runs of a repetition ran at the same time, each in its own "
            f"process pinned with CUDA_VISIBLE_DEVICES ({engines[0].label} on GPU {first} and {engines[1].label} "
            f"on GPU {second} in run 1, swapped every run); {alone}, interleaved (A B, B A, ...)")


def pack(out: Path) -> Path:
    """Copy table.md and results.jsonl flat into out's parent (the --out folder) and write one .tar.gz of
    the whole of `out` beside them, for a machine that returns few files from few folder levels (the GPU
    machine: 8 files, 2 folders down)."""
    for name in ("table.md", "results.jsonl"):
        if (out / name).exists():
            shutil.copyfile(out / name, out.parent / name)
    archive = out.parent / f"{out.name}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    return archive
