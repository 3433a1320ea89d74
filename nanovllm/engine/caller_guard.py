import threading
from contextlib import contextmanager

BUSY = "the engine is running in another thread: it is not thread-safe, so call it from one thread at a time"
SHUT_DOWN = "the engine was shut down by exit(): make a new LLM to generate again"


class CallerGuard:
    """Lets one thread at a time into the engine, and none once exit() has shut it down.

    The engine is not thread-safe (nor is vLLM's LLM): two threads stepping it at once would corrupt
    each other's requests. So each public call that changes the engine holds this guard. The thread
    holding it may enter again (generate() calls step()); another thread is refused at once, before
    it changes anything, and the call in progress goes on undisturbed. Entering is a non-blocking
    acquire of a re-entrant lock: about a microsecond, against a step's hundreds.
    """

    def __init__(self):
        self.lock = threading.RLock()
        self.shut_down = False

    def __enter__(self):
        self.acquire()
        if self.shut_down:
            self.lock.release()
            raise RuntimeError(SHUT_DOWN)

    def __exit__(self, *exc_info):
        self.lock.release()

    def acquire(self):
        if not self.lock.acquire(False):
            raise RuntimeError(BUSY)

    @contextmanager
    def shutting_down(self):
        """Held as a call is, for exit(), which may come again after a shut-down: it marks one."""
        self.acquire()
        try:
            self.shut_down = True
            yield
        finally:
            self.lock.release()
