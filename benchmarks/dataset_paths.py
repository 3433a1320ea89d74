"""A dataset through the engine's three doors, on the same rows: `LLM.generate`, Ray Data with one replica
(`nanovllm.ray`, its start-up included) and `python -m nanovllm.run_batch` end to end; each against `LLM(...)`
plus `generate` on the same requests, in this process and in a new one (as a replica and run_batch start: its
imports and start-up included), to tell a new process's start-up apart from the rest. Each Ray run also gives its
replica's timeline. Prints a markdown table and writes dataset_paths.json into --out.

    python -m benchmarks.dataset_paths --random-checkpoint /tmp/q06 [--rows 2048,6144] [--batch-sizes 64,256]
        [--in-flight 4,8,16] [--paths ray,run_batch] [--batch-lines 4096] [--out DIR]

Rows: 100-1,024 random prompt tokens, 100-512 output tokens, temperature 0.6, ignore_eos, and one row too long
for the window (it gets its error); batch files: 20-600 prompt tokens, 16-400 output. On a CPU,
`--model TINY --rows 64 --batch-sizes 16 --batch-lines 64 --scale 0.1 --max-model-len 256
--engine-args '{"device": "cpu", "kvcache_block_size": 16}'` checks that it runs.
"""
import argparse
import importlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from time import perf_counter

MODULE_IMPORTED = time.time()  # in a Ray replica's process: when Ray unpickled TimedReplica there

from benchmarks.startup import process_age_s  # noqa: E402
from benchmarks.workloads import Draw, max_token_id, vocab_size  # noqa: E402
from nanovllm.ray import NanoVLLMReplica  # noqa: E402

TIMELINE_ENV = "NANOVLLM_BENCH_REPLICA_TIMELINE"  # the file a TimedReplica appends its times to


def rows(n: int, draw: Draw, prompt_lens: tuple[int, int], output_lens: tuple[int, int]) -> list[dict]:
    return [{"id": i, "prompt": draw.tokens(draw.length(*prompt_lens)),
             "sampling_params": {"temperature": 0.6, "ignore_eos": True, "max_tokens": draw.length(*output_lens)}}
            for i in range(n)]


