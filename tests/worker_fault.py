"""A worker's fault in the middle of a step, for the tests at tensor_parallel_size 2.

`StepInputThatFailsInWorkers` makes every rank but 0 fail while it unpickles its step, after rank 0
has launched the step and waits in its collectives. Run as a script (`python worker_fault.py
CHECKPOINT ENGINE_ARGS_JSON`), this module plays the whole case in a process of its own and prints
what the caller saw as one JSON line; `play_with_deadline` runs it so, and an engine that hangs fails
its test instead of stopping the session.
"""
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

from nanovllm import LLM, SamplingParams
from nanovllm.engine.step_io import StepInput

PROMPTS = [list(range(1, 60)), list(range(1, 300))]
WORKER_CLEANUP_S = 5


class StepInputThatFailsInWorkers(StepInput):
    """Rank 0 uses it as it is; the other ranks fail while unpickling their step."""

    def __setstate__(self, state):
        if multiprocessing.current_process().name != "nanovllm-rank0":
            raise RuntimeError("injected fault in a worker")
        for part in state:  # pickle's default state of a slotted class: (instance dict, slot values)
            for name, value in (part or {}).items():
                setattr(self, name, value)


def failing_in_workers(build_step_input):
    """A stand-in for llm_engine.build_step_input whose steps fail in the workers."""
    def build(*args):
        step, scored = build_step_input(*args)
        return StepInputThatFailsInWorkers(**{field: getattr(step, field) for field in StepInput.__slots__}), scored
    return build


def shared_memory_of(pid: int) -> list[str]:
    """The shared-memory segments of the engine in process `pid`."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"nanovllm-{pid}-")]


def play(path: str, engine_args: dict) -> dict:
    """The fault, then a new engine of one rank in the same process."""
    import nanovllm.engine.llm_engine as llm_engine
    llm = LLM(path, **engine_args)
    build = llm_engine.build_step_input
    llm_engine.build_step_input = failing_in_workers(build)
    start, error = time.monotonic(), None
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=8), use_tqdm=False)
    except RuntimeError as caught:
        error = str(caught)
    seen = dict(error=error, seconds=time.monotonic() - start,
                children_left=len(multiprocessing.active_children()),
                shared_memory_left=shared_memory_of(os.getpid()))
    llm.exit()
    llm_engine.build_step_input = build
    with LLM(path, **{**engine_args, "tensor_parallel_size": 1}) as fresh:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        seen["fresh_engine_tokens"] = len(fresh.generate(PROMPTS[:1], params, use_tqdm=False)[0]["token_ids"])
    return seen


def play_with_deadline(path: str, engine_args: dict, deadline_s: float) -> dict | None:
    """`play` in a process of its own: what it saw, or None if it had not finished by the deadline."""
    child = subprocess.Popen([sys.executable, __file__, path, json.dumps(engine_args)], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        out, _ = child.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        child.kill()  # its workers see it die and clean up after it
        child.communicate()
        time.sleep(WORKER_CLEANUP_S)
        try:
            os.killpg(child.pid, signal.SIGKILL)  # any that could not
        except ProcessLookupError:
            pass
        return None
    assert child.returncode == 0, f"the worker-fault process exited with code {child.returncode}"
    return json.loads(out.strip().splitlines()[-1])


def assert_fault_reported(seen: dict | None, within_s: float):
    """What `play_with_deadline` saw: the worker's error within the time, nothing left, a working new engine."""
    assert seen is not None, "the engine hung after a worker's fault"
    assert "tensor-parallel rank 1 failed" in seen["error"] and "injected fault in a worker" in seen["error"]
    assert seen["seconds"] < within_s
    assert seen["children_left"] == 0 and seen["shared_memory_left"] == []
    assert seen["fresh_engine_tokens"] == 4


if __name__ == "__main__":
    print(json.dumps(play(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
