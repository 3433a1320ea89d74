"""How the engine and the tensor-parallel ranks talk: each call goes down to every rank through shared
memory (CallChannel), and rank 0 sends each step's output back up a pipe (RemoteStepOutput)."""
import pickle
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

from nanovllm.engine.step_io import StepOutput
from nanovllm.utils.interrupts import keyboard_interrupt_deferred

SHM_SIZE = 1 << 24
HEADER_BYTES = 8  # the call's length, then whether it lies in the overflow segment
POLL_S = 0.5


class WorkerGone(Exception):
    """The other side of the channel stopped while this side waited for it."""


class CallChannel:
    """The engine sends each call, pickled into one shared-memory buffer, to every worker.

    The engine may send the next call before the workers have finished the last (it prepares a step
    while the device runs the previous one), so a worker acknowledges each call once it has copied
    it out: semaphore `ready[i]` tells worker i a call is waiting, `taken[i]` (starting at 1) tells
    the engine the buffer is free. Semaphores, unlike events, never block the side that signals, even
    when the other side has died. Waits wake up every POLL_S seconds to ask `alive()` whether it still
    runs. A call larger than the buffer (a sampling batch with long penalty histories or large
    allowed-token sets) travels in a segment of its own, `overflow_name(name)`, which lives until the
    next call.
    """

    def __init__(self, name: str, ready: list, taken: list, create: bool):
        self.shm = SharedMemory(name=name, create=create, size=SHM_SIZE if create else 0)
        self.ready, self.taken = ready, taken
        self.owner = create
        self.overflow: SharedMemory | None = None

    def send(self, alive, method_name: str, *args):
        data = pickle.dumps((method_name, args), protocol=pickle.HIGHEST_PROTOCOL)
        for taken in self.taken:
            _acquire(taken, alive)
        self._drop_overflow()  # every worker has copied the last call out
        in_overflow = len(data) + HEADER_BYTES > SHM_SIZE
        if in_overflow:
            self.overflow = SharedMemory(name=overflow_name(self.shm.name), create=True, size=len(data))
            self.overflow.buf[:len(data)] = data
        else:
            self.shm.buf[HEADER_BYTES:len(data) + HEADER_BYTES] = data
        self.shm.buf[0:HEADER_BYTES] = len(data).to_bytes(4, "little") + in_overflow.to_bytes(4, "little")
        for ready in self.ready:
            ready.release()

    def receive(self, worker: int, alive) -> tuple[str, tuple]:
        _acquire(self.ready[worker], alive)
        n = int.from_bytes(self.shm.buf[0:4], "little")
        try:
            if not int.from_bytes(self.shm.buf[4:8], "little"):
                return pickle.loads(self.shm.buf[HEADER_BYTES:n + HEADER_BYTES])
            overflow = SharedMemory(name=overflow_name(self.shm.name))
            try:
                return pickle.loads(overflow.buf[:n])
            finally:
                overflow.close()
        finally:
            self.taken[worker].release()

    def _drop_overflow(self):
        if self.overflow is not None:
            self.overflow.close()
            self.overflow.unlink()
            self.overflow = None

    def close(self):
        if self.shm is None:
            return
        self._drop_overflow()
        self.shm.close()
        if self.owner:
            self.shm.unlink()
        self.shm = None


def overflow_name(name: str) -> str:
    return f"{name}-overflow"


def _acquire(semaphore, alive):
    while not semaphore.acquire(timeout=POLL_S):
        if not alive():
            raise WorkerGone


class RemoteStepOutput:
    """A step's sampled tokens, which rank 0's worker sends once its device is done. They come in the
    order the steps were launched, and the engine waits for its steps in that order. A result is read
    whole, with Ctrl-C held back, and kept: a wait interrupted after the read finds it again."""

    def __init__(self, pipe: Connection):
        self.pipe = pipe
        self.received: StepOutput | None = None

    def ready(self, timeout: float = 0) -> bool:
        return self.received is not None or self.pipe.poll(timeout)

    def result(self) -> StepOutput:
        if self.received is None:
            with keyboard_interrupt_deferred():
                self.received = self.pipe.recv()
        return self.received
