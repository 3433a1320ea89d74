"""A run's process: its environment, its time limit and the cleanup after it; several may run at once."""
import json
import os
import signal
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

# The original nano-vllm's tensor-parallel runs use this fixed shared-memory name; a crashed run leaves
# it behind, and the next one's SharedMemory(create=True) then fails.
ORIGINAL_SHM = "/dev/shm/nanovllm"


def remove_stale_original_shm():
    """Remove the original's shared memory if it exists and no process maps it."""
    if os.path.exists(ORIGINAL_SHM) and not any_process_maps(ORIGINAL_SHM):
        print(f"removing stale {ORIGINAL_SHM}", flush=True)
        try:
            os.unlink(ORIGINAL_SHM)
        except OSError as error:  # another user's: the run will report the failure it causes
            print(f"could not remove {ORIGINAL_SHM}: {error}", flush=True)


def any_process_maps(path: str) -> bool:
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if any(line.rstrip("\n").endswith(" " + path) for line in maps.open()):
                return True
        except OSError:  # the process ended, or is not ours to read
            continue
    return False


def child_env(engine_folder: str, gpus: str | None = None) -> dict:
    """The environment with the engine's folder first on PYTHONPATH, so the child imports its nanovllm;
    with `gpus` (e.g. "1" or "0,1"), CUDA_VISIBLE_DEVICES set to them."""
    paths = [engine_folder] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


@dataclass
class Child:
    command: list[str]
    env: dict
    log_path: Path


def run_children(children: list[Child], timeout: float) -> list[int | None]:
    """Starts the children together and returns each one's exit code, or None when it had not ended
    `timeout` seconds after the start. Each child's whole process group (tensor-parallel workers included)
    is killed once it has ended, timed out, or the harness is interrupted, so nothing is left behind."""
    with ExitStack() as cleanup:
        processes = []
        for child in children:
            log = cleanup.enter_context(child.log_path.open("w"))
            process = subprocess.Popen(child.command, stdout=log, stderr=subprocess.STDOUT, env=child.env,
                                       start_new_session=True)
            cleanup.callback(reap, process)
            processes.append(process)
        deadline = time.monotonic() + timeout
        codes = []
        for process in processes:
            codes.append(wait_until(process, deadline))
            reap(process)
        return codes


def wait_until(process: subprocess.Popen, deadline: float) -> int | None:
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def reap(process: subprocess.Popen):
    kill_group(process.pid)
    process.wait()


def kill_group(pgid: int):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_results(log_path: Path) -> dict[tuple[str, str], dict]:
    """The JSON lines the child printed, by workload and sampling variant (the last line of each)."""
    results = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(result, dict) and "workload" in result:
                results[result["workload"], result.get("sampling", "plain")] = result
    return results


def last_line(log_path: Path) -> str:
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"
