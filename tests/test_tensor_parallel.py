"""tensor_parallel_size=2 on a CPU (gloo, two processes) against one process; engines that start, stop
and fail cleanly: nothing left running, in /dev/shm, in /tmp or listening beyond the loopback interface."""
import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nanovllm import LLM, SamplingParams

from conftest import mixed_prompts
from sampling_checks import EVERY_FEATURE, with_length
from worker_fault import assert_fault_reported, failing_in_workers, play_with_deadline, shared_memory_of

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=48, max_model_len=512, dtype="float32", device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy_tokens(path, tensor_parallel_size, **kwargs):
    with LLM(path, tensor_parallel_size=tensor_parallel_size, **{**ENGINE_ARGS, **kwargs}) as llm:
        return [out["token_ids"] for out in llm.generate(mixed_prompts(), GREEDY, use_tqdm=False)]


def test_two_ranks_match_one(tiny_gqa):
    # 48 blocks of 16 force preemption; shared prefixes give cache hits on both ranks.
    assert greedy_tokens(tiny_gqa, 2) == greedy_tokens(tiny_gqa, 1)


def test_two_ranks_match_one_untied_chunked(tiny_mha):
    args = dict(max_num_batched_tokens=100, num_kvcache_blocks=256)
    assert greedy_tokens(tiny_mha, 2, **args) == greedy_tokens(tiny_mha, 1, **args)


def feature_run(path, tensor_parallel_size) -> list:
    """Each of EVERY_FEATURE's requests on its own prompt, all in one batch: tokens, log-probabilities of
    the completion and of the prompt."""
    prompts = mixed_prompts()[:len(EVERY_FEATURE)]
    params = [with_length(p, 16) for p in EVERY_FEATURE]
    with LLM(path, tensor_parallel_size=tensor_parallel_size, **ENGINE_ARGS) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(out.outputs[0].token_ids, logprob_values(out.outputs[0].logprobs), logprob_values(out.prompt_logprobs))
            for out in outputs]


def logprob_values(positions) -> list[dict[int, float]] | None:
    if positions is None:
        return None
    return [{token: logprob.logprob for token, logprob in (position or {}).items()} for position in positions]


def test_two_ranks_match_one_in_every_sampling_feature(tiny_gqa):
    """Seeds, filters, penalties, biases, allowed and bad words, min_tokens, logprobs: the same tokens, and
    log-probabilities as near as float32 sums in another order allow."""
    two, one = feature_run(tiny_gqa, 2), feature_run(tiny_gqa, 1)
    for params, (tokens, logprobs, prompt_logprobs), (want_tokens, want_logprobs, want_prompt) in zip(EVERY_FEATURE,
                                                                                                   two, one):
        assert tokens == want_tokens, params
        for got, want in ((logprobs, want_logprobs), (prompt_logprobs, want_prompt)):
            assert (got is None) == (want is None), params
            for got_position, want_position in zip(got or [], want or []):
                assert got_position.keys() == want_position.keys(), params
                assert all(abs(got_position[t] - want_position[t]) < 1e-4 for t in want_position), params


def listening_sockets(pids: set[int]) -> list[str]:
    """Local addresses ('ip:port', hex as in /proc/net) of the TCP sockets these processes listen on."""
    inodes = set()
    for pid in pids:
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    addresses.append(fields[1])
    return addresses


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1 and ::1, as /proc/net writes them


def engine_pids(llm) -> set[int]:
    return {os.getpid(), *(worker.process.pid for worker in llm.executor.workers)}


def leftovers() -> dict[str, list]:
    """What an engine of this process could leave behind."""
    return dict(children=multiprocessing.active_children(),
                shm=shared_memory_of(os.getpid()),
                semaphores=sorted(name for name in os.listdir("/dev/shm") if name.startswith("sem.mp-")),
                rendezvous=glob.glob(os.path.join(os.environ.get("TMPDIR", "/tmp"), "nanovllm-*")))


def new_leftovers(before: dict[str, list]) -> dict[str, list]:
    """What is there now and was not `before`. (An engine sweeps what killed engines left, so some of `before`
    may be gone: other processes' leftovers are not this test's.)"""
    return {key: sorted(set(map(str, items)) - set(map(str, before[key]))) for key, items in leftovers().items()}


NOTHING = dict(children=[], shm=[], semaphores=[], rendezvous=[])


def test_engines_one_after_another_leave_nothing_behind(tiny_gqa):
    before = leftovers()
    for _ in range(2):
        with LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS) as llm:
            assert len(multiprocessing.active_children()) == 2  # every rank is a worker
            assert leftovers()["shm"] and leftovers()["rendezvous"]
            blocks = llm.executor.num_kvcache_blocks_per_rank
            assert blocks == [ENGINE_ARGS["num_kvcache_blocks"]] * 2
            sockets = listening_sockets(engine_pids(llm))
            assert sockets and all(address.startswith(LOOPBACK) for address in sockets), sockets
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert new_leftovers(before) == NOTHING
    llm = LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS)
    llm.exit()
    llm.exit()  # a second exit is harmless
    assert new_leftovers(before) == NOTHING


