"""The engine API used as a careless or hostile caller would: generate() beside requests of add_request(),
request ids that a user also picks, two threads on one engine, calls after exit(). Tokens are checked
against transformers' greedy ones."""
import threading

import pytest

from nanovllm import LLM, RequestOutputKind, SamplingParams

from conftest import assert_greedy_matches_transformers

ENGINE_ARGS = dict(kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=256, dtype="float32", device="cpu")
PROMPTS = [[7, 300, 12, 99, 4, 18], [5, 6, 7], [100, 200, 300, 400], [42, 43], [9, 8, 7, 6, 5]]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def drain(llm) -> dict[str, list]:
    """step() until the engine is idle: each request's outputs, in order."""
    outputs = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


# --- generate() beside requests of add_request() ---

def test_generate_leaves_the_added_requests_outputs_to_step(llm, tiny_gqa, hf_model_cache):
    final, delta = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA
    llm.add_request("final", PROMPTS[0], SamplingParams(**GREEDY, max_tokens=3, output_kind=final))
    llm.add_request("delta", PROMPTS[1], SamplingParams(**GREEDY, max_tokens=12, output_kind=delta))
    mine = llm.generate(PROMPTS[2:], SamplingParams(**GREEDY, max_tokens=6), use_tqdm=False)
    assert set(llm.requests) == {"delta"}  # "final" finished during generate(); none of generate's is left
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, PROMPTS[2:], token_ids(mine))
    assert all(len(out.outputs[0].token_ids) == 6 and out.finished for out in mine)
    later = drain(llm)
    assert set(later) == {"final", "delta"}
    assert len(later["final"]) == 1 and later["final"][0].finished
    delta_tokens = sum(token_ids(later["delta"]), [])
    assert len(delta_tokens) == 12 and later["delta"][-1].finished
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, PROMPTS[:2],
                                       token_ids(later["final"]) + [delta_tokens])


def test_generate_as_completed_leaves_a_streamed_requests_outputs_to_step(llm, tiny_gqa, hf_model_cache):
    params = SamplingParams(**GREEDY, max_tokens=8, output_kind=RequestOutputKind.CUMULATIVE)
    llm.add_request("streamed", PROMPTS[0], params)
    done = dict(llm.generate_as_completed(PROMPTS[1:3], SamplingParams(**GREEDY, max_tokens=3)))
    assert sorted(done) == [0, 1] and set(llm.requests) == {"streamed"}
    streamed = drain(llm)["streamed"]
    assert [len(out.outputs[0].token_ids) for out in streamed] == list(range(1, 9))  # every step's, in order
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, [PROMPTS[0]], [streamed[-1].outputs[0].token_ids])


def test_generate_inside_a_generate_as_completed_loop(llm, tiny_gqa, hf_model_cache):
    """generate() between two results steps the loop's requests too: their results still come from the loop."""
    results = {}
    for i, out in llm.generate_as_completed(PROMPTS[:3], [SamplingParams(**GREEDY, max_tokens=n) for n in (2, 6, 10)]):
        results[i] = out.outputs[0].token_ids
        if i == 0:
            inner = llm.generate(PROMPTS[3:4], SamplingParams(**GREEDY, max_tokens=20), use_tqdm=False)[0]
    assert sorted(results) == [0, 1, 2] and [len(results[i]) for i in range(3)] == [2, 6, 10]
    assert len(inner.outputs[0].token_ids) == 20 and not llm.has_unfinished_requests()
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, PROMPTS[:4],
                                       [results[0], results[1], results[2], inner.outputs[0].token_ids])


def test_generate_as_completed_ends_when_its_request_is_aborted(llm):
    """A caller iterating the results aborts the other request: nothing is left to wait for."""
    results = llm.generate_as_completed(PROMPTS[:2], [SamplingParams(**GREEDY, max_tokens=n) for n in (2, 30)])
    assert next(results)[0] == 0
    llm.abort_request(list(llm.requests))
    rest = []
    reader = threading.Thread(target=lambda: rest.extend(results), daemon=True)  # a wait that never ends fails
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive() and rest == [] and not llm.requests
    drain(llm)


# --- request ids ---

def test_generate_numbers_its_requests_around_the_ids_in_use(tiny_gqa, hf_model_cache):
    with LLM(tiny_gqa, **ENGINE_ARGS) as llm:
        params = SamplingParams(**GREEDY, max_tokens=10, output_kind=RequestOutputKind.FINAL_ONLY)
        llm.add_request("0", PROMPTS[0], params)
        llm.add_request("2", PROMPTS[1], params)
        mine = llm.generate(PROMPTS[2:], SamplingParams(**GREEDY, max_tokens=4), use_tqdm=False)
        ids = [out.request_id for out in mine]
        assert len(set(ids)) == 3 and not set(ids) & {"0", "2"}
        assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, PROMPTS[2:], token_ids(mine))
        theirs = drain(llm)
        assert set(theirs) == {"0", "2"} and all(len(outputs) == 1 for outputs in theirs.values())
        assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, PROMPTS[:2], token_ids(theirs["0"] + theirs["2"]))
        llm.add_request("5", PROMPTS[0])
        with pytest.raises(ValueError, match="request id '5' is already queued"):
            llm.add_request("5", PROMPTS[1])


