import gc
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner, StepOutput, StepResult
from nanovllm.engine.rpc import CallChannel, WorkerGone
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_input import StepInput

WORKER_START_TIMEOUT_S = 600
WORKER_EXIT_TIMEOUT_S = 30
WAIT_POLL_S = 0.0002
RENDEZVOUS_TIMEOUT_S = 120
MAIN_GUARD_HINT = ("a script that creates an LLM with tensor_parallel_size > 1 must do so under "
                   "`if __name__ == '__main__':`, since each worker process re-imports the main module")


class Executor:
    """The model runners of every tensor-parallel rank: rank 0 runs in this process, ranks 1.. in
    spawned worker processes, which rank 0 drives through a CallChannel. At tensor_parallel_size 1
    there are neither workers nor a process group.

    A worker that dies, at start-up or during a step, is noticed at once: a watchdog thread waits on
    every worker's process sentinel and error pipe, records the failure (the worker's traceback, or
    its exit code), kills the other workers and aborts this process's NCCL communicators (gloo's
    collectives fail by themselves when a peer's socket closes). The next call raises the failure, and
    every rank is stopped: a process group that lost a member cannot be trusted again. No collective
    timeout is involved, so a long healthy step never trips one. Workers exit when this process dies,
    and remove the shared memory. Known gap (issue 9): under NCCL, a worker failing after rank 0 has
    launched a prefill leaves rank 0's thread inside a host-side NCCL launch and the abort never
    returns, so that case still hangs on GPUs.

    Ranks meet through a file store in a private temporary folder, and gloo's sockets and NCCL's
    bootstrap bind to the loopback interface: nothing the engine opens listens beyond this machine.
    """

    def __init__(self, config: Config, eos_token_ids: frozenset[int] = frozenset()):
        self.config = config
        self.workers: list[Worker] = []
        self.channel: CallChannel | None = None
        self.rendezvous_dir: str | None = None
        self.watchdog: Watchdog | None = None
        self.model_runner: ModelRunner | None = None
        self.failure: str | None = None
        if config.tensor_parallel_size > 1 and dist.is_initialized():
            raise RuntimeError("another nano-vllm engine with tensor_parallel_size > 1 is running in this process: "
                               "call its exit() (or `del` it) first")
        self.owns_process_group = False
        try:
            if config.tensor_parallel_size > 1:
                self._start_workers()
                init_process_group(config, 0, self.rendezvous_dir)
                self.owns_process_group = True
            self.model_runner = ModelRunner(config, 0, eos_token_ids)
            self._await_workers_built()
        except BaseException as error:
            self._stop(abort=True)
            if self.failure is not None:
                raise RuntimeError(self.failure) from error
            raise

    def _start_workers(self):
        self.rendezvous_dir = tempfile.mkdtemp(prefix="nanovllm-")
        ctx = mp.get_context("spawn")
        num_workers = self.config.tensor_parallel_size - 1
        ready, taken = [ctx.Semaphore(0) for _ in range(num_workers)], [ctx.Semaphore(1) for _ in range(num_workers)]
        shm_name = f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.channel = CallChannel(shm_name, ready, taken, create=True)
        for rank in range(1, self.config.tensor_parallel_size):
            receiver, sender = ctx.Pipe(duplex=False)
            process = ctx.Process(target=run_worker, name=f"nanovllm-rank{rank}",
                                  args=(self.config, rank, self.rendezvous_dir, shm_name, ready, taken, sender))
            process.start()
            sender.close()
            self.workers.append(Worker(rank, process, receiver))
        self._await_workers_started()
        self.watchdog = Watchdog(self.workers, self._on_worker_failure)

    def _await_workers_started(self):
        """Each worker says hello once it has imported the main module; a worker that dies first failed
        there, which is what a script without the main guard does."""
        waiting = {worker.pipe: worker for worker in self.workers}
        while waiting:
            sentinels = {worker.process.sentinel: worker for worker in waiting.values()}
            ready = wait([*waiting, *sentinels], timeout=WORKER_START_TIMEOUT_S)
            if not ready:
                raise RuntimeError(f"tensor-parallel workers did not start within {WORKER_START_TIMEOUT_S} s")
            for obj in ready:
                worker = waiting.get(obj) or sentinels[obj]
                message = worker.receive()
                if message is None:
                    worker.process.join()
                    raise RuntimeError(f"tensor-parallel rank {worker.rank} exited with code "
                                       f"{worker.process.exitcode} while starting: {MAIN_GUARD_HINT}")
                if message[0] == "error":
                    raise RuntimeError(f"tensor-parallel rank {worker.rank} failed while starting:\n{message[1]}")
                del waiting[worker.pipe]

    def _await_workers_built(self):
        """Every worker reports its KV-cache size once its model is built; all ranks must agree."""
        for worker in self.workers:
            while not worker.started.wait(timeout=0.1):
                self._raise_failure()
        sizes = self.num_kvcache_blocks_per_rank
        if len(set(sizes)) > 1:
            raise RuntimeError(f"the tensor-parallel ranks sized their KV caches differently: {sizes} blocks")

    @property
    def num_kvcache_blocks_per_rank(self) -> list[int]:
        return [self.model_runner.num_kvcache_blocks, *(worker.num_kvcache_blocks for worker in self.workers)]

    def _on_worker_failure(self, description: str):
        """From the watchdog thread: record the failure, end every worker (a group that lost a rank is out
        of step for good), then unblock any NCCL collective here."""
        self.failure = description
        for worker in self.workers:
            worker.process.kill()
        if self.config.device == "cuda" and self.owns_process_group:
            dist.distributed_c10d._abort_process_group()

    def _alive(self) -> bool:
        return self.failure is None

    def _raise_failure(self):
        if self.failure is not None:
            self._stop(abort=True)
            raise RuntimeError(f"the engine stopped after a worker failed; create a new LLM.\n{self.failure}")

    def execute_model(self, step: StepInput, sampled_seqs: list[Sequence]) -> StepOutput:
        """Launch a step on every rank; its sampled tokens come from `wait(output)`."""
        self._raise_failure()
        if self.channel is None:
            return self.model_runner.execute_model(step, sampled_seqs)
        try:
            self.channel.send(self._alive, "execute_model", step, None)
            return self.model_runner.execute_model(step, sampled_seqs)
        except Exception as error:
            self._fail(f"tensor-parallel rank 0 failed: {error!r}")
            raise

    def wait(self, output: StepOutput) -> StepResult:
        """The step's tokens. With workers, the wait watches for a failure too: a step whose collective
        waits on a dead rank may never finish on the device."""
        try:
            while self.channel is not None and not output.ready():
                self._raise_failure()
                time.sleep(WAIT_POLL_S)
            result = output.result()
        except Exception as error:
            if self.channel is None:
                raise
            self._fail(f"tensor-parallel rank 0 failed: {error!r}")
            raise
        self._raise_failure()
        return result

    def _fail(self, description: str):
        """A call failed with workers running: the ranks are out of step. Stop them all and raise the
        failure a dying worker reports (it is often the cause), else this one."""
        if self.watchdog is not None:
            self.watchdog.join(timeout=5)
        self.failure = self.failure or description
        self._raise_failure()

    @property
    def num_kvcache_blocks(self) -> int:
        return self.model_runner.num_kvcache_blocks

    def exit(self):
        """Stop every rank and release the processes, the shared memory, the rendezvous folder and the
        GPU memory. Safe to call more than once."""
        if self.watchdog is not None:
            self.watchdog.stop()  # workers are about to exit on purpose
            self.watchdog = None
        if self.channel is not None and self.failure is None:
            try:
                self.channel.send(self._alive, "exit")
            except WorkerGone:
                pass
        self._stop(abort=self.failure is not None)

    def _stop(self, abort: bool):
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.model_runner is not None:
            self.model_runner.exit(synchronize=not abort)  # after a failure the device may never finish
            self.model_runner = None
        if self.owns_process_group and dist.is_initialized():
            if abort and self.config.device == "cuda":
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        self.owns_process_group = False
        for worker in self.workers:
            worker.stop(timeout=0 if abort else WORKER_EXIT_TIMEOUT_S)
        self.workers = []
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            self.rendezvous_dir = None
        release_device_memory(self.config, empty_cache=not abort)