def test_engines_of_any_size_run_side_by_side(tiny_gqa):
    """This process holds no process group: its engines' ranks all run in their own workers."""
    with LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS) as first:
        with LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS) as second, LLM(tiny_gqa, **ENGINE_ARGS) as single:
            expected = single.generate([[1, 2]], GREEDY, use_tqdm=False)[0]["token_ids"]
            assert second.generate([[1, 2]], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
        assert first.generate([[1, 2]], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    assert not multiprocessing.active_children()


def test_worker_error_reaches_the_caller_and_leaves_nothing_behind(tiny_gqa, monkeypatch):
    before = leftovers()
    llm = LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS)
    import nanovllm.engine.llm_engine as llm_engine
    monkeypatch.setattr(llm_engine, "build_step_input", failing_in_workers(llm_engine.build_step_input))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)tensor-parallel rank 1 failed.*injected fault in a worker"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert new_leftovers(before) == NOTHING
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    llm.exit()
    monkeypatch.undo()
    with LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS) as fresh:
        assert len(fresh.generate([[1, 2]], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens


def test_a_worker_fault_in_a_process_of_its_own(tiny_gqa):
    """The form the GPU test takes (a hang there fails the test, not the session), checked on gloo."""
    assert_fault_reported(play_with_deadline(tiny_gqa, dict(ENGINE_ARGS, tensor_parallel_size=2), deadline_s=120),
                          within_s=10)


def test_a_killed_worker_is_reported_within_seconds(tiny_gqa):
    before = leftovers()
    llm = LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS)
    os.kill(llm.executor.workers[1].process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited unexpectedly \(exit code -9\)"):
        llm.generate([[1, 2, 3]] * 4, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert new_leftovers(before) == NOTHING
    llm.exit()


def run_script(tmp_path, source: str, **kwargs) -> subprocess.Popen:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kwargs)


def test_a_script_without_the_main_guard_gets_an_error_naming_it(tiny_gqa, tmp_path):
    process = run_script(tmp_path, f"""
        from nanovllm import LLM
        llm = LLM({tiny_gqa!r}, tensor_parallel_size=2, **{ENGINE_ARGS!r})
        print("started")
    """)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode != 0 and "started" not in stdout
    assert "if __name__ == '__main__':" in stderr.splitlines()[-1], stderr[-2000:]
    assert not shared_memory_of(process.pid)


def start_sleeping_engine(tiny_gqa, tmp_path, **popen_kwargs):
    """A script that starts a two-rank engine, its temporary files in a private folder, prints rank 0's worker pid
    and sleeps: (the script's process, the folder, the worker's pid)."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    process = run_script(tmp_path, f"""
        import tempfile
        import time
        from nanovllm import LLM
        tempfile.tempdir = {str(private_tmp)!r}
        if __name__ == "__main__":
            llm = LLM({tiny_gqa!r}, tensor_parallel_size=2, **{ENGINE_ARGS!r})
            print(llm.executor.workers[0].process.pid, flush=True)
            time.sleep(600)
    """, **popen_kwargs)
    line = process.stdout.readline()
    assert line.strip().isdigit(), process.stderr.read()[-2000:]
    return process, private_tmp, int(line)


def test_workers_exit_when_their_parent_is_killed(tiny_gqa, tmp_path):
    process, private_tmp, worker_pid = start_sleeping_engine(tiny_gqa, tmp_path)
    assert shared_memory_of(process.pid)
    assert os.listdir(private_tmp)  # the rendezvous folder
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker_pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{worker_pid}") or "zombie" in open(f"/proc/{worker_pid}/status").read()
    assert not shared_memory_of(process.pid)
    assert not os.listdir(private_tmp)


def mapped_semaphores(pid: int) -> set[str]:
    """The named semaphores process `pid` has open: files of /dev/shm mapped into the process (found by inode,
    since glibc maps a file it then links under the semaphore's name)."""
    with open(f"/proc/{pid}/maps") as f:
        inodes = {int(line.split()[4]) for line in f if " /dev/shm/" in line}
    return {path for path in glob.glob("/dev/shm/sem.*") if os.stat(path).st_ino in inodes}


def test_an_engine_sweeps_what_a_killed_engines_process_group_left(tiny_gqa, tmp_path, monkeypatch):
    """kill -9 of an engine's whole process group (its workers and multiprocessing's resource tracker with it)
    leaves its shared memory, semaphores and rendezvous folder behind; the next engine removes them."""
    process, private_tmp, _ = start_sleeping_engine(tiny_gqa, tmp_path, start_new_session=True)
    semaphores = mapped_semaphores(process.pid)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    left = dict(shm=shared_memory_of(process.pid), folders=os.listdir(private_tmp),
                semaphores=[path for path in semaphores if os.path.exists(path)])
    assert left["shm"] and left["folders"] and len(left["semaphores"]) == 4, left  # ready and taken, per rank
    monkeypatch.setattr("tempfile.tempdir", str(private_tmp))
    with LLM(tiny_gqa, tensor_parallel_size=2, **ENGINE_ARGS) as llm:
        assert len(llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens
    assert not shared_memory_of(process.pid)
    assert not os.listdir(private_tmp)
    assert not [path for path in semaphores if os.path.exists(path)]
