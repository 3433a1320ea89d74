"""Side-by-side benchmark: named workloads on this engine and, with --other, on another engine with the same API,
each run a new process, interleaved (A B, B A, ...) or with --parallel-gpus both at once on two GPUs; with
--group, workloads that need the same engine arguments share a process. Prints a table of each engine's runs,
their medians and the ratio, and writes results, logs and the table into a new folder in --out.

    python -m benchmarks.harness --random-checkpoint /tmp/q06 --other .device/reference/nano-vllm --group

benchmarks/README.md describes the workloads, what a run does and every option.
"""
import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.child import Child, child_env, last_line, read_results, remove_stale_original_shm, run_children
from benchmarks.output import header, make_out_dir, pack
from benchmarks.plan import Engine, Group, Process, Task, make_groups, schedule
from benchmarks.report import describe, format_report
from benchmarks.workloads import (
    DEFAULT_WORKLOADS,
    SAMPLING_VARIANTS,
    WORKLOADS,
    make_workload,
    request_file,
    vocab_size,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_ONE = Path(__file__).resolve().with_name("run_one.py")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="checkpoint folder")
    model.add_argument("--random-checkpoint", metavar="DIR",
                       help="a random bf16 Qwen3-0.6B-sized checkpoint, written into DIR unless it holds one")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="with --random-checkpoint: this tokenizer, its vocabulary the model's (e.g. SmolLM2's)")
    parser.add_argument("--engine", default=str(REPO_ROOT), help="the engine under test's folder (default: this repo)")
    parser.add_argument("--other", metavar="PATH", help="another engine's folder, e.g. .device/reference/nano-vllm")
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                        help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, metavar="N",
                        help="max_model_len=N for every workload and both engines, in place of a workload's own")
    parser.add_argument("--sampling", metavar="NAMES", default="plain",
                        help="sampling variants to run each workload with on the engine under test, plain first: "
                             f"{', '.join(SAMPLING_VARIANTS)}")
    parser.add_argument("--runs", type=int, default=3, help="runs per engine and workload")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrink request counts and lengths by this factor (at least 1 each), for smoke runs")
    parser.add_argument("--extra-args", type=json.loads, default={},
                        help='JSON engine arguments for the engine under test only, e.g. \'{"device": "cpu"}\'')
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds before a run's process is killed")
    parser.add_argument("--group", action="store_true",
                        help="workloads with the same engine arguments share one process per engine and run")
    parser.add_argument("--parallel-gpus", nargs="?", const="auto", metavar="IDS",
                        help="the engines' runs of a repetition at the same time, one GPU each, swapped every "
                             "repetition; IDS: the two GPUs (not checked), else the first two visible")
    parser.add_argument("--profile", action="store_true", help="run each timed generate under cProfile")
    parser.add_argument("--gap", type=float, default=0.0, metavar="S",
                        help="seconds to wait after each process ends before the next starts")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO_ROOT / "benchmarks" / "results"),
                        help="folder for results (default: $OUT if set, else benchmarks/results/)")
    args = parser.parse_args(argv)
    args.workloads = args.workloads.split(",")
    for name in args.workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if args.gap < 0:
        parser.error(f"--gap must be >= 0, got {args.gap}")
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error(f"--max-model-len must be >= 1, got {args.max_model_len}")
    args.sampling = list(dict.fromkeys(["plain", *args.sampling.split(",")]))
    for name in args.sampling:
        if name not in SAMPLING_VARIANTS:
            parser.error(f"unknown sampling variant {name!r}; known: {', '.join(SAMPLING_VARIANTS)}")
    if not isinstance(args.extra_args, dict):
        parser.error(f"--extra-args must be a JSON object, got {args.extra_args!r}")
    if args.parallel_gpus not in (None, "auto"):
        args.parallel_gpus = args.parallel_gpus.split(",")
        if len(args.parallel_gpus) != 2 or "" in args.parallel_gpus or len(set(args.parallel_gpus)) != 2:
            parser.error(f"--parallel-gpus takes two different GPU ids, e.g. 0,1; got {','.join(args.parallel_gpus)}")
    return args


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        path = os.path.abspath(os.path.expanduser(args.model))
        if not os.path.isdir(path):
            sys.exit(f"no checkpoint at {path}")
        return path
    from nanovllm.utils.checkpoint import random_checkpoint  # imports torch: only for a random checkpoint
    return random_checkpoint(os.path.abspath(args.random_checkpoint), tokenizer=args.tokenizer)


