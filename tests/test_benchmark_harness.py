"""The side-by-side harness (benchmarks/): its workloads, the interleaving, the table, failed and hung runs,
on two fake engines with the original nano-vllm's API and once on this engine on a CPU."""
import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import bench
from benchmarks import harness
from benchmarks.report import format_ratio, format_report, format_tok_s
from benchmarks.run_one import counting_steps
from benchmarks.workloads import SAMPLING_VARIANTS, make_workload

from conftest import read_jsonl

REPO_ROOT = Path(__file__).resolve().parents[1]

# The original's API (LLM(path, **kwargs), SamplingParams(temperature > 0, max_tokens, ignore_eos),
# generate(prompts, params, use_tqdm), dict outputs, exit) with no model: each step sleeps STEP_SECONDS.
# It logs what it was given, with its pid, the time and CUDA_VISIBLE_DEVICES; it fails on long_prompts
# (max_model_len=16384, scaled) if FAILS_ON_LONG_PROMPTS, hangs, after starting a process of its own, when
# FAKE_ENGINE_HANG names it, and fails in its Nth generate when FAKE_ENGINE_FAIL_GENERATE is "NAME:N". Its
# start-up sleeps FAKE_ENGINE_STARTUP_SECONDS, if set. With SAMPLING_KWARGS, SamplingParams also takes this
# engine's other arguments (logit_bias's keys must be ints) and generate logs them; without, it takes none.
FAKE_ENGINE = '''
import hashlib, json, os, subprocess, sys, time


def log(**event):
    with open(os.environ["FAKE_ENGINE_LOG"], "a") as f:
        f.write(json.dumps({"engine": NAME, "pid": os.getpid(), "time": time.time(),
                            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), **event}) + "\\n")


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=64, ignore_eos=False, **extra):
        assert temperature > 1e-10, "greedy sampling is not permitted"
        if extra and not SAMPLING_KWARGS:
            raise TypeError(f"unexpected keyword arguments {sorted(extra)}")
        assert all(isinstance(token, int) for token in extra.get("logit_bias", {})), "logit_bias takes token ids"
        self.temperature, self.max_tokens, self.ignore_eos, self.extra = temperature, max_tokens, ignore_eos, extra


class LLM:
    def __init__(self, model, **kwargs):
        log(event="init", kwargs=kwargs)
        time.sleep(float(os.environ.get("FAKE_ENGINE_STARTUP_SECONDS", "0")))
        if FAILS_ON_LONG_PROMPTS and kwargs.get("max_model_len") == 164:
            raise RuntimeError(NAME + " fails on long prompts")
        if os.environ.get("FAKE_ENGINE_HANG") == NAME:
            log(event="hang", pid=subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]).pid)
            time.sleep(300)

    def step(self):
        time.sleep(STEP_SECONDS)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.num_generates = getattr(self, "num_generates", 0) + 1
        if os.environ.get("FAKE_ENGINE_FAIL_GENERATE") == f"{NAME}:{self.num_generates}":
            raise RuntimeError(f"{NAME} fails in generate {self.num_generates}")
        for _ in range(max(sp.max_tokens for sp in sampling_params)):
            self.step()
        log(event="generate", prompts=hashlib.sha1(json.dumps(prompts).encode()).hexdigest(),
            max_tokens=[sp.max_tokens for sp in sampling_params],
            params={(sp.temperature, sp.ignore_eos) for sp in sampling_params}.pop(), use_tqdm=use_tqdm,
            extra=[sp.extra for sp in sampling_params])
        return [{"text": "", "token_ids": [7] * sp.max_tokens} for sp in sampling_params]

    def exit(self):
        log(event="exit")
'''


def write_fake_engine(folder: Path, name: str, step_seconds: float, fails_on_long_prompts: bool,
                      sampling_kwargs: bool) -> str:
    settings = (f"NAME = {name!r}\nSTEP_SECONDS = {step_seconds}\nFAILS_ON_LONG_PROMPTS = {fails_on_long_prompts}\n"
                f"SAMPLING_KWARGS = {sampling_kwargs}\n")
    (folder / "nanovllm").mkdir(parents=True)
    (folder / "nanovllm" / "__init__.py").write_text(settings + FAKE_ENGINE)
    return str(folder)


