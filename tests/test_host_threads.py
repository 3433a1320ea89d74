"""benchmarks/host_threads.py against the threads' own clocks (time.thread_time, which the kernel keeps per
thread): the main thread's CPU seconds and a busy helper thread's, as /proc gives them."""
import sys
import threading
import time

import pytest

from benchmarks import host_threads
from benchmarks.host_threads import HostSampler

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def spin(seconds: float, spent: list[float]):
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    spent.append(time.thread_time() - start)


def test_the_main_thread_and_a_busy_thread_as_their_own_clocks_say():
    helper_spent, main_spent = [], []
    with HostSampler(interval=0.01) as host:
        helper = threading.Thread(target=spin, args=(0.3, helper_spent))
        helper.start()
        spin(0.3, main_spent)
        helper.join()
    summary = host.summary()
    rounding = 0.005  # the summary gives hundredths; the sampler's ~60 reads of /proc must not count as others'
    assert abs(summary["main_cpu_s"] - main_spent[0]) <= rounding + 0.005
    assert abs(summary["other_threads_cpu_s"] - helper_spent[0]) <= rounding + 0.01  # it ended inside the block
    assert summary["main_processors"] and abs(sum(summary["main_processors"].values()) - 1) < 0.05


def test_a_thread_exiting_while_it_is_read_is_left_out(monkeypatch):
    """Reading an exiting thread's /proc files fails with ESRCH (ProcessLookupError), not only ENOENT."""
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)
    worker.start()
    started.wait()
    exiting = worker.native_id

    def read(path, *args, **kwargs):
        if path.startswith(f"/proc/self/task/{exiting}/"):
            raise ProcessLookupError(3, "No such process")
        return open(path, *args, **kwargs)

    monkeypatch.setattr(host_threads, "open", read, raising=False)
    try:
        snapshot = host_threads.thread_snapshot()
    finally:
        stop.set()
        worker.join()
    assert exiting not in snapshot and threading.get_native_id() in snapshot
