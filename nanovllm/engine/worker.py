"""A tensor-parallel rank's process: spawned by MultiprocExecutor (`executor.py`), it joins the process
group, builds its ModelRunner, and runs every call the engine sends through the CallChannel until "exit";
rank 0 also sends each step's output back up a pipe. It exits with the engine's process, removing the
shared memory and the rendezvous folder, and reports a failure's traceback before it dies.
"""
import os
import queue
import shutil
import sys
import threading
import traceback
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.engine.async_output import AsyncStepOutput
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.rpc import CallChannel, overflow_name

RENDEZVOUS_TIMEOUT_S = 120


def run_worker(config: Config, rank: int, rendezvous_dir: str, shm_name: str, ready: list, taken: list,
               status: Connection, results: Connection | None):
    """Entry point of a spawned rank: say hello, join the process group, build the model, then serve
    the engine's calls until "exit"; rank 0 sends each step's tokens up `results`. A failure's traceback
    goes up `status` before the worker dies."""
    exit_with_parent(shm_name, rendezvous_dir)
    try:
        status.send(("hello",))
        init_process_group(config, rank, rendezvous_dir)
        runner = ModelRunner(config, rank)
        status.send(("ready", runner.num_kvcache_blocks))
        channel = CallChannel(shm_name, ready, taken, create=False)
        sender = ResultSender(results, lambda: report_failure_and_exit(rank, status)) if results is not None else None
        parent = mp.parent_process()
        while True:
            method_name, args = channel.receive(rank, parent.is_alive)
            if method_name == "exit":
                break
            output = getattr(runner, method_name)(*args)
            if sender is not None and output is not None:  # a step's tokens
                sender.put(output)
        if sender is not None:
            sender.close()
        runner.exit()
        channel.close()
        dist.destroy_process_group()
    except BaseException:
        report_failure_and_exit(rank, status)
    finally:
        status.close()


_reporting = threading.Lock()


def report_failure_and_exit(rank: int, status: Connection):
    """Send the exception being handled up `status` and end the process at once: an interpreter
    shutdown would wait on this rank's NCCL state. The first thread to fail reports. A ValueError's
    text goes too, and only there, so that the engine raises the error a user gets at
    tensor_parallel_size 1 (a checkpoint the loader refuses, say), not a worker's traceback."""
    with _reporting:
        report, error = traceback.format_exc(), sys.exc_info()[1]
        refusal = str(error) if isinstance(error, ValueError) else None
        if refusal is None:
            print(f"nano-vllm tensor-parallel rank {rank} failed:\n{report}", file=sys.stderr, flush=True)
        status.send(("error", report, refusal))
        os._exit(1)


class ResultSender:
    """Rank 0's thread that sends each step's output to the engine as soon as the device has produced
    it, while the worker's main thread goes on to launch the next step."""

    STOP = object()

    def __init__(self, pipe: Connection, on_failure):
        self.pipe, self.on_failure = pipe, on_failure
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._send, name="nanovllm-results", daemon=True)
        self.thread.start()

    def _send(self):
        try:
            while (output := self.outputs.get()) is not self.STOP:
                self.pipe.send(output.result())
        except BaseException:
            self.on_failure()

    def put(self, output: AsyncStepOutput):
        self.outputs.put(output)

    def close(self):
        """Stop after sending the outputs already put, waiting at most a second: at exit the engine no
        longer reads them, and a pipe it does not drain must not hold this worker up."""
        self.outputs.put(self.STOP)
        self.thread.join(timeout=1)


def exit_with_parent(shm_name: str, rendezvous_dir: str):
    """Exit, removing the engine's shared memory and rendezvous folder, as soon as the process that
    spawned this one dies."""
    parent = mp.parent_process()

    def watch():
        wait([parent.sentinel])
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
        for name in (shm_name, overflow_name(shm_name)):
            try:
                SharedMemory(name=name).unlink()
            except FileNotFoundError:
                pass
        os._exit(1)

    threading.Thread(target=watch, name="nanovllm-parent-watch", daemon=True).start()


LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
                # rank failures are handled by MultiprocExecutor's watchdog; NCCL's own handler would kill the process
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def init_process_group(config: Config, rank: int, rendezvous_dir: str):
    """Meet the other ranks through a file in the private folder. The ranks have all started by then,
    so the meeting takes seconds; RENDEZVOUS_TIMEOUT_S only ends the wait for one that died meanwhile."""
    cuda = config.device == "cuda"
    store = dist.FileStore(os.path.join(rendezvous_dir, "store"), config.tensor_parallel_size)
    store.set_timeout(timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    with environment(LOOPBACK_ENV):
        dist.init_process_group("nccl" if cuda else "gloo", store=store, world_size=config.tensor_parallel_size,
                                rank=rank, device_id=torch.device("cuda", rank) if cuda else None)


@contextmanager
def environment(values: dict[str, str]):
    """Set the variables the user has not set, for the duration of the block."""
    added = {name: value for name, value in values.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