def generate(llm, dataset: list[dict]) -> int:
    """Generate the rows in one call; returns the output tokens."""
    from nanovllm import SamplingParams
    outputs = llm.generate([row["prompt"] for row in dataset],
                           [SamplingParams(**row["sampling_params"]) for row in dataset], use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def llm_and_generate_seconds(model: str, engine_args: dict, dataset: list[dict]) -> float:
    from nanovllm import LLM
    start = perf_counter()
    with LLM(model, **engine_args) as llm:
        generate(llm, dataset)
    return perf_counter() - start


FRESH_PROCESS = """
import json, sys
from nanovllm import LLM, SamplingParams
rows = json.load(open(sys.argv[1]))
with LLM(sys.argv[2], **json.loads(sys.argv[3])) as llm:
    llm.generate([r["prompt"] for r in rows], [SamplingParams(**r["sampling_params"]) for r in rows], use_tqdm=False)
"""


def fresh_process_seconds(model: str, engine_args: dict, dataset: list[dict]) -> float:
    """LLM(...) plus generate on the rows in a new Python process, as a replica or run_batch starts: its start and
    imports included."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "rows.json")
        with open(path, "w") as f:
            json.dump(dataset, f)
        start = perf_counter()
        subprocess.run([sys.executable, "-c", FRESH_PROCESS, path, model, json.dumps(engine_args)], check=True)
        return perf_counter() - start


class TimedReplica(NanoVLLMReplica):
    """A replica that appends to $NANOVLLM_BENCH_REPLICA_TIMELINE, at its first batch, the wall-clock times of its
    process's creation, this module's import there, its constructor's start and end, and that batch. Ray must
    pickle it by reference, so that the replica's process imports this module: ray_rate takes it from
    `benchmarks.dataset_paths`, never from `__main__`."""

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


def replica_timeline(start: float, end: float) -> dict:
    """Seconds between the marks of the last replica's timeline (TimedReplica), from the dataset's start."""
    with open(os.environ[TIMELINE_ENV]) as f:
        times = json.loads(f.readlines()[-1])
    marks = [("process_created", start, times["process_created"]),  # negative: Ray started it before the dataset
             ("until_class_unpickled", start, times["module_imported"]),
             ("until_constructor", times["module_imported"], times["init_start"]),
             ("constructor", times["init_start"], times["init_end"]),
             ("until_first_batch", times["init_end"], times["first_batch"]),
             ("first_batch_to_end", times["first_batch"], end)]
    return {name: round(b - a, 2) for name, a, b in marks}


def ray_rate(model: str, engine_args: dict, dataset: list[dict], batch_size: int, in_flight: int) -> tuple[float, dict]:
    """Output tok/s of one replica over the rows, its start-up included, and the replica's timeline."""
    import ray

    from nanovllm.ray import NanoVLLMProcessorConfig, build_llm_processor
    config = NanoVLLMProcessorConfig(model_source=model, engine_kwargs=engine_args, batch_size=batch_size,
                                     max_concurrent_batches=in_flight)
    processor = build_llm_processor(config)
    processor.replica_class = importlib.import_module("benchmarks.dataset_paths").TimedReplica
    start, wall_start = perf_counter(), time.time()
    got = processor(ray.data.from_items(dataset)).take_all()
    seconds = perf_counter() - start
    assert len(got) == len(dataset) and sum(row["error"] is not None for row in got) == 1
    return (sum(row["num_generated_tokens"] or 0 for row in got) / seconds,
            replica_timeline(wall_start, wall_start + seconds))


def ray_runs(args, engine_args: dict, draw: Draw) -> list[dict]:
    """For each row count: generate's rate, a fresh process's, and each Ray setting's with its timeline."""
    from nanovllm import LLM
    runs = []
    for n in map(int, args.rows.split(",")):
        dataset = rows(n, draw, (100, 1024), (100, 512))
        dataset[n // 2]["prompt"] = [1] * (args.max_model_len + 1)  # refused with an error, as a user's bad row is
        good = [row for row in dataset if len(row["prompt"]) <= args.max_model_len]
        with LLM(args.model, **engine_args) as llm:
            start = perf_counter()
            generate_rate = generate(llm, good) / (perf_counter() - start)
        fresh_rate = sum(row["sampling_params"]["max_tokens"] for row in good) / fresh_process_seconds(
            args.model, engine_args, good)
        for batch_size, in_flight in itertools.product(map(int, args.batch_sizes.split(",")),
                                                       map(int, args.in_flight.split(","))):
            rate, timeline = ray_rate(args.model, engine_args, dataset, batch_size, in_flight)
            runs.append(dict(rows=n, batch_size=batch_size, in_flight=in_flight, ray=round(rate),
                             generate=round(generate_rate), fresh_process=round(fresh_rate), timeline=timeline))
            print(json.dumps(runs[-1]), flush=True)
    return runs


def ray_table(runs: list[dict]) -> list[str]:
    table = ["| rows | batch_size | batches in flight | Ray Data, out tok/s | generate, out tok/s | ratio | a fresh "
             "process's LLM(...) plus generate, out tok/s | Ray / that | the replica's timeline, s |",
             "| --- " * 9 + "|"]
    for r in runs:
        timeline = ", ".join(f"{name} {s}" for name, s in r["timeline"].items())
        table.append(f"| {r['rows']:,} | {r['batch_size']} | {r['in_flight']} | {r['ray']:,} | {r['generate']:,} | "
                     f"{r['ray'] / r['generate']:.2f}x | {r['fresh_process']:,} | {r['ray'] / r['fresh_process']:.2f}x "
                     f"| {timeline} |")
    return table


def write_batch_file(path: str, dataset: list[dict]):
    """The rows as completion requests of OpenAI's batch format."""
    with open(path, "w") as f:
        for row in dataset:
            body = {"model": "m", "prompt": row["prompt"], **row["sampling_params"]}
            f.write(json.dumps({"custom_id": f"r{row['id']}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")


def run_batch_report(args, engine_args: dict, draw: Draw) -> dict:
    """run_batch end to end on a batch file, and LLM(...) plus generate on its requests here and in a fresh process."""
    with tempfile.TemporaryDirectory() as folder:
        requests, results = os.path.join(folder, "in.jsonl"), os.path.join(folder, "out.jsonl")
        dataset = rows(args.batch_lines, draw, (20, 600), (16, 400))
        write_batch_file(requests, dataset)
        flags = [f"--{name.replace('_', '-')}={value}" for name, value in engine_args.items()]
        start = perf_counter()
        subprocess.run([sys.executable, "-m", "nanovllm.run_batch", "-i", requests, "-o", results, "--model",
                        args.model, "--no-progress", *flags], check=True)
        end_to_end = perf_counter() - start
    return dict(lines=args.batch_lines, end_to_end_s=round(end_to_end, 2),
                llm_and_generate_s=round(llm_and_generate_seconds(args.model, engine_args, dataset), 2),
                fresh_process_s=round(fresh_process_seconds(args.model, engine_args, dataset), 2))


def run_batch_line(r: dict) -> str:
    end_to_end, direct, fresh = r["end_to_end_s"], r["llm_and_generate_s"], r["fresh_process_s"]
    return (f"\nrun_batch, {r['lines']:,} lines: {end_to_end:.1f} s end to end against {direct:.1f} s for LLM(...) "
            f"plus generate ({direct / end_to_end:.2f}x) and {fresh:.1f} s for them in a fresh process "
            f"({fresh / end_to_end:.2f}x)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model")
    model.add_argument("--random-checkpoint", metavar="DIR", help="a random Qwen3-0.6B-sized checkpoint, made here")
    parser.add_argument("--rows", default="2048,6144")
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--in-flight", default="8", help="max_concurrent_batches values, e.g. 4,8,16")
    parser.add_argument("--paths", default="ray,run_batch", help="which of ray and run_batch to run")
    parser.add_argument("--batch-lines", type=int, default=4096, help="requests in run_batch's file")
    parser.add_argument("--engine-args", type=json.loads, default={})
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--scale", type=float, default=1.0, help="lengths scaled by this (CPU smoke runs)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.random_checkpoint:
        from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint
        args.model = random_qwen3_0_6b_checkpoint(args.random_checkpoint)
    engine_args = {"max_model_len": args.max_model_len, **args.engine_args}
    token_ids_below = max_token_id(vocab_size(args.model))
    report, table = dict(ray=[], run_batch=None), []
    if "ray" in args.paths.split(","):
        import ray
        os.environ[TIMELINE_ENV] = os.path.join(tempfile.mkdtemp(), "timeline.jsonl")  # before the replicas start
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        report["ray"] = ray_runs(args, engine_args, Draw(args.scale, token_ids_below, seed=0))
        table += ray_table(report["ray"])
    if "run_batch" in args.paths.split(","):
        report["run_batch"] = run_batch_report(args, engine_args, Draw(args.scale, token_ids_below, seed=1))
        table.append(run_batch_line(report["run_batch"]))
    print("\n".join(table))
    with open(os.path.join(args.out, "dataset_paths.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
