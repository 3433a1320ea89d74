import pickle
from multiprocessing.shared_memory import SharedMemory

SHM_SIZE = 1 << 24
POLL_S = 0.5


class WorkerGone(Exception):
    """The other side of the channel stopped while this side waited for it."""


class CallChannel:
    """Rank 0 sends each call, pickled into one shared-memory buffer, to every worker.

    Rank 0 may send the next call before the workers have finished the last (it prepares a step
    while the device runs the previous one), so a worker acknowledges each call once it has copied
    it out: semaphore `ready[i]` tells worker i a call is waiting, `taken[i]` (starting at 1) tells
    rank 0 the buffer is free. Semaphores, unlike events, never block the side that signals, even when
    the other side has died. Waits wake up every POLL_S seconds to ask `alive()` whether it still runs.
    """

    def __init__(self, name: str, ready: list, taken: list, create: bool):
        self.shm = SharedMemory(name=name, create=create, size=SHM_SIZE if create else 0)
        self.ready, self.taken = ready, taken
        self.owner = create

    def send(self, alive, method_name: str, *args):
        data = pickle.dumps((method_name, args), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) + 4 > SHM_SIZE:
            raise RuntimeError(f"a {method_name!r} call of {len(data)} bytes exceeds the shared memory")
        for taken in self.taken:
            _acquire(taken, alive)
        self.shm.buf[0:4] = len(data).to_bytes(4, "little")
        self.shm.buf[4:len(data) + 4] = data
        for ready in self.ready:
            ready.release()

    def receive(self, worker: int, alive) -> tuple[str, tuple]:
        _acquire(self.ready[worker], alive)
        n = int.from_bytes(self.shm.buf[0:4], "little")
        try:
            return pickle.loads(self.shm.buf[4:n + 4])
        finally:
            self.taken[worker].release()

    def close(self):
        if self.shm is None:
            return
        self.shm.close()
        if self.owner:
            self.shm.unlink()
        self.shm = None


def _acquire(semaphore, alive):
    while not semaphore.acquire(timeout=POLL_S):
        if not alive():
            raise WorkerGone
