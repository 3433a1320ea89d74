"""Run an OpenAI batch file through the engine, after vLLM's `run_batch`:

    python -m nanovllm.run_batch -i requests.jsonl -o results.jsonl --model PATH [engine options]

The input is read and generated a chunk at a time, so memory does not grow with the file; each chunk's
results are appended to the output as they come and synced to disk when the chunk ends. Started again
with the same output file, it skips the requests already written there and cuts off a last line
that a crash left unfinished, so every request ends up in the output exactly once.
"""
import argparse
import itertools
import sys
from collections import Counter
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.entrypoints.openai_batch import BatchLineError, BatchRequest, load_line, make_request
from nanovllm.entrypoints.openai_responses import error_line, result_line
from nanovllm.entrypoints.output_file import BatchOutputFile
from nanovllm.utils.argparse_utils import FlexibleArgumentParser

DEFAULT_CHUNK_SIZE = 2048  # twice max_num_seqs on a large GPU: full batches until half a chunk is done


class BatchRun:
    """One pass over an input file, appending to an output file and counting what it did."""

    def __init__(self, llm, output: BatchOutputFile, model_name: str, pbar: tqdm):
        self.llm, self.output, self.model_name, self.pbar = llm, output, model_name, pbar
        self.num_seen = Counter()  # custom_id -> occurrences read so far
        self.num_served = self.num_failed = self.num_skipped = self.num_generated_tokens = 0
        self.start = perf_counter()

    def run_chunk(self, lines: list[tuple[int, str]]):
        """Serve the chunk's new lines: errors at once, the valid requests through the engine, and
        repeated custom_ids last, so that a custom_id's first line is always written before its repeats."""
        requests, line_nos, repeats = [], [], []
        for line_no, line in lines:
            request, custom_id, error = load_line(line)
            self.num_seen[custom_id] += 1
            if self.num_seen[custom_id] <= self.output.num_written[custom_id]:
                self.num_skipped += 1
                self.pbar.update()
            elif custom_id is not None and self.num_seen[custom_id] > 1:
                repeats.append(error_line(custom_id, "duplicate_custom_id", f"line {line_no}: custom_id "
                                          f"{custom_id!r} was used before; custom_ids must be unique"))
            elif error:
                self.write(error_line(custom_id, error.code, f"line {line_no}: {error}"))
            else:
                try:
                    requests.append(make_request(self.llm, request))
                    line_nos.append(line_no)
                except BatchLineError as e:
                    self.write(error_line(custom_id, e.code, f"line {line_no}: {e}"))
        self.generate(requests, line_nos)
        for line in repeats:
            self.write(line)
        self.output.sync()

    def generate(self, requests: list[BatchRequest], line_nos: list[int]):
        prompts = [r.prompt_token_ids for r in requests]
        params = [r.sampling_params for r in requests]
        for i, output in self.llm.generate_as_completed(prompts, params):
            if isinstance(output, ValueError):
                self.write(error_line(requests[i].custom_id, "invalid_request", f"line {line_nos[i]}: {output}"))
            else:
                self.num_generated_tokens += sum(len(c.token_ids) for c in output.outputs)
                self.write(result_line(requests[i], output, self.model_name))

    def write(self, line: dict):
        self.output.write(line)
        if line["error"] is None:
            self.num_served += 1
        else:
            self.num_failed += 1
        self.pbar.set_postfix_str(f"output {self.num_generated_tokens / self.elapsed:.0f} tok/s", refresh=False)
        self.pbar.update()

    @property
    def elapsed(self) -> float:
        return max(perf_counter() - self.start, 1e-9)

    def summary(self) -> str:
        return (f"{self.num_served} served, {self.num_failed} failed, {self.num_skipped} already in "
                f"{self.output.path}; {self.num_generated_tokens} tokens generated in {self.elapsed:.1f} s")


def run_batch(llm, input_path: str, output_path: str, model_name: str, chunk_size: int = DEFAULT_CHUNK_SIZE,
              use_tqdm: bool = True) -> BatchRun:
    """Serve every line of `input_path` not yet in `output_path`, appending the results there."""
    with BatchOutputFile(output_path) as output, open(input_path, encoding="utf-8") as f, \
            tqdm(total=count_lines(input_path), unit="req", desc="Batch", disable=not use_tqdm) as pbar:
        if output.num_torn_bytes:
            pbar.write(f"{output_path}: cut off a last line torn by an earlier run ({output.num_torn_bytes} bytes)")
        run = BatchRun(llm, output, model_name, pbar)
        lines = ((line_no, line) for line_no, line in enumerate(f, 1) if line.strip())
        while chunk := list(itertools.islice(lines, chunk_size)):
            run.run_chunk(chunk)
    return run


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def make_parser() -> argparse.ArgumentParser:
    from nanovllm.engine.arg_utils import EngineArgs
    parser = FlexibleArgumentParser(prog="nanovllm-run-batch", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-i", "--input-file", required=True, help="OpenAI batch requests, one JSON object a line")
    parser.add_argument("-o", "--output-file", required=True,
                        help="results, one JSON object a line; an existing file is resumed")
    parser.add_argument("--served-model-name", help="the responses' model (default: --model)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                        help=f"requests generated at a time (default: {DEFAULT_CHUNK_SIZE})")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    EngineArgs.add_cli_args(parser.add_argument_group("engine arguments (nanovllm.EngineArgs)"))
    return parser


def main(argv: list[str] | None = None):
    from nanovllm import LLM

    parser = make_parser()
    args = vars(parser.parse_args(argv))
    if args["chunk_size"] < 1:
        parser.error(f"--chunk-size must be >= 1, got {args['chunk_size']}")
    options = ("input_file", "output_file", "served_model_name", "chunk_size", "no_progress")
    input_file, output_file, model_name, chunk_size, no_progress = (args.pop(name) for name in options)
    with LLM(**args) as llm:
        run = run_batch(llm, input_file, output_file, model_name or args["model"], chunk_size,
                        use_tqdm=not no_progress)
    print(run.summary(), file=sys.stderr)


if __name__ == "__main__":
    main()
