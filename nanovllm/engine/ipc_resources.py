"""What a tensor-parallel engine shares with its workers through the operating system: the call channel's
shared-memory segment (and, during a large call, its overflow segment), the channel's semaphores, and the
folder where the ranks meet. The engine and its workers remove them as they exit; a kill -9 of the whole
process group leaves no one to, so each name carries the engine process's id, and every new engine first
sweeps what engines whose process is gone left behind. multiprocessing names the semaphores itself: their
names are written into the engine's folder.
"""
import _multiprocessing
import os
import re
import shutil
import tempfile
import uuid

PREFIX = "nanovllm-"
OWNED_NAME = re.compile(rf"{PREFIX}(\d+)-")
SHARED_MEMORY_FOLDER = "/dev/shm"  # where Linux lists the segments
SEMAPHORES_FILE = "semaphores"


def make_rendezvous_dir() -> str:
    """A private folder of this process's, after sweeping those of engines that died."""
    sweep_dead_engines()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def make_shm_name() -> str:
    return f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"


def record_semaphores(rendezvous_dir: str, semaphores: list):
    with open(os.path.join(rendezvous_dir, SEMAPHORES_FILE), "w") as f:
        f.write("\n".join(semaphore._semlock.name for semaphore in semaphores))


def sweep_dead_engines():
    """Remove the folders, semaphores and shared-memory segments of engine processes that no longer run."""
    temp = tempfile.gettempdir()
    for name in os.listdir(temp):
        if owner_is_gone(name):
            _remove_semaphores(os.path.join(temp, name))
            shutil.rmtree(os.path.join(temp, name), ignore_errors=True)
    if os.path.isdir(SHARED_MEMORY_FOLDER):
        for name in os.listdir(SHARED_MEMORY_FOLDER):
            if owner_is_gone(name):
                _remove(os.path.join(SHARED_MEMORY_FOLDER, name))  # what shm_unlink does on Linux


def owner_is_gone(name: str) -> bool:
    """Whether `name` is an engine's whose process no longer runs (a process of another user's still runs)."""
    match = OWNED_NAME.match(name)
    if match is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def _remove_semaphores(folder: str):
    try:
        with open(os.path.join(folder, SEMAPHORES_FILE)) as f:
            names = f.read().split()
    except OSError:
        return
    for name in names:
        try:
            _multiprocessing.sem_unlink(name)
        except OSError:
            pass


def _remove(path: str):
    try:
        os.remove(path)
    except OSError:
        pass
