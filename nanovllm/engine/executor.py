"""The engine's side of tensor parallelism: an executor runs the model's ranks and hands each step to them.
At tensor_parallel_size 1 the one rank runs in this process; above it every rank is a spawned process
(`worker.py`) that this side starts, watches and stops.
"""
import gc
import shutil
from multiprocessing.connection import Connection, wait

import torch
import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.engine.async_output import AsyncStepOutput
from nanovllm.engine.ipc_resources import make_rendezvous_dir, make_shm_name, record_semaphores
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.rpc import CallChannel, RemoteStepOutput, WorkerGone
from nanovllm.engine.step_io import GrammarMasks, StepInput, StepOutput
from nanovllm.engine.worker import run_worker
from nanovllm.engine.worker_handles import Watchdog, Worker

WORKER_START_TIMEOUT_S = 600
WORKER_EXIT_TIMEOUT_S = 30
RESULT_POLL_S = 0.05
MAIN_GUARD_HINT = ("a script that creates an LLM with tensor_parallel_size > 1 must do so under "
                   "`if __name__ == '__main__':`, since each worker process re-imports the main module")


def make_executor(config: Config) -> "LocalExecutor | MultiprocExecutor":
    return LocalExecutor(config) if config.tensor_parallel_size == 1 else MultiprocExecutor(config)


class LocalExecutor:
    """One rank, run in this process: no workers, no process group."""

    def __init__(self, config: Config):
        self.config = config
        self.model_runner: ModelRunner | None = ModelRunner(config, 0)

    @property
    def num_kvcache_blocks(self) -> int:
        return self.model_runner.num_kvcache_blocks

    @property
    def num_kvcache_blocks_per_rank(self) -> list[int]:
        return [self.num_kvcache_blocks]

    def execute_model(self, step: StepInput) -> AsyncStepOutput | None:
        """Launch a step; its sampled tokens come from `wait(output)`; None where it awaits its masks."""
        return self.model_runner.execute_model(step)

    def sample_tokens(self, masks: GrammarMasks | None) -> AsyncStepOutput:
        """Sample the step that awaits its masks."""
        return self.model_runner.sample_tokens(masks)

    def wait(self, output: AsyncStepOutput) -> StepOutput:
        return output.result()

    def exit(self):
        """Give back the GPU memory. Safe to call more than once."""
        if self.model_runner is not None:
            self.model_runner.exit()
            self.model_runner = None
        gc.collect()  # whatever of the model reference cycles still hold goes now, before the cache is emptied
        if self.config.device == "cuda":
            torch.cuda.empty_cache()  # give the cached blocks back to the driver, for other processes