@pytest.fixture
def fake_engines(tmp_path, monkeypatch) -> tuple[str, str, Path]:
    """Engine A (1 ms a step, this engine's SamplingParams), engine B (10 ms a step, fails on long_prompts,
    the original's SamplingParams) and the log both append to."""
    log = tmp_path / "engines.log"
    monkeypatch.setenv("FAKE_ENGINE_LOG", str(log))
    monkeypatch.setattr(harness, "visible_gpus", lambda: 1)
    engine_a = write_fake_engine(tmp_path / "a", "A", 0.001, fails_on_long_prompts=False, sampling_kwargs=True)
    engine_b = write_fake_engine(tmp_path / "b", "B", 0.01, fails_on_long_prompts=True, sampling_kwargs=False)
    return engine_a, engine_b, log


def runs_in_log(log: Path) -> list[list[dict]]:
    """The log's events, one list per process (each starts with init), in the order the processes started;
    processes that ran at the same time may interleave their events in the log."""
    runs, by_pid = [], {}
    for event in read_jsonl(log):
        if event["event"] == "init":
            by_pid[event["pid"]] = []
            runs.append(by_pid[event["pid"]])
        by_pid[event["pid"]].append(event)
    return runs


def table_row(table: str, workload: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {workload} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_bench_workload_is_bench_py_s():
    prompts, params = bench.workload(argparse.Namespace(num_seqs=256, max_input_len=1024, max_output_len=1024))
    workload = make_workload("bench")
    assert workload.prompts == prompts
    assert workload.max_tokens == [sp.max_tokens for sp in params]
    assert workload.num_output_tokens == 133_966
    assert workload.engine_kwargs == {}  # bench.py's max_model_len=4096 is both engines' default


def test_scaled_workloads_keep_at_least_one_request_and_token():
    workload = make_workload("long_prompts", scale=0.01, vocab_size=512)
    assert len(workload.prompts) == 1  # 24 x 0.01 rounds to 0
    assert 60 <= len(workload.prompts[0]) <= 120
    assert max(workload.prompts[0]) < 512
    assert workload.engine_kwargs == {"max_model_len": 164}  # scaled too, for a small model
    assert make_workload("single", scale=0.001).max_tokens == [1]


def test_interleaved_runs_table_and_failures(tiny_gqa, fake_engines, tmp_path, capsys):
    engine_a, engine_b, log = fake_engines
    out = harness.main(["--model", tiny_gqa, "--engine", engine_a, "--other", engine_b,
                        "--workloads", "bench,long_prompts,single,bench_tp2", "--runs", "3", "--scale", "0.01",
                        "--extra-args", '{"device": "cpu"}', "--out", str(tmp_path / "results")])
    runs = runs_in_log(log)
    assert [run[0]["engine"] for run in runs] == list("ABBAAB") * 3
    bench_kwargs = [run[0]["kwargs"] for run in runs[:2]]
    assert bench_kwargs == [{"device": "cpu"}, {}]  # only the extra args
    assert [run[0]["kwargs"] for run in runs[6:8]] == [{"device": "cpu", "max_model_len": 164},
                                                       {"max_model_len": 164}]  # long_prompts' own, scaled
    assert [run[0]["kwargs"] for run in runs[12:14]] == [{"device": "cpu"}, {}]  # single: only the extra args

    bench_generates = [run[2] for run in runs[:6]]  # init, warm-up, timed generate, exit
    assert len({g["prompts"] for g in bench_generates}) == 1  # the same requests for both engines
    workload = make_workload("bench", 0.01, 512)
    assert all(g["max_tokens"] == workload.max_tokens and g["params"] == [0.6, True] and g["use_tqdm"] is False
               for g in bench_generates)
    assert all(run[-1]["event"] == "exit" for run in runs[:6])

    results = read_jsonl(out / "results.jsonl")
    bench_results = [r for r in results if r["workload"] == "bench"]
    assert [(r["engine"], r["run"]) for r in bench_results] == [("this", 1), ("other", 1), ("other", 2),
                                                                 ("this", 2), ("this", 3), ("other", 3)]
    for r in bench_results:
        assert r["status"] == "ok" and r["output_tokens"] == workload.num_output_tokens
        assert r["num_steps"] == max(workload.max_tokens) and 0 < r["step_seconds"] <= r["seconds"]
        assert r["engine_dir"] == (engine_a if r["engine"] == "this" else engine_b) and r["commit"] is None

    table = (out / "table.md").read_text()
    assert table in capsys.readouterr().out
    this = [r["output_tok_per_s"] for r in bench_results if r["engine"] == "this"]
    other = [r["output_tok_per_s"] for r in bench_results if r["engine"] == "other"]
    assert table_row(table, "bench") == [
        "bench", "default", f"{workload.num_output_tokens:,}",
        " / ".join(map(format_tok_s, this)), format_tok_s(sorted(this)[1]),
        " / ".join(map(format_tok_s, other)), format_tok_s(sorted(other)[1]),
        format_ratio(sorted(this)[1] / sorted(other)[1])]
    assert sorted(this)[1] > sorted(other)[1]  # A sleeps 1 ms a step, B 10 ms

    long_row = table_row(table, "long_prompts")
    assert long_row[1] == "164"  # its own max_model_len, scaled
    assert long_row[5:] == ["failed / failed / failed", "-", "-"]
    assert long_row[4] != "-"
    for run in (1, 2, 3):
        assert (f"- other long_prompts run {run}: exit code 1: RuntimeError: B fails on long prompts "
                f"(log: logs/long_prompts-other-{run}.log)") in table
    assert table_row(table, "bench_tp2") == ["bench_tp2", "default", "20", "skipped: needs 2 GPUs, 1 visible",
                                             "", "", "", ""]
    assert "max_model_len:" not in table and "Sampling variants" not in table
    assert f"other: {engine_b} (not a git checkout)" in table


def test_grouped_runs_share_one_process_per_group_and_run(tiny_gqa, fake_engines, tmp_path, monkeypatch):
    engine_a, engine_b, log = fake_engines
    monkeypatch.setenv("FAKE_ENGINE_FAIL_GENERATE", "B:3")  # many_short's warm-up, in every B process
    out = harness.main(["--model", tiny_gqa, "--engine", engine_a, "--other", engine_b, "--group",
                        "--workloads", "single,long_prompts,many_short,bench", "--runs", "2", "--scale", "0.01",
                        "--out", str(tmp_path / "results")])
    # Groups in WORKLOADS' order: bench, many_short and single take no engine arguments; long_prompts' own.
    runs = runs_in_log(log)
    assert [(run[0]["engine"], run[0]["kwargs"]) for run in runs] == [
        ("A", {}), ("B", {}), ("B", {}), ("A", {}),
        ("A", {"max_model_len": 164}), ("B", {"max_model_len": 164}),
        ("B", {"max_model_len": 164}), ("A", {"max_model_len": 164})]
    grouped = [make_workload(name, 0.01, 512) for name in ("bench", "many_short", "single")]
    each_warmed_up_then_timed = [tokens for w in grouped for tokens in ([w.warmup_max_tokens], w.max_tokens)]
    for run in runs[:4]:
        generated = [event["max_tokens"] for event in run if event["event"] == "generate"]
        if run[0]["engine"] == "A":
            assert generated == each_warmed_up_then_timed and run[-1]["event"] == "exit"
        else:
            assert generated == each_warmed_up_then_timed[:2]  # then fails in many_short's warm-up

    results = read_jsonl(out / "results.jsonl")
    assert [(r["workload"], r["engine"], r["run"], r["status"]) for r in results[:12]] == [
        (name, engine, run, "failed" if engine == "other" and name != "bench" else "ok")
        for engine, run in [("this", 1), ("other", 1), ("other", 2), ("this", 2)]
        for name in ("bench", "many_short", "single")]
    for r in results[:12]:
        assert r["process"] == f"bench.many_short.single-{r['engine']}-{r['run']}"
        assert r["log"] == f"logs/{r['process']}.log"
        assert r["group"] == ["bench", "many_short", "single"]
        assert r["position"] == r["group"].index(r["workload"]) + 1
        assert r["gpus"] is None and r["concurrent"] is False
    for process in {r["process"] for r in results[:12]}:
        ok = [r for r in results if r["process"] == process and r["status"] == "ok"]
        assert len({(r["startup_seconds"], r["import_seconds"]) for r in ok}) == 1  # one start-up, on each
    bench_b, many_short, single = results[3:6]
    assert "process_error" not in bench_b  # its figures stand: the process failed on a later workload
    assert many_short["error"] == "exit code 1: RuntimeError: B fails in generate 3"
    assert single["error"] == "not reached: the process failed on many_short first"
    assert [r["position"] for r in results[12:]] == [1] * 4 and results[12]["process"] == "long_prompts-this-1"

    table = (out / "table.md").read_text()
    assert [table_row(table, name)[0] for name in ("bench", "many_short", "single", "long_prompts")] == [
        "bench", "many_short", "single", "long_prompts"]
    assert table_row(table, "single")[5:] == ["failed / failed", "-", "-"]
    assert "groups: bench, many_short, single | long_prompts" in table
    assert ("- other single run 2: not reached: the process failed on many_short first "
            "(log: logs/bench.many_short.single-other-2.log)") in table


def test_parallel_gpus_option():
    def parallel_gpus(*option):
        return harness.parse_args(["--model", "M", *option]).parallel_gpus

    assert parallel_gpus() is None
    assert parallel_gpus("--parallel-gpus") == "auto"  # the first two visible, if there are two
    assert parallel_gpus("--parallel-gpus", "2,3") == ["2", "3"]
    for wrong in ("0", "0,0", "0,1,2", "0,"):
        with pytest.raises(SystemExit):
            parallel_gpus("--parallel-gpus", wrong)


def test_parallel_runs_pin_each_engine_to_one_gpu_and_swap(tiny_gqa, fake_engines, tmp_path, monkeypatch):
    engine_a, engine_b, log = fake_engines
    monkeypatch.setattr(harness, "visible_gpus", lambda: 2)  # so bench_tp2 runs; the GPU ids are forced
    monkeypatch.setenv("FAKE_ENGINE_STARTUP_SECONDS", "0.5")
    out = harness.main(["--model", tiny_gqa, "--engine", engine_a, "--other", engine_b, "--parallel-gpus", "0,1",
                        "--workloads", "single,bench_tp2", "--runs", "2", "--scale", "0.01",
                        "--out", str(tmp_path / "results")])
    runs = runs_in_log(log)
    single = [run for run in runs if run[0]["kwargs"] == {}]
    repetitions = [single[:2], single[2:]]
    for pair, gpus in zip(repetitions, [{"A": "0", "B": "1"}, {"A": "1", "B": "0"}]):
        assert {run[0]["engine"]: run[0]["gpus"] for run in pair} == gpus
        (start_1, end_1), (start_2, end_2) = [(run[0]["time"], run[-1]["time"]) for run in pair]
        assert max(start_1, start_2) < min(end_1, end_2)  # the two processes ran at the same time
    assert max(run[-1]["time"] for run in repetitions[0]) < min(run[0]["time"] for run in repetitions[1])

    tp2 = [run for run in runs if run[0]["kwargs"] == {"tensor_parallel_size": 2}]
    assert [run[0]["engine"] for run in tp2] == list("ABBA") and all(run[0]["gpus"] == "0,1" for run in tp2)
    assert all(earlier[-1]["time"] < later[0]["time"] for earlier, later in zip(tp2, tp2[1:]))  # one at a time

    results = read_jsonl(out / "results.jsonl")
    assert [(r["workload"], r["engine"], r["run"], r["gpus"], r["concurrent"]) for r in results] == [
        ("single", "this", 1, "0", True), ("single", "other", 1, "1", True),
        ("single", "this", 2, "1", True), ("single", "other", 2, "0", True),
        ("bench_tp2", "this", 1, "0,1", False), ("bench_tp2", "other", 1, "0,1", False),
        ("bench_tp2", "other", 2, "0,1", False), ("bench_tp2", "this", 2, "0,1", False)]
    assert all(r["status"] == "ok" for r in results)
    table = (out / "table.md").read_text()
    assert "runs: 2 per engine and workload, concurrent on two GPUs (below), each a new process" in table
    assert ("concurrent on two GPUs: the engines' runs of a repetition ran at the same time, each in its own "
            "process pinned with CUDA_VISIBLE_DEVICES (this on GPU 0 and other on GPU 1 in run 1, swapped every "
            "run); workloads needing 2 GPUs ran one process at a time on GPUs 0,1") in table
    assert "skipped" not in table


def test_the_output_folder_is_archived_beside_flat_copies(tiny_gqa, fake_engines, tmp_path):
    engine_a, engine_b, _ = fake_engines
    parent = tmp_path / "results"
    out = harness.main(["--model", tiny_gqa, "--engine", engine_a, "--other", engine_b, "--group", "--profile",
                        "--parallel-gpus", "0,1", "--workloads", "bench,single", "--runs", "1", "--scale", "0.01",
                        "--out", str(parent)])
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        [out.name, f"{out.name}.tar.gz", "results.jsonl", "table.md"])
    assert (parent / "table.md").read_text() == (out / "table.md").read_text()
    assert (parent / "results.jsonl").read_text() == (out / "results.jsonl").read_text()
    with tarfile.open(parent / f"{out.name}.tar.gz") as tar:
        names = set(tar.getnames())
        log = tar.extractfile(f"{out.name}/logs/bench.single-this-1.log").read().decode()
    assert {f"{out.name}/{name}" for name in ("results.jsonl", "table.md", "logs/bench.single-this-1.log",
                                                "logs/bench.single-other-1.log", "profiles/bench-this-1.prof",
                                                "profiles/single-other-1.prof.txt")} <= names
    assert [json.loads(line)["workload"] for line in log.splitlines() if line.startswith("{")] == ["bench", "single"]