def visible_gpus() -> int:
    import torch
    return torch.cuda.device_count()


def parallel_gpu_ids(args: argparse.Namespace) -> list[str] | None:
    """The two GPUs of --parallel-gpus: as given, else the first two visible ones (as this process's
    CUDA_VISIBLE_DEVICES names them, the children's variable being read against the same physical GPUs);
    None without the option or with fewer than 2 GPUs visible."""
    if args.parallel_gpus != "auto":
        return args.parallel_gpus
    if visible_gpus() < 2:
        print(f"--parallel-gpus: {visible_gpus()} GPU(s) visible, so the runs go one at a time", flush=True)
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[:2] if visible else ["0", "1"]


def write_requests(task: Task, vocab_size: int, folder: str) -> str:
    path = os.path.join(folder, f"{task.name}.json")
    with open(path, "w") as f:
        json.dump(request_file(task.workload, task.sampling, vocab_size), f)
    return path


class Harness:
    """Runs the groups of workloads on the engines as plan.schedule orders them; logs go into `out`."""

    def __init__(self, args: argparse.Namespace, engines: list[Engine], groups: list[Group], model: str, out: Path,
                 gpu_ids: list[str] | None):
        self.args, self.engines, self.groups, self.model, self.out = args, engines, groups, model, out
        self.gpu_ids = gpu_ids
        self.vocab_size = vocab_size(model)
        self.results: list[dict] = []  # so far, also when interrupted

    def run_all(self) -> list[dict]:
        with tempfile.TemporaryDirectory() as scratch, (self.out / "results.jsonl").open("w") as jsonl:
            tasks = [Task(w, variant) for group in self.groups for w in group.workloads for variant in self.variants]
            requests = {task.key: write_requests(task, self.vocab_size, scratch) for task in tasks}
            for group in self.groups:
                num_output_tokens = {w.name: w.num_output_tokens for w in group.workloads}
                for result in self.run_group(group, requests):
                    result["workload_output_tokens"] = num_output_tokens[result["workload"]]
                    print(describe(result), flush=True)
                    jsonl.write(json.dumps(result) + "\n")
                    jsonl.flush()
                    self.results.append(result)
        return self.results

    @property
    def variants(self) -> list[str]:
        return list(dict.fromkeys(variant for engine in self.engines for variant in engine.sampling))

    def run_group(self, group: Group, requests: dict[tuple[str, str], str]) -> Iterator[dict]:
        reason = skip_reason(group)
        if reason:
            for workload in group.workloads:
                for variant in self.variants:
                    yield {"workload": workload.name, "sampling": variant, "status": "skipped", "reason": reason,
                           "max_model_len": group.engine_kwargs.get("max_model_len")}
            return
        for batch in schedule(self.engines, group, self.args.runs, self.gpu_ids):
            children = [self.child(process, requests) for process in batch]
            remove_stale_original_shm()
            exit_codes = run_children(children, self.args.run_timeout)
            time.sleep(self.args.gap)
            for process, child, exit_code in zip(batch, children, exit_codes):
                yield from self.results_of(process, child.log_path, exit_code, concurrent=len(batch) > 1)

    def child(self, process: Process, requests: dict[tuple[str, str], str]) -> Child:
        engine, tasks = process.engine, process.tasks
        command = [sys.executable, str(RUN_ONE), "--label", engine.label, "--engine-dir", engine.folder,
                   "--model", self.model, "--requests", *(requests[task.key] for task in tasks),
                   "--engine-args", json.dumps(process.engine_args)]
        if self.args.profile:
            profiles = self.out / "profiles"
            command += ["--profile-out", *(str(profiles / f"{task.name}-{engine.label}-{process.run + 1}.prof")
                                           for task in tasks)]
        return Child(command, child_env(engine.folder, process.gpus), self.out / "logs" / f"{process.name}.log")

    def results_of(self, process: Process, log_path: Path, exit_code: int | None, concurrent: bool) -> Iterator[dict]:
        """One result per task (workload and sampling variant) of the process: the line it printed, else a
        failure. A process that failed after printing every line (in shut-down, say) leaves its error on
        them as process_error. `position` is the workload's place in the group."""
        printed, tasks, workloads = read_results(log_path), process.tasks, [w.name for w in process.group.workloads]
        missing = [task for task in tasks if task.key not in printed]
        error = None if exit_code == 0 and not missing else self.process_error(exit_code, log_path)
        for task in tasks:
            result = printed.get(task.key)
            if result is None:
                not_reached = f"not reached: the process failed on {missing[0].label} first"
                result = {"engine": process.engine.label, "workload": task.workload.name, "status": "failed",
                          "error": error if task is missing[0] else not_reached}
            elif error and not missing:
                result["process_error"] = error
            result.setdefault("status", "ok")
            result.update(sampling=task.sampling, max_model_len=process.engine_args.get("max_model_len"),
                          position=workloads.index(task.workload.name) + 1)
            result.update(run=process.run + 1, log=str(log_path.relative_to(self.out)), process=process.name,
                          group=workloads,
                          gpus=process.gpus if process.gpus is not None else os.environ.get("CUDA_VISIBLE_DEVICES"),
                          concurrent=concurrent)
            yield result

    def process_error(self, exit_code: int | None, log_path: Path) -> str:
        if exit_code is None:
            return f"timed out after {self.args.run_timeout:g} s"
        return f"exit code {exit_code}: {last_line(log_path)}"


