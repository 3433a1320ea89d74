"""benchmarks/host_threads.py against the threads' own clocks (time.thread_time, which the kernel keeps per
thread): the main thread's CPU seconds and a busy helper thread's, as /proc gives them."""
import sys
import threading
import time

import pytest

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
