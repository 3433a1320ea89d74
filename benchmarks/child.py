"""One run's process: its environment, its time limit and the cleanup after it."""
import json
import os
import signal
import subprocess
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


def child_env(engine_folder: str) -> dict:
    """The environment with the engine's folder first on PYTHONPATH, so the child imports its nanovllm."""
    paths = [engine_folder] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def run_child(command: list[str], env: dict, log_path: Path, timeout: float) -> int | None:
    """The child's exit code, or None when it timed out. Its whole process group (tensor-parallel workers
    included) is killed afterwards, so a crashed or hung run leaves nothing behind."""
    with log_path.open("w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            kill_group(child.pid)
            child.wait()


def kill_group(pgid: int):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_result(log_path: Path) -> dict | None:
    """The last JSON line the child printed."""
    for line in reversed(log_path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def last_line(log_path: Path) -> str:
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"
