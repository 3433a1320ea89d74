import signal
import threading
from contextlib import contextmanager


@contextmanager
def keyboard_interrupt_deferred():
    """Hold back Ctrl-C (in the main thread) until the block is done, then hand it to the handler that
    was in place (Python's raises KeyboardInterrupt): for work that must happen whole, such as launching
    a step on every rank and recording that it is in flight."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt
