"""Datasets through the engine's three doors, on the same rows, in one process (issue 25): `LLM.generate`,
Ray Data with one replica (`nanovllm.ray`, its start-up included), and `python -m nanovllm.run_batch` end to
end against `LLM(...)` plus `generate` on the same requests; and, for both, `LLM(...)` plus `generate` in a
new Python process, as a replica and run_batch start (its imports and start-up included), to tell the
start-up of a process apart from the rest. Prints a markdown table and writes JSON.

    python -m benchmarks.dataset_paths --random-checkpoint /tmp/q06 [--rows 2048,6144] [--batch-sizes 64,256]
        [--in-flight 4,8,16] [--paths ray,run_batch] [--no-fresh-process]

Each Ray run also gives its replica's timeline (`benchmarks/replica_timeline.py`).

Rows: 100-1,024 random prompt tokens, 100-512 output tokens, temperature 0.6, ignore_eos, and one row too
long for the window (it gets its error); batch files: 4,096 lines of 20-600 prompt tokens, 16-400 output.
On a CPU, `--model TINY --rows 64 --batch-sizes 16 --batch-lines 64 --scale 0.1 --max-model-len 256
--engine-args '{"device": "cpu", "kvcache_block_size": 16}'` checks that it runs.
"""
import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from time import perf_counter

from benchmarks.replica_timeline import TIMELINE_ENV, TimedReplica, replica_timeline


class Draw:
    """Seeded lengths scaled by `scale` (at least 1) and token ids below `max_token_id`."""

    def __init__(self, scale: float, max_token_id: int, seed: int):
        self.rng, self.scale, self.max_token_id = random.Random(seed), scale, max_token_id

    def length(self, low: int, high: int) -> int:
        return max(1, round(self.rng.randint(low, high) * self.scale))

    def tokens(self, low: int, high: int) -> list[int]:
        return [self.rng.randrange(self.max_token_id) for _ in range(self.length(low, high))]


