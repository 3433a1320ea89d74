"""Python's cyclic garbage collector kept off the start-up heap while the engine steps.

A process that has built an engine holds a million or more objects (torch's, transformers', the model's)
that live until it exits; each full collection scans them all, so a step loop that makes many small objects
(requests, rows, outputs) pays for collections of the start-up heap at random steps. `frozen_heap()` moves
every object made so far into the collector's permanent generation (`gc.freeze`, as vLLM's engine does
after start-up) for the loop's time, and back after (`gc.unfreeze`), so objects made during the loop are
collected as usual and nothing of the engine is kept from a later collection once it is dropped.
"""
import contextlib
import gc

_depth = 0  # loops inside loops freeze once and unfreeze with the outermost


@contextlib.contextmanager
def frozen_heap():
    global _depth
    if _depth == 0:
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()