class Worker:
    """A spawned rank as rank 0 sees it: its process and the pipe its status comes up."""

    def __init__(self, rank: int, process, pipe: Connection):
        self.rank, self.process, self.pipe = rank, process, pipe
        self.started = threading.Event()  # set once the worker has built its model
        self.num_kvcache_blocks: int | None = None

    def receive(self) -> tuple | None:
        """A message from the worker, or None once it has died without one."""
        try:
            return self.pipe.recv() if self.pipe.poll() else None
        except (EOFError, OSError):
            return None

    def describe_failure(self, message: tuple | None) -> str:
        if message is not None and message[0] == "error":
            return f"tensor-parallel rank {self.rank} failed:\n{message[1]}"
        self.process.join(timeout=1)
        return f"tensor-parallel rank {self.rank} exited unexpectedly (exit code {self.process.exitcode})"

    def stop(self, timeout: float):
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.pipe.close()


class Watchdog:
    """A thread that waits on the workers' sentinels and pipes and reports the first failure."""

    def __init__(self, workers: list[Worker], on_failure):
        self.workers, self.on_failure = workers, on_failure
        self.wake_reader, self.wake_writer = mp.Pipe(duplex=False)
        self.thread = threading.Thread(target=self._watch, name="nanovllm-watchdog", daemon=True)
        self.thread.start()

    def _watch(self):
        objects = {self.wake_reader: None}
        for worker in self.workers:
            objects[worker.pipe] = objects[worker.process.sentinel] = worker
        while True:
            for obj in wait(list(objects)):
                worker = objects[obj]
                if worker is None:
                    return  # stopped
                message = worker.receive()  # a dying worker's traceback may come with its sentinel
                if message is not None and message[0] == "ready":
                    worker.num_kvcache_blocks = message[1]
                    worker.started.set()
                    continue
                self.on_failure(worker.describe_failure(message))
                return

    def join(self, timeout: float):
        self.thread.join(timeout)

    def stop(self):
        self.wake_writer.send(None)
        self.thread.join()
        self.wake_reader.close()
        self.wake_writer.close()


