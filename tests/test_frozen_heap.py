"""`nanovllm.utils.frozen_heap`: the start-up heap frozen for a step loop and nothing of it kept after."""
import gc
import weakref

from nanovllm.utils.frozen_heap import frozen_heap


class Node:
    pass


def cycle() -> weakref.ref:
    """A reference cycle no name holds, which only the cyclic collector can free."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_objects_made_before_are_skipped_and_those_made_during_are_collected():
    before = cycle()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        during = cycle()
        gc.collect()
        assert before() is not None  # frozen: no collection looks at it
        assert during() is None
    gc.collect()
    assert before() is None  # unfrozen with the loop's end


def test_nested_loops_unfreeze_with_the_outermost():
    with frozen_heap():
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_an_error_in_the_loop_unfreezes():
    try:
        with frozen_heap():
            raise KeyError("in a step")
    except KeyError:
        pass
    assert gc.get_freeze_count() == 0


def test_generate_steps_with_the_heap_frozen_and_leaves_it_unfrozen(tiny_gqa):
    from nanovllm import LLM, SamplingParams
    with LLM(tiny_gqa, device="cpu", enforce_eager=True, max_model_len=128) as llm:
        frozen_counts, step = [], llm.step
        llm.step = lambda: (frozen_counts.append(gc.get_freeze_count()), step())[1]
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert frozen_counts and min(frozen_counts) > 0
    assert gc.get_freeze_count() == 0
