"""The engine's handles on its spawned ranks: a `Worker` (its process and status pipe) and the `Watchdog` thread
that reports the first worker to fail."""
import threading
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp


class Worker:
    """A spawned rank as the engine sees it: its process and the pipe its status comes up."""

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

    def describe_failure(self, message: tuple | None) -> tuple[str, str | None]:
        """What the worker's end says, and the text of the ValueError it failed with, if it did."""
        if message is not None and message[0] == "error":
            return f"tensor-parallel rank {self.rank} failed:\n{message[1]}", message[2]
        self.process.join(timeout=1)
        return f"tensor-parallel rank {self.rank} exited unexpectedly (exit code {self.process.exitcode})", None

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
                self.on_failure(*worker.describe_failure(message))
                return

    def join(self, timeout: float):
        self.thread.join(timeout)

    def stop(self):
        self.wake_writer.send(None)
        self.thread.join()
        self.wake_reader.close()
        self.wake_writer.close()