def run_worker(config: Config, rank: int, rendezvous_dir: str, shm_name: str, ready: list, taken: list,
               status: Connection):
    """Entry point of a spawned rank: say hello, join the process group, build the model, then serve
    rank 0's calls until "exit". A failure's traceback goes up `status` before the worker dies."""
    exit_with_parent(shm_name, rendezvous_dir)
    try:
        status.send(("hello",))
        init_process_group(config, rank, rendezvous_dir)
        runner = ModelRunner(config, rank)
        status.send(("ready", runner.num_kvcache_blocks))
        channel = CallChannel(shm_name, ready, taken, create=False)
        parent = mp.parent_process()
        while True:
            method_name, args = channel.receive(rank - 1, parent.is_alive)
            if method_name == "exit":
                break
            getattr(runner, method_name)(*args)
        runner.exit()
        channel.close()
        dist.destroy_process_group()
    except BaseException:
        report = traceback.format_exc()
        print(f"nano-vllm tensor-parallel rank {rank} failed:\n{report}", file=sys.stderr, flush=True)
        status.send(("error", report))
        os._exit(1)  # at once: an interpreter shutdown would wait on this rank's NCCL state
    finally:
        status.close()


def exit_with_parent(shm_name: str, rendezvous_dir: str):
    """Exit, removing the engine's shared memory and rendezvous folder, as soon as the process that
    spawned this one dies."""
    parent = mp.parent_process()

    def watch():
        wait([parent.sentinel])
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
        try:
            from multiprocessing.shared_memory import SharedMemory
            SharedMemory(name=shm_name).unlink()
        except FileNotFoundError:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="nanovllm-parent-watch", daemon=True).start()


LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
                # rank failures are handled by the Executor's watchdog; NCCL's own handler would kill the process
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


def release_device_memory(config: Config, empty_cache: bool):
    """Free what the engine held; giving cached blocks back to the driver waits for the device, which a
    failed rank may have left stuck (a later engine of this process reuses them anyway)."""
    gc.collect()
    if config.device == "cuda" and empty_cache:
        torch.cuda.empty_cache()
