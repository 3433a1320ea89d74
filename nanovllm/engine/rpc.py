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
    it out: `ready[i]` tells worker i a call is waiting, `taken[i]` tells rank 0 the buffer is free.
    Waits wake up every POLL_S seconds to ask `alive()` whether the other side still runs.
    """

    def __init__(self, name: str, ready: list, taken: list, create: bool):
        self.shm = SharedMemory(name=name, create=create, size=SHM_SIZE if create else 0)
        self.ready, self.taken = ready, taken
        self.owner = create
        if create:
            for event in taken:
                event.set()  # the buffer starts free

    def send(self, alive, method_name: str, *args):
        data = pickle.dumps((method_name, args), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) + 4 > SHM_SIZE:
            raise RuntimeError(f"a {method_name!r} call of {len(data)} bytes exceeds the shared memory")
        for taken in self.taken:
            _wait(taken, alive)
            taken.clear()
        self.shm.buf[0:4] = len(data).to_bytes(4, "little")
        self.shm.buf[4:len(data) + 4] = data
        for ready in self.ready:
            ready.set()

    def receive(self, worker: int, alive) -> tuple[str, tuple]:
        _wait(self.ready[worker], alive)
        self.ready[worker].clear()
        n = int.from_bytes(self.shm.buf[0:4], "little")
        method_name, args = pickle.loads(self.shm.buf[4:n + 4])
        self.taken[worker].set()
        return method_name, args

    def close(self):
        if self.shm is None:
            return
        self.shm.close()
        if self.owner:
            self.shm.unlink()
        self.shm = None


def _wait(event, alive):
    while not event.wait(POLL_S):
        if not alive():
            raise WorkerGone