# --- threads ---

def test_a_second_thread_is_refused_while_the_first_runs(llm, tiny_gqa, hf_model_cache, monkeypatch):
    """The second thread calls while the first is inside a step; it is refused before it changes anything,
    and the first thread's generate() completes as if alone."""
    inside, tried, refusals = threading.Event(), threading.Event(), {}
    execute, first = llm.executor.execute_model, threading.current_thread()

    def execute_model(step):
        if threading.current_thread() is first and not inside.is_set():
            inside.set()
            tried.wait(timeout=60)
        return execute(step)

    def second_thread():
        inside.wait(timeout=60)
        calls = {"generate": lambda: llm.generate(PROMPTS[:1], use_tqdm=False), "step": llm.step,
                 "add_request": lambda: llm.add_request("x", PROMPTS[0]),
                 "abort_request": lambda: llm.abort_request("0"),
                 "reset_prefix_cache": lambda: llm.reset_prefix_cache(True), "exit": llm.exit}
        for name, call in calls.items():
            try:
                call()
            except Exception as error:  # noqa: BLE001 -- recorded, then checked by the first thread
                refusals[name] = error
        tried.set()

    monkeypatch.setattr(llm.executor, "execute_model", execute_model)
    other = threading.Thread(target=second_thread, daemon=True)
    other.start()
    mine = llm.generate(PROMPTS, SamplingParams(**GREEDY, max_tokens=5), use_tqdm=False)
    other.join(timeout=60)
    assert set(refusals) == {"generate", "step", "add_request", "abort_request", "reset_prefix_cache", "exit"}
    for error in refusals.values():
        assert isinstance(error, RuntimeError) and "another thread" in str(error) and "not thread-safe" in str(error)
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, PROMPTS, token_ids(mine))
    assert all(len(out.outputs[0].token_ids) == 5 for out in mine) and not llm.requests
    # Taking turns is fine: another thread may use the engine once the first is done.
    monkeypatch.undo()
    later, params = [], SamplingParams(**GREEDY, max_tokens=5)
    turn = threading.Thread(target=lambda: later.extend(llm.generate(PROMPTS[:2], params, use_tqdm=False)))
    turn.start()
    turn.join(timeout=60)
    assert [len(tokens) for tokens in token_ids(later)] == [5, 5]
    assert_greedy_matches_transformers(hf_model_cache, tiny_gqa, PROMPTS[:2], token_ids(later))


# --- after exit() ---

def test_calls_after_exit_say_the_engine_was_shut_down(tiny_gqa):
    llm = LLM(tiny_gqa, **ENGINE_ARGS)
    llm.add_request("queued", PROMPTS[0], SamplingParams(**GREEDY, max_tokens=4))
    llm.exit()
    llm.exit()  # harmless
    calls = [lambda: llm.generate(PROMPTS[:1], use_tqdm=False), llm.step, lambda: llm.add_request("x", PROMPTS[0]),
             lambda: llm.abort_request("queued"), lambda: llm.chat([{"role": "user", "content": "hi"}]),
             lambda: next(llm.generate_as_completed(PROMPTS[:1])), llm.reset_prefix_cache]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"shut down by exit\(\)"):
            call()
    with llm:  # a with block on an engine already shut down exits quietly
        pass


def test_two_engines_stepped_from_two_threads_each_see_their_own_steps(tiny_gqa, tiny_mha):
    """Each thread's steps carry their own attention metadata: two engines generating at once from two threads
    give the tokens each gives alone."""
    prompts, params = [[1, 2, 3, 4, 5], [7, 8]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engines = [LLM(path, **ENGINE_ARGS) for path in (tiny_gqa, tiny_mha)]
    try:
        alone = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for llm in engines]
        together = [None, None]

        def run(i):
            together[i] = [[o.outputs[0].token_ids for o in engines[i].generate(prompts, params, use_tqdm=False)]
                           for _ in range(3)]
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert together == [[alone[0]] * 3, [alone[1]] * 3]
    finally:
        for llm in engines:
            llm.exit()


@pytest.mark.parametrize("arrival_time", ["now", float("nan"), 10**400])
def test_an_arrival_time_that_is_no_time_is_refused_before_queueing(llm, arrival_time):
    """It would fail the step that finishes the request (its latency is computed from it), losing that step's
    other requests."""
    with pytest.raises(ValueError, match="arrival_time must be None or a time in seconds"):
        llm.add_request("late", PROMPTS[0], SamplingParams(**GREEDY, max_tokens=2), arrival_time=arrival_time)
    llm.add_request("on time", PROMPTS[1], SamplingParams(**GREEDY, max_tokens=2), arrival_time=1.0)
    assert [out.finished for out in drain(llm)["on time"]] == [False, True]
