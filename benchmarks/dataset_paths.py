"""A dataset through the engine's two dataset doors, Ray Data with one replica (`nanovllm.ray`) and `python -m
nanovllm.run_batch`, against what a user would run instead: a script, in a new Python process, that builds
`LLM(...)`, generates the same rows and writes them out (`SCRIPT`). Both sides pay a new process's start-up. Ray
Data's steady state, start-up apart, is compared with `generate` in a warm process: its output tokens over the time
from its replica's first batch to the end (the time once its first batch has returned would measure nothing when
every batch is in flight at once, as 8 batches of 256 of 2,048 rows are: they return together). Each Ray run gives
its replica's timeline. Prints a markdown table and writes dataset_paths.json into --out.

    python -m benchmarks.dataset_paths --random-checkpoint /tmp/q06 [--rows 2048,8192] [--batch-sizes 64,256]
        [--in-flight 4,8,16] [--paths ray,run_batch] [--batch-lines 4096] [--out DIR]

Rows: 100-1,024 random prompt tokens, 100-512 output tokens, temperature 0.6, ignore_eos, and one row too long
for the window (it gets its error; the script is given the others); batch files: 20-600 prompt tokens, 16-400
output. On a CPU, `--model TINY --rows 64 --batch-sizes 16 --batch-lines 64 --scale 0.1 --max-model-len 256
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


# What a user would run instead of a dataset path: rows in, LLM(...), generate, a JSON line out for each row.
SCRIPT = """
import json, sys
from nanovllm import LLM, SamplingParams
rows = json.load(open(sys.argv[1]))
with LLM(sys.argv[2], **json.loads(sys.argv[3])) as llm:
    outputs = llm.generate([r["prompt"] for r in rows], [SamplingParams(**r["sampling_params"]) for r in rows],
                           use_tqdm=False)
with open(sys.argv[4], "w") as f:
    for row, output in zip(rows, outputs):
        completion = output.outputs[0]
        f.write(json.dumps({"id": row["id"], "generated_text": completion.text,
                            "num_generated_tokens": len(completion.token_ids)}) + "\\n")
"""


def script_seconds(model: str, engine_args: dict, dataset: list[dict]) -> float:
    """SCRIPT on the rows in a new Python process, its start and imports included; checks the rows it wrote."""
    with tempfile.TemporaryDirectory() as folder:
        rows_in, rows_out = os.path.join(folder, "rows.json"), os.path.join(folder, "out.jsonl")
        with open(rows_in, "w") as f:
            json.dump(dataset, f)
        start = perf_counter()
        subprocess.run([sys.executable, "-c", SCRIPT, rows_in, model, json.dumps(engine_args), rows_out], check=True)
        seconds = perf_counter() - start
        with open(rows_out) as f:
            assert sum(1 for _ in f) == len(dataset)
    return seconds


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


def ray_run(model: str, engine_args: dict, dataset: list[dict], batch_size: int, in_flight: int) -> dict:
    """One replica over the rows, its start-up included: seconds, output tokens and the replica's timeline."""
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
    return dict(seconds=seconds, tokens=sum(row["num_generated_tokens"] or 0 for row in got),
                timeline=replica_timeline(wall_start, wall_start + seconds))


def ray_runs(args, engine_args: dict, draw: Draw) -> list[dict]:
    """For each row count: the script's rate and warm generate's, then each Ray setting's."""
    from nanovllm import LLM
    runs = []
    for n in map(int, args.rows.split(",")):
        dataset = rows(n, draw, (100, 1024), (100, 512))
        dataset[n // 2]["prompt"] = [1] * (args.max_model_len + 1)  # refused with an error, as a user's bad row is
        good = [row for row in dataset if len(row["prompt"]) <= args.max_model_len]
        with LLM(args.model, **engine_args) as llm:
            start = perf_counter()
            generated = generate(llm, good)
            generate_s = perf_counter() - start
        script_rate = generated / script_seconds(args.model, engine_args, good)  # ignore_eos: the same tokens
        for batch_size, in_flight in itertools.product(map(int, args.batch_sizes.split(",")),
                                                       map(int, args.in_flight.split(","))):
            run = ray_run(args.model, engine_args, dataset, batch_size, in_flight)
            runs.append(dict(rows=n, batch_size=batch_size, in_flight=in_flight,
                             ray=round(run["tokens"] / run["seconds"]), script=round(script_rate),
                             ray_steady=round(run["tokens"] / run["timeline"]["first_batch_to_end"]),
                             generate=round(generated / generate_s), timeline=run["timeline"]))
            print(json.dumps(runs[-1]), flush=True)
    return runs


def ray_table(runs: list[dict]) -> list[str]:
    table = ["| rows | batch_size | batches in flight | Ray Data, out tok/s | the script (a new process), out tok/s "
             "| ratio | Ray Data from its replica's first batch, out tok/s | warm `generate`, out tok/s | ratio | the "
             "replica's timeline, s |", "| --- " * 10 + "|"]
    for r in runs:
        timeline = ", ".join(f"{name} {s}" for name, s in r["timeline"].items())
        table.append(f"| {r['rows']:,} | {r['batch_size']} | {r['in_flight']} | {r['ray']:,} | {r['script']:,} | "
                     f"{r['ray'] / r['script']:.2f}x | {r['ray_steady']:,} | {r['generate']:,} "
                     f"| {r['ray_steady'] / r['generate']:.2f}x | {timeline} |")
    return table


def write_batch_file(path: str, dataset: list[dict]):
    """The rows as completion requests of OpenAI's batch format."""
    with open(path, "w") as f:
        for row in dataset:
            body = {"model": "m", "prompt": row["prompt"], **row["sampling_params"]}
            f.write(json.dumps({"custom_id": f"r{row['id']}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")


def run_batch_report(args, engine_args: dict, draw: Draw) -> dict:
    """run_batch end to end on a batch file, and the script on its requests."""
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
                script_s=round(script_seconds(args.model, engine_args, dataset), 2))


def run_batch_line(r: dict) -> str:
    return (f"\nrun_batch, {r['lines']:,} lines: {r['end_to_end_s']:.1f} s end to end against {r['script_s']:.1f} s "
            f"for the script on its requests ({r['script_s'] / r['end_to_end_s']:.2f}x)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model")
    model.add_argument("--random-checkpoint", metavar="DIR", help="a random Qwen3-0.6B-sized checkpoint, made here")
    parser.add_argument("--rows", default="2048,8192")
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
