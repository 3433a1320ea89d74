"""The call channel between the engine and its workers: calls of any size arrive whole, in order, and
leave nothing in /dev/shm."""
import multiprocessing
import os
import uuid

import numpy as np
import pytest

from nanovllm.engine.rpc import SHM_SIZE, CallChannel, WorkerGone


def segments(name: str) -> list[str]:
    return sorted(entry for entry in os.listdir("/dev/shm") if entry.startswith(name))


@pytest.fixture
def channels():
    """The engine's end and one worker's, in this process."""
    ctx = multiprocessing.get_context("spawn")
    name = f"nanovllm-test-{uuid.uuid4().hex[:12]}"
    ready, taken = [ctx.Semaphore(0)], [ctx.Semaphore(1)]
    engine = CallChannel(name, ready, taken, create=True)
    worker = CallChannel(name, ready, taken, create=False)
    yield name, engine, worker
    worker.close()
    engine.close()
    assert segments(name) == []


def test_small_and_oversized_calls_arrive_whole_and_in_turn(channels):
    name, engine, worker = channels
    big = np.arange(3 * SHM_SIZE // 8, dtype=np.int64)  # 3 x the buffer
    alive = lambda: True  # noqa: E731
    engine.send(alive, "execute_model", "small", 1)
    assert worker.receive(0, alive) == ("execute_model", ("small", 1))
    engine.send(alive, "execute_model", big)
    assert segments(name) == [name, f"{name}-overflow"]
    method, (received,) = worker.receive(0, alive)
    assert method == "execute_model" and np.array_equal(received, big)
    engine.send(alive, "exit")  # the overflow segment goes once every worker has taken its call
    assert segments(name) == [name]
    assert worker.receive(0, alive) == ("exit", ())


def test_a_send_gives_up_when_the_worker_is_gone(channels):
    _, engine, _ = channels
    engine.send(lambda: True, "execute_model")  # never taken
    with pytest.raises(WorkerGone):
        engine.send(lambda: False, "execute_model")