def rows(n: int, draw: Draw, max_model_len: int) -> list[dict]:
    out = [{"id": i, "prompt": draw.tokens(100, 1024),
            "sampling_params": {"temperature": 0.6, "ignore_eos": True, "max_tokens": draw.length(100, 512)}}
           for i in range(n)]
    out[n // 2]["prompt"] = [1] * (max_model_len + 1)  # refused with an error, as a user's bad row is
    return out


def generate_rate(llm, dataset: list[dict]) -> float:
    """Output tok/s of one generate over the rows that fit."""
    from nanovllm import SamplingParams
    good = [row for row in dataset if len(row["prompt"]) <= llm.config.max_model_len]
    start = perf_counter()
    outputs = llm.generate([row["prompt"] for row in good], [SamplingParams(**row["sampling_params"]) for row in good],
                           use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (perf_counter() - start)


FRESH_PROCESS = """
import json, sys
from nanovllm import LLM, SamplingParams
rows = json.load(open(sys.argv[1]))
with LLM(sys.argv[2], **json.loads(sys.argv[3])) as llm:
    llm.generate([r["prompt"] for r in rows], [SamplingParams(**r["sampling_params"]) for r in rows], use_tqdm=False)
"""


def fresh_process_seconds(model: str, engine_args: dict, dataset: list[dict]) -> float:
    """`LLM(...)` plus `generate` on the rows in a new Python process, as a replica or run_batch starts: its
    imports and start-up included."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "rows.json")
        with open(path, "w") as f:
            json.dump(dataset, f)
        start = perf_counter()
        subprocess.run([sys.executable, "-c", FRESH_PROCESS, path, model, json.dumps(engine_args)], check=True)
        return perf_counter() - start


def ray_rate(model: str, engine_args: dict, dataset: list[dict], batch_size: int, in_flight: int) -> tuple[float, dict]:
    """Output tok/s of one replica over the rows, its start-up included, and the replica's timeline."""
    import ray

    from nanovllm.ray import NanoVLLMProcessorConfig, build_llm_processor
    config = NanoVLLMProcessorConfig(model_source=model, engine_kwargs=engine_args, batch_size=batch_size,
                                     max_concurrent_batches=in_flight)
    processor = build_llm_processor(config)
    processor.replica_class = TimedReplica
    start, wall_start = perf_counter(), time.time()
    got = processor(ray.data.from_items(dataset)).take_all()
    seconds = perf_counter() - start
    assert len(got) == len(dataset) and sum(row["error"] is not None for row in got) == 1
    timeline = replica_timeline(os.environ[TIMELINE_ENV], wall_start, wall_start + seconds)
    return sum(row["num_generated_tokens"] or 0 for row in got) / seconds, timeline


def batch_file(path: str, n: int, draw: Draw):
    with open(path, "w") as f:
        for i in range(n):
            body = {"model": "m", "prompt": draw.tokens(20, 600), "max_tokens": draw.length(16, 400),
                    "temperature": 0.6, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def run_batch_seconds(model: str, engine_args: dict, lines: int, draw: Draw,
                      fresh: bool = True) -> tuple[float, float, float | None]:
    """(run_batch end to end, LLM(...) plus generate, the same in a fresh process where `fresh`) on the batch
    file's requests."""
    from nanovllm import LLM, SamplingParams
    with tempfile.TemporaryDirectory() as folder:
        requests, results = os.path.join(folder, "in.jsonl"), os.path.join(folder, "out.jsonl")
        batch_file(requests, lines, draw)
        flags = [f"--{name.replace('_', '-')}={value}" for name, value in engine_args.items()]
        start = perf_counter()
        subprocess.run([sys.executable, "-m", "nanovllm.run_batch", "-i", requests, "-o", results, "--model", model,
                        "--no-progress", *flags], check=True)
        end_to_end = perf_counter() - start
        bodies = [json.loads(line)["body"] for line in open(requests)]
    params = [dict(temperature=0.6, ignore_eos=True, max_tokens=b["max_tokens"]) for b in bodies]
    dataset = [dict(prompt=b["prompt"], sampling_params=p) for b, p in zip(bodies, params)]
    start = perf_counter()
    with LLM(model, **engine_args) as llm:
        llm.generate([row["prompt"] for row in dataset], [SamplingParams(**row["sampling_params"]) for row in dataset],
                     use_tqdm=False)
    direct = perf_counter() - start
    return end_to_end, direct, fresh_process_seconds(model, engine_args, dataset) if fresh else None


def ray_runs(args, engine_args: dict, max_token_id: int, fresh: bool) -> list[dict]:
    """For each row count: generate's rate, a fresh process's, and each Ray setting's with its timeline."""
    from nanovllm import LLM
    runs = []
    for n in map(int, args.rows.split(",")):
        dataset = rows(n, Draw(args.scale, max_token_id, seed=0), args.max_model_len)
        with LLM(args.model, **engine_args) as llm:
            generate = generate_rate(llm, dataset)
        good = [row for row in dataset if len(row["prompt"]) <= args.max_model_len]
        fresh_rate = (sum(row["sampling_params"]["max_tokens"] for row in good) /
                      fresh_process_seconds(args.model, engine_args, good)) if fresh else None
        for batch_size, in_flight in itertools.product(map(int, args.batch_sizes.split(",")),
                                                       map(int, args.in_flight.split(","))):
            rate, timeline = ray_rate(args.model, engine_args, dataset, batch_size, in_flight)
            runs.append(dict(rows=n, batch_size=batch_size, in_flight=in_flight, ray=round(rate),
                             generate=round(generate), fresh_process=fresh_rate and round(fresh_rate),
                             timeline=timeline))
            print(json.dumps(runs[-1]), flush=True)
    return runs


def ray_table(runs: list[dict]) -> list[str]:
    table = ["| rows | batch_size | batches in flight | Ray Data, out tok/s | generate, out tok/s | ratio | a fresh "
             "process's LLM(...) plus generate, out tok/s | Ray / that | the replica's timeline, s |",
             "| --- " * 9 + "|"]
    for r in runs:
        fresh = f"{r['fresh_process']:,} | {r['ray'] / r['fresh_process']:.2f}x" if r["fresh_process"] else "- | -"
        timeline = ", ".join(f"{name} {s}" for name, s in r["timeline"].items())
        table.append(f"| {r['rows']:,} | {r['batch_size']} | {r['in_flight']} | {r['ray']:,} | {r['generate']:,} | "
                     f"{r['ray'] / r['generate']:.2f}x | {fresh} | {timeline} |")
    return table


def run_batch_report(args, engine_args: dict, max_token_id: int, fresh: bool) -> dict:
    end_to_end, direct, fresh_s = run_batch_seconds(args.model, engine_args, args.batch_lines,
                                                    Draw(args.scale, max_token_id, seed=1), fresh)
    return dict(lines=args.batch_lines, end_to_end_s=round(end_to_end, 2), llm_and_generate_s=round(direct, 2),
                fresh_process_s=fresh_s and round(fresh_s, 2))


def run_batch_line(r: dict) -> str:
    direct, end_to_end = r["llm_and_generate_s"], r["end_to_end_s"]
    line = (f"\nrun_batch, {r['lines']:,} lines: {end_to_end:.1f} s end to end against {direct:.1f} s for "
            f"LLM(...) plus generate ({direct / end_to_end:.2f}x)")
    if r["fresh_process_s"]:
        line += (f" and {r['fresh_process_s']:.1f} s for them in a fresh process "
                 f"({r['fresh_process_s'] / end_to_end:.2f}x)")
    return line


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model")
    model.add_argument("--random-checkpoint", metavar="DIR")
    parser.add_argument("--rows", default="2048,6144")
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--in-flight", default="8", help="max_concurrent_batches values, e.g. 4,8,16")
    parser.add_argument("--paths", default="ray,run_batch", help="which of ray and run_batch to run")
    parser.add_argument("--no-fresh-process", action="store_true",
                        help="leave out the fresh process's LLM(...) plus generate beside each path")
    parser.add_argument("--batch-lines", type=int, default=4096)
    parser.add_argument("--engine-args", type=json.loads, default={})
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--scale", type=float, default=1.0, help="lengths scaled by this (CPU smoke runs)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.random_checkpoint:
        from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint
        args.model = random_qwen3_0_6b_checkpoint(args.random_checkpoint)
    engine_args = {"max_model_len": args.max_model_len, **args.engine_args}
    from transformers import AutoConfig

    max_token_id = min(10000, AutoConfig.from_pretrained(args.model).vocab_size)
    paths = args.paths.split(",")
    fresh = not args.no_fresh_process
    report = dict(ray=[], run_batch=None)
    table = []
    if "ray" in paths:
        import ray
        os.environ[TIMELINE_ENV] = os.path.join(tempfile.mkdtemp(), "timeline.jsonl")
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        report["ray"] = ray_runs(args, engine_args, max_token_id, fresh)
        table += ray_table(report["ray"])
    if "run_batch" in paths:
        report["run_batch"] = run_batch_report(args, engine_args, max_token_id, fresh)
        table.append(run_batch_line(report["run_batch"]))
    print("\n".join(table))
    with open(os.path.join(args.out, "dataset_paths.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
