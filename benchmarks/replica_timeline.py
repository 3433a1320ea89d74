"""Where a Ray replica's time goes, as `benchmarks.dataset_paths` reports it: a replica class that notes, as
wall-clock times, when its process was created, when Ray unpickled its class there (importing this module),
when its constructor began and ended, and when its first batch came; and the seconds between them.

In a module of its own, not the benchmark's `__main__`, so that Ray pickles the class by reference and the
replica's process imports this module itself.
"""
import json
import os
import time

MODULE_IMPORTED = time.time()

from benchmarks.startup import process_age_s  # noqa: E402
from nanovllm.ray import NanoVLLMReplica  # noqa: E402

TIMELINE_ENV = "NANOVLLM_BENCH_REPLICA_TIMELINE"  # the file a TimedReplica appends its times to


class TimedReplica(NanoVLLMReplica):
    """A replica that appends its times to $NANOVLLM_BENCH_REPLICA_TIMELINE at its first batch."""

    def __init__(self, model: str, engine_kwargs: dict):
        self.times = dict(process_created=time.time() - process_age_s(), module_imported=MODULE_IMPORTED,
                          init_start=time.time())
        super().__init__(model, engine_kwargs)
        self.times["init_end"] = time.time()

    async def __call__(self, batch):
        if "first_batch" not in self.times:
            self.times["first_batch"] = time.time()
            with open(os.environ[TIMELINE_ENV], "a") as f:
                f.write(json.dumps(self.times) + "\n")
        return await super().__call__(batch)


def replica_timeline(path: str, start: float, end: float) -> dict:
    """Seconds between the marks of the one replica's timeline (TimedReplica), from the dataset's start."""
    with open(path) as f:
        times = json.loads(f.readlines()[-1])
    marks = [("process_created", start, times["process_created"]),  # negative: Ray started it before the dataset
             ("until_class_unpickled", start, times["module_imported"]),
             ("until_constructor", times["module_imported"], times["init_start"]),
             ("constructor", times["init_start"], times["init_end"]),
             ("until_first_batch", times["init_end"], times["first_batch"]),
             ("first_batch_to_end", times["first_batch"], end)]
    return {name: round(b - a, 2) for name, a, b in marks}