def process_is_gone(pid: int) -> bool:
    """True once the process has exited (a zombie counts: it only waits to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_sleeper_is_killed(log: Path, message: str):
    """The process a hanging fake engine started is gone within 5 s (and killed here if not)."""
    sleeper = next(e["pid"] for e in read_jsonl(log) if e["event"] == "hang")
    try:
        deadline = time.monotonic() + 5
        while not process_is_gone(sleeper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_is_gone(sleeper), message
    finally:
        if not process_is_gone(sleeper):
            os.kill(sleeper, signal.SIGKILL)


def test_hung_run_is_killed_with_its_processes_and_reported(tiny_gqa, fake_engines, tmp_path, monkeypatch):
    engine_a, engine_b, log = fake_engines
    monkeypatch.setenv("FAKE_ENGINE_HANG", "B")
    start = time.perf_counter()
    out = harness.main(["--model", tiny_gqa, "--engine", engine_a, "--other", engine_b, "--workloads", "single",
                        "--runs", "1", "--scale", "0.01", "--run-timeout", "3", "--profile",
                        "--out", str(tmp_path / "results")])
    assert time.perf_counter() - start < 20
    assert_sleeper_is_killed(log, "the hung run's own process outlived the timeout")

    this, other = read_jsonl(out / "results.jsonl")
    assert this["status"] == "ok" and other["status"] == "failed"
    assert other["error"] == "timed out after 3 s"
    table = (out / "table.md").read_text()
    assert table_row(table, "single")[3:] == [format_tok_s(this["output_tok_per_s"])] * 2 + ["failed", "-", "-"]
    assert "- other single run 1: timed out after 3 s (log: logs/single-other-1.log)" in table
    assert this["profiled"] and "tottime" in (out / "profiles" / "single-this-1.prof.txt").read_text()
    assert (out / "profiles" / "single-this-1.prof").stat().st_size > 0


def test_terminated_harness_kills_its_runs_and_still_writes_table_and_archive(tiny_gqa, fake_engines, tmp_path):
    engine_a, engine_b, log = fake_engines
    parent = tmp_path / "results"
    harness_process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.harness", "--model", tiny_gqa, "--engine", engine_a, "--other", engine_b,
         "--workloads", "single", "--runs", "1", "--scale", "0.01", "--out", str(parent)],
        cwd=REPO_ROOT, env={**os.environ, "FAKE_ENGINE_HANG": "B"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not (log.exists() and any(e["event"] == "hang" for e in read_jsonl(log))):
            assert time.monotonic() < deadline and harness_process.poll() is None, "B never started hanging"
            time.sleep(0.05)
        harness_process.terminate()
        output = harness_process.communicate(timeout=10)[0].decode()
    finally:
        harness_process.kill()
    assert_sleeper_is_killed(log, "the running run's own process outlived the harness")
    assert harness_process.returncode == 1 and output.endswith(
        "interrupted: the table and the archive hold the runs that finished\n")
    [this] = read_jsonl(parent / "results.jsonl")
    assert this["engine"] == "this" and this["status"] == "ok"
    table = (parent / "table.md").read_text()
    assert "- interrupted: the table holds the runs that finished before" in table
    assert table_row(table, "single")[3] == format_tok_s(this["output_tok_per_s"])
    [archive] = parent.glob("harness-*.tar.gz")
    with tarfile.open(archive) as tar:
        assert any(name.endswith("/logs/single-other-1.log") for name in tar.getnames())


def test_this_engine_on_a_cpu(tiny_gqa, tmp_path):
    # Two workloads, not more: each run is a new process that imports torch (about 4 s here).
    out = harness.main(["--model", tiny_gqa, "--workloads", "bench,single", "--runs", "1",
                        "--scale", "0.01", "--extra-args", '{"device": "cpu", "kvcache_block_size": 16}',
                        "--out", str(tmp_path / "results")])
    results = read_jsonl(out / "results.jsonl")
    assert [(r["workload"], r["engine"], r["status"]) for r in results] == [
        ("bench", "this", "ok"), ("single", "this", "ok")]
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    for r in results:
        assert r["output_tokens"] == make_workload(r["workload"], 0.01, 512).num_output_tokens
        assert r["engine_dir"] == str(REPO_ROOT) and r["commit"].startswith(commit)
        assert r["engine_args"]["device"] == "cpu" and r["num_steps"] >= 1
    table = (out / "table.md").read_text()
    assert table_row(table, "single")[:3] == ["single", "default", "5"]


def test_step_counter_is_removed_after_its_workload():
    class Engine:
        def step(self):
            return "stepped"

    engine = Engine()
    with counting_steps(engine) as steps:
        assert engine.step() == "stepped" and engine.step() == "stepped"
    assert steps.num_steps == 2 and "step" not in vars(engine)  # the next workload wraps the method itself


def test_this_engine_grouped_on_a_cpu(tiny_gqa, tmp_path):
    out = harness.main(["--model", tiny_gqa, "--workloads", "bench,single", "--runs", "1", "--group",
                        "--scale", "0.01", "--extra-args", '{"device": "cpu", "kvcache_block_size": 16}',
                        "--out", str(tmp_path / "results")])
    bench_result, single_result = read_jsonl(out / "results.jsonl")
    assert [r["status"] for r in (bench_result, single_result)] == ["ok", "ok"]
    assert bench_result["process"] == single_result["process"] == "bench.single-this-1"
    assert bench_result["startup_seconds"] == single_result["startup_seconds"]
    for r in (bench_result, single_result):
        workload = make_workload(r["workload"], 0.01, 512)
        assert r["output_tokens"] == workload.num_output_tokens
        assert r["num_steps"] >= 1 and 0 < r["step_seconds"] <= r["seconds"]


def test_max_model_len_replaces_every_workload_s_own_as_given():
    assert make_workload("long_prompts", scale=0.01, max_model_len=40960).engine_kwargs == {"max_model_len": 40960}
    assert make_workload("bench", max_model_len=4096).engine_kwargs == {"max_model_len": 4096}
    assert make_workload("bench_tp2", 0.01, max_model_len=8192).engine_kwargs == {"tensor_parallel_size": 2,
                                                                                 "max_model_len": 8192}
    with pytest.raises(SystemExit):
        harness.parse_args(["--model", "M", "--max-model-len", "0"])


def test_max_model_len_reaches_both_engines_and_the_table(tiny_gqa, fake_engines, tmp_path, monkeypatch):
    engine_a, engine_b, log = fake_engines
    monkeypatch.setattr(harness, "visible_gpus", lambda: 2)  # so bench_tp2 runs
    out = harness.main(["--model", tiny_gqa, "--engine", engine_a, "--other", engine_b, "--group",
                        "--max-model-len", "100", "--workloads", "bench,long_prompts,single,bench_tp2", "--runs", "1",
                        "--scale", "0.01", "--extra-args", '{"device": "cpu"}', "--out", str(tmp_path / "results")])
    # One window for all: long_prompts joins the default-argument group; bench_tp2 keeps its own.
    assert [(run[0]["engine"], run[0]["kwargs"]) for run in runs_in_log(log)] == [
        ("A", {"max_model_len": 100, "device": "cpu"}), ("B", {"max_model_len": 100}),
        ("A", {"tensor_parallel_size": 2, "max_model_len": 100, "device": "cpu"}),
        ("B", {"tensor_parallel_size": 2, "max_model_len": 100})]
    results = read_jsonl(out / "results.jsonl")
    assert len(results) == 8 and all(r["status"] == "ok" and r["max_model_len"] == 100 for r in results)
    table = (out / "table.md").read_text()
    for name in ("bench", "long_prompts", "single", "bench_tp2"):
        assert table_row(table, name)[1] == "100"
    assert "- max_model_len: 100 for every workload and engine (--max-model-len)" in table
    long_prompts = make_workload("long_prompts", 0.01, 512, 100)
    assert long_prompts.longest_request > 100 and (
        f"- long_prompts: its longest request (prompt and output) is {long_prompts.longest_request:,} tokens, more "
        f"than max_model_len 100, which an engine may refuse") in table
    assert "- bench:" not in table  # its requests fit


def test_sampling_option():
    def sampling(*option):
        return harness.parse_args(["--model", "M", *option]).sampling

    assert sampling() == ["plain"]
    assert sampling("--sampling", "min_p,plain,seed") == ["plain", "min_p", "seed"]  # plain first, the denominator
    with pytest.raises(SystemExit):
        sampling("--sampling", "plain,top_q")
    assert "sampling" not in harness.parse_args(["--model", "M"]).workloads  # the default workloads are the six


def test_sampling_variants_run_in_one_process_on_this_engine_only(tiny_gqa, fake_engines, tmp_path):
    engine_a, engine_b, log = fake_engines
    variants = ["plain", "logit_bias", "seed", "bad_words"]
    out = harness.main(["--model", tiny_gqa, "--engine", engine_a, "--other", engine_b,
                        "--workloads", "sampling,single", "--sampling", "logit_bias,seed,bad_words", "--runs", "2",
                        "--scale", "0.01",
                        "--out", str(tmp_path / "results")])
    runs = runs_in_log(log)
    assert [run[0]["engine"] for run in runs] == list("ABBAABBA")  # one process per engine, workload and run
    workloads = {name: make_workload(name, 0.01, 512) for name in ("sampling", "single")}
    logit_bias = {str(i * 8): 1.5 for i in range(64)}  # 64 ids spread over the 512 of the vocabulary (JSON keys)
    expected = {"plain": lambda i: {}, "logit_bias": lambda i: {"logit_bias": logit_bias},
                "seed": lambda i: {"seed": i}, "bad_words": lambda i: {"bad_words": ["hello", "world", " the", " of"]}}
    plain_prompts = {"A": set(), "B": set()}
    for run, workload in zip(runs, [workloads["sampling"]] * 4 + [workloads["single"]] * 4):
        generates = [event for event in run if event["event"] == "generate"]
        names = variants if run[0]["engine"] == "A" else ["plain"]  # B takes no more than plain's arguments
        assert len(generates) == 2 * len(names) and run[-1]["event"] == "exit"
        warmups, timed = generates[::2], generates[1::2]
        for variant, warmup, generate in zip(names, warmups, timed):
            assert warmup["extra"] == [expected[variant](0)]  # each variant warms up with its own arguments
            assert generate["max_tokens"] == workload.max_tokens
            assert generate["extra"] == [expected[variant](i) for i in range(len(workload.prompts))]
        # Each variant relabels the prompts, so it finds none of an earlier variant's blocks; plain's are B's.
        assert len({generate["prompts"] for generate in timed}) == len(names)
        plain_prompts[run[0]["engine"]].add(timed[0]["prompts"])
    assert plain_prompts["A"] == plain_prompts["B"] and len(plain_prompts["A"]) == 2

    results = read_jsonl(out / "results.jsonl")
    assert [(r["workload"], r["sampling"], r["engine"], r["run"]) for r in results[:10]] == [
        ("sampling", variant, "this", 1) for variant in variants] + [("sampling", "plain", "other", 1)] + [
        ("sampling", "plain", "other", 2)] + [("sampling", variant, "this", 2) for variant in variants]
    assert all(r["status"] == "ok" for r in results)
    assert {r["process"] for r in results if r["engine"] == "this" and r["workload"] == "single"} == {
        "single-this-1", "single-this-2"}

    table = (out / "table.md").read_text()
    assert len(table_row(table, "sampling")) == 8 and "| sampling | plain |" in table  # the first table: plain

    def tok_s(workload, variant):
        return [r["output_tok_per_s"] for r in results
                if (r["workload"], r["sampling"], r["engine"]) == (workload, variant, "this")]

    lines = table.splitlines()
    for workload in ("sampling", "single"):
        plain = sum(tok_s(workload, "plain")) / 2  # the median of two runs
        for variant in variants:
            line = next(line for line in lines if line.startswith(f"| {workload} | {variant} |"))
            this = tok_s(workload, variant)
            assert [cell.strip() for cell in line.strip("|").split("|")] == [
                workload, variant, " / ".join(map(format_tok_s, this)), format_tok_s(sum(this) / 2),
                format_ratio(sum(this) / 2 / plain)]
    assert ("Sampling variants, on this only (other ran only plain: the table above); ratio: a variant's median "
            "over plain's, of the same processes:") in table
    assert ("- sampling: plain, logit_bias, seed, bad_words on this, each workload's variants in turn in one process "
            "per run, each warmed up then timed; other ran plain only") in table


def test_sampling_table_gives_each_variant_s_median_and_its_ratio_to_plain():
    def run(variant, tok_s, engine="this"):
        status = {"status": "failed", "error": "boom", "run": 2, "log": "x.log"} if tok_s is None else {
            "status": "ok", "output_tok_per_s": tok_s}
        return {"workload": "sampling", "sampling": variant, "engine": engine, "workload_output_tokens": 9,
                "max_model_len": 4096, **status}

    results = [run("plain", 100), run("plain", 120), run("plain", 110), run("min_p", 50), run("min_p", None),
               run("min_p", 70), run("plain", 90, "other")] + [
        {"workload": "bench_tp2", "sampling": variant, "status": "skipped", "reason": "needs 2 GPUs, 1 visible",
         "workload_output_tokens": 20, "max_model_len": None} for variant in ("plain", "min_p")]
    table = format_report(results, [], ["this", "other"])
    assert table_row(table, "sampling") == ["sampling", "4096", "9", "100 / 120 / 110", "110", "90", "90", "1.222"]
    assert "| sampling | plain | 100 / 120 / 110 | 110 | 1.000 |" in table
    assert "| sampling | min_p | 50 / failed / 70 | 60 | 0.545 |" in table
    assert "| bench_tp2 | plain, min_p | skipped: needs 2 GPUs, 1 visible |  |  |" in table
    assert "- this sampling (min_p) run 2: boom (log: x.log)" in table


def test_this_engine_runs_every_sampling_variant_on_a_cpu(tiny_gqa, tmp_path):
    out = harness.main(["--model", tiny_gqa, "--workloads", "sampling", "--sampling", ",".join(SAMPLING_VARIANTS),
                        "--runs", "1", "--scale", "0.01", "--max-model-len", "256", "--extra-args",
                        '{"device": "cpu", "kvcache_block_size": 16}', "--out", str(tmp_path / "results")])
    results = read_jsonl(out / "results.jsonl")
    assert [(r["sampling"], r["status"]) for r in results] == [(variant, "ok") for variant in SAMPLING_VARIANTS]
    assert len({r["process"] for r in results}) == 1  # one engine start-up for all nine
    for r in results:
        assert r["output_tokens"] == make_workload("sampling", 0.01, 512).num_output_tokens
        assert r["engine_args"]["max_model_len"] == 256 and r["max_model_len"] == 256
    table = (out / "table.md").read_text()
    assert all(f"| sampling | {variant} |" in table for variant in SAMPLING_VARIANTS)