def skip_reason(group: Group) -> str | None:
    if group.num_gpus > 1 and visible_gpus() < group.num_gpus:
        return f"needs {group.num_gpus} GPUs, {visible_gpus()} visible"
    return None


def make_engines(args: argparse.Namespace) -> list[Engine]:
    engines = [Engine("this", os.path.abspath(args.engine), args.extra_args, args.sampling)]
    if args.other:  # only plain: the original's SamplingParams takes temperature, max_tokens and ignore_eos
        engines.append(Engine("other", os.path.abspath(args.other), {}))
    return engines


def main(argv: list[str] | None = None) -> Path:
    """Run the harness; returns the folder holding results.jsonl, table.md, logs/ and profiles/. The table,
    flat copies of it and of results.jsonl, and the archive are written also when it is interrupted."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model = model_path(args)
    engines = make_engines(args)
    workloads = [make_workload(name, args.scale, vocab_size(model), args.max_model_len) for name in args.workloads]
    groups = make_groups(workloads, args.group)
    out = make_out_dir(args.out)
    print(f"results go into {out}", flush=True)
    gpu_ids = parallel_gpu_ids(args)
    harness = Harness(args, engines, groups, model, out, gpu_ids)
    finished = False
    try:
        with terminate_as_interrupt():
            harness.run_all()
        finished = True
    finally:
        lines = header(args, argv, engines, groups, model, gpu_ids, harness.results)
        if not finished:
            lines.append("interrupted: the table holds the runs that finished before")
        report = format_report(harness.results, lines, [e.label for e in engines])
        (out / "table.md").write_text(report)
        print("\n" + report, end="")
        print(f"archive of {out.name}/: {pack(out)}", flush=True)
    return out


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a time limit's `timeout`) stops the harness as Ctrl-C does: the running children's process
    groups are killed, and the runs that finished still get their table and archive."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: the table and the archive hold the runs that finished")