class MultiprocExecutor:
    """Every tensor-parallel rank runs in a spawned worker process. This process sends each step to
    all of them through a CallChannel, and rank 0, which samples, sends the step's tokens back through
    a pipe. This process holds no GPU memory and no process group.

    A worker that dies, at start-up or during a step, is noticed at once: a watchdog thread waits on
    every worker's process sentinel and status pipe, records the failure (the worker's traceback, or
    its exit code) and kills every worker. A rank waiting in a collective for a dead peer never
    returns, and ending its process is the sure way to stop it and give its GPU back. The next call
    raises the failure. No collective timeout is involved, so a long healthy step never trips one.
    Workers exit when this process dies, and remove the shared memory.

    Ranks meet through a file store in a private temporary folder, and gloo's sockets and NCCL's
    bootstrap bind to the loopback interface: nothing the engine opens listens beyond this machine.
    """

    def __init__(self, config: Config):
        self.config = config
        self.workers: list[Worker] = []
        self.channel: CallChannel | None = None
        self.results: Connection | None = None  # rank 0's sampled tokens, step after step
        self.rendezvous_dir: str | None = None
        self.watchdog: Watchdog | None = None
        self.failure: str | None = None
        self.refusal: str | None = None  # a worker's ValueError: what it was given cannot run
        try:
            self._start_workers()
            self._await_workers_built()
        except BaseException as error:
            self._stop(kill=True)
            if self.refusal is not None:  # as at tensor_parallel_size 1, with the worker's traceback as its cause
                raise ValueError(self.refusal) from RuntimeError(self.failure)
            if self.failure is not None:
                raise RuntimeError(self.failure) from error
            raise

    def _start_workers(self):
        self.rendezvous_dir = make_rendezvous_dir()
        ctx = mp.get_context("spawn")
        world_size = self.config.tensor_parallel_size
        ready, taken = [ctx.Semaphore(0) for _ in range(world_size)], [ctx.Semaphore(1) for _ in range(world_size)]
        record_semaphores(self.rendezvous_dir, ready + taken)
        shm_name = make_shm_name()
        self.channel = CallChannel(shm_name, ready, taken, create=True)
        self.results, results_sender = ctx.Pipe(duplex=False)
        try:
            for rank in range(world_size):
                receiver, sender = ctx.Pipe(duplex=False)
                process = ctx.Process(target=run_worker, name=f"nanovllm-rank{rank}",
                                      args=(self.config, rank, self.rendezvous_dir, shm_name, ready, taken, sender,
                                            results_sender if rank == 0 else None))
                try:
                    process.start()
                finally:
                    sender.close()
                self.workers.append(Worker(rank, process, receiver))
        finally:
            results_sender.close()
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
        return [worker.num_kvcache_blocks for worker in self.workers]

    @property
    def num_kvcache_blocks(self) -> int:
        return self.workers[0].num_kvcache_blocks

    def _on_worker_failure(self, description: str, refusal: str | None):
        """From the watchdog thread: record the failure and end every worker (a group that lost a rank is
        out of step for good, and its other ranks may wait on the lost one forever)."""
        self.failure, self.refusal = description, refusal
        for worker in self.workers:
            worker.process.kill()

    def _alive(self) -> bool:
        return self.failure is None and all(worker.process.is_alive() for worker in self.workers)

    def _raise_failure(self):
        if self.failure is not None:
            self._stop(kill=True)
            raise RuntimeError(f"the engine stopped after a worker failed; create a new LLM.\n{self.failure}")

    def execute_model(self, step: StepInput) -> RemoteStepOutput | None:
        """Send a step to every rank; its sampled tokens come from `wait(output)`; None where it awaits its
        masks."""
        self._send("execute_model", step)
        return None if step.sampling.awaits_masks else RemoteStepOutput(self.results)

    def sample_tokens(self, masks: GrammarMasks | None) -> RemoteStepOutput:
        self._send("sample_tokens", masks)
        return RemoteStepOutput(self.results)

    def _send(self, method_name: str, *args):
        self._raise_failure()
        try:
            self.channel.send(self._alive, method_name, *args)
        except WorkerGone:
            self._fail("a tensor-parallel worker stopped")

    def wait(self, output: RemoteStepOutput) -> StepOutput:
        """The step's tokens, from rank 0; the wait watches for a failure too."""
        try:
            while not output.ready(RESULT_POLL_S):
                self._raise_failure()
                if not self._alive():
                    self._fail("a tensor-parallel worker stopped")
            result = output.result()
        except (EOFError, OSError):
            self._fail("tensor-parallel rank 0 stopped")
        self._raise_failure()
        return result

    def _fail(self, description: str):
        """A worker stopped: stop them all and raise the failure the watchdog records (it names the
        cause), else this one."""
        if self.watchdog is not None:
            self.watchdog.join(timeout=5)
        self.failure = self.failure or description
        self._raise_failure()

    def exit(self):
        """Stop every rank and release the processes, the shared memory and the rendezvous folder.
        Safe to call more than once."""
        if self.watchdog is not None:
            self.watchdog.stop()  # workers are about to exit on purpose
            self.watchdog = None
        if self.channel is not None and self.failure is None:
            try:
                self.channel.send(self._alive, "exit")
            except WorkerGone:
                pass
        self._stop(kill=self.failure is not None)

    def _stop(self, kill: bool):
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        for worker in self.workers:
            worker.stop(timeout=0 if kill else WORKER_EXIT_TIMEOUT_S)
        self.workers = []
        for resource in (self.channel, self.results):
            if resource is not None:
                resource.close()
        self.channel = self.results = None
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            self.rendezvous_dir = None
