import os
import socket
import uuid

import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner, run_worker

WORKER_ERROR_WAIT_S = 5.0


class Executor:
    """The model runners of every tensor-parallel rank: rank 0 in this process, the others spawned.

    Each engine takes a free port and a unique shared-memory name, so engines can follow one
    another in a process. A worker that fails sends its traceback up a pipe before it dies; the
    call that was running then raises it here, and every rank is stopped: a process group that
    lost a member cannot be trusted again.
    """

    def __init__(self, config: Config):
        self.config = config
        self.port = free_port()
        self.processes, self.error_pipes = [], []
        self.model_runner: ModelRunner | None = None
        self.failure: str | None = None
        try:
            self._start()
        except BaseException:
            try:
                self._raise_worker_error(wait=WORKER_ERROR_WAIT_S if self.processes else 0)
            finally:
                self.exit()
            raise

    def _start(self):
        init_method = f"tcp://127.0.0.1:{self.port}"
        shm_name = f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        ctx = mp.get_context("spawn")
        events = []
        for rank in range(1, self.config.tensor_parallel_size):
            event = ctx.Event()
            receiver, sender = ctx.Pipe(duplex=False)
            process = ctx.Process(target=run_worker, args=(self.config, rank, event, init_method, shm_name, sender))
            process.start()
            sender.close()
            self.processes.append(process)
            self.error_pipes.append((rank, receiver))
            events.append(event)
        self.model_runner = ModelRunner(self.config, 0, events, init_method, shm_name)

    def call(self, method_name: str, *args):
        if self.failure is not None:
            raise RuntimeError(f"the engine stopped after a worker failed; create a new LLM.\n{self.failure}")
        try:
            result = self.model_runner.call(method_name, *args)
        except Exception:
            self._raise_worker_error(wait=WORKER_ERROR_WAIT_S)
            raise
        self._raise_worker_error(wait=0)
        return result

    def _raise_worker_error(self, wait: float):
        for rank, receiver in self.error_pipes:
            if receiver.poll(wait):
                self.failure = f"tensor-parallel rank {rank} failed:\n{receiver.recv()}"
                self._abort()
                raise RuntimeError(self.failure)

    def _abort(self):
        for process in self.processes:
            process.kill()
        if self.model_runner is not None:
            self.model_runner.abort()
            self.model_runner = None
        self._join()

    def exit(self):
        """Stop every rank and release the processes, the port and the shared memory."""
        runners_started = self.model_runner is not None
        if runners_started:
            self.model_runner.call("exit")
            self.model_runner = None
        self._join(timeout=30 if runners_started else 0)

    def _join(self, timeout: float = 0):
        for process in self.processes:
            process.join(timeout=timeout)
            if process.is_alive():
                process.kill()
                process.join()
        for _, receiver in self.error_pipes:
            receiver.close()
        self.processes, self.error_pipes = [], []


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
