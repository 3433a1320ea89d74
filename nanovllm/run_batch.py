"""Run an OpenAI batch file through the engine, after vLLM's `run_batch`:

    python -m nanovllm.run_batch -i requests.jsonl -o results.jsonl --model PATH [engine options]

Both paths are checked before the engine is built: the input must be readable, the output a file that can
be made or this tool's own earlier output (anything else is refused untouched). The input is read a chunk
at a time into one running engine, the next chunk joining while the last one's tail still runs, so memory
does not grow with the file; results are appended to the output as requests finish and synced to disk
every chunk's worth of lines. Started again with the same output file, it skips the requests already
written there and cuts off a last line that a crash left unfinished, so every request ends up in the
output exactly once.
"""
import argparse
import itertools
import sys
from collections import Counter
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.entrypoints.input_file import BatchFileError, BatchInputFile
from nanovllm.entrypoints.openai_batch import BatchLineError, BatchRequest, load_line, make_request
from nanovllm.entrypoints.openai_responses import error_line, result_line
from nanovllm.entrypoints.output_file import BatchOutputFile
from nanovllm.entrypoints.pooling_batch import (
    PoolingBatchRequest,
    is_pooling_line,
    make_pooling_request,
    pooling_result_line,
)
from nanovllm.outputs import PoolingRequestOutput, RequestOutput
from nanovllm.sampling_params import final_only
from nanovllm.utils.argparse_utils import FlexibleArgumentParser
from nanovllm.utils.frozen_heap import frozen_heap

DEFAULT_CHUNK_SIZE = 2048  # twice max_num_seqs on a large GPU: full batches until half a chunk is done


class BatchRun:
    """One pass over an input file, appending to an output file and counting what it did.

    The lines are read a chunk at a time into one running engine: the next chunk joins once fewer than
    half a chunk's requests are left, so no chunk waits for the tail of the one before, and memory holds
    at most a chunk and a half. Results are written as requests finish and synced to disk every chunk's
    worth of lines. A custom_id's first line is always written before its repeats (which are refused). A pooling
    line (`/v1/embeddings`, `/v1/score`, `/v1/rerank`) is an engine request per prompt it holds, queued with all
    the others, so every line's prompts are batched together; it is written when the last of them is done."""

    def __init__(self, llm, output: BatchOutputFile, model_name: str, pbar: tqdm, chunk_size: int):
        self.llm, self.output, self.model_name, self.pbar = llm, output, model_name, pbar
        self.chunk_size = chunk_size
        self.num_seen = Counter()  # custom_id -> occurrences read so far
        self.num_served = self.num_failed = self.num_skipped = self.num_generated_tokens = self.num_pooled_tokens = 0
        self.lines_in_engine = 0  # a pooling line may be several engine requests
        # engine request id -> (its line's request, line number)
        self.in_engine: dict[str, tuple[BatchRequest | PoolingBatchRequest, int]] = {}
        self.held_repeats: dict[str, list[dict]] = {}  # custom_id in the engine -> its repeats' error lines
        self.request_ids = itertools.count()
        self.unsynced = 0
        self.start = perf_counter()

    def run(self, lines):
        """Serve (line number, line) pairs, all of them, keeping the engine full across chunks."""
        lines = iter(lines)
        more = True
        with frozen_heap():
            while more or self.in_engine:
                if more and self.lines_in_engine < self.chunk_size // 2 + 1:
                    chunk = list(itertools.islice(lines, self.chunk_size))
                    more = bool(chunk)
                    self.add_chunk(chunk)
                elif self.in_engine:
                    for output in self.llm.step():
                        if output.finished and output.request_id in self.in_engine:
                            self.finish(output)
        self.output.sync()

    def add_chunk(self, lines: list[tuple[int, bytes]]):
        """The chunk's new lines: errors written at once, valid requests into the engine, repeats of a
        custom_id written after its first line's result."""
        for line_no, line in lines:
            request, custom_id, error = load_line(line)
            self.num_seen[custom_id] += 1
            if self.num_seen[custom_id] <= self.output.num_written[custom_id]:
                self.num_skipped += 1
                self.pbar.update()
            elif custom_id is not None and self.num_seen[custom_id] > 1:
                self.repeat(custom_id, error_line(custom_id, "duplicate_custom_id", f"line {line_no}: custom_id "
                                                  f"{custom_id!r} was used before; custom_ids must be unique"))
            elif error:
                self.write(error_line(custom_id, error.code, f"line {line_no}: {error}"))
            else:
                self.add(request, custom_id, line_no)

    def add(self, request: dict, custom_id: str | None, line_no: int):
        request_id = f"line-{next(self.request_ids)}"
        try:
            batch_request, engine_requests = self.make_requests(request, request_id)
        except BatchLineError as e:
            self.write(error_line(custom_id, e.code, f"line {line_no}: {e}"))
        except ValueError as e:
            self.write(error_line(custom_id, "invalid_request", f"line {line_no}: {e}"))
        else:
            with self.llm.guard:
                for engine_request in engine_requests:
                    self.llm.add_checked_request(engine_request)
                    self.in_engine[engine_request.request_id] = batch_request, line_no
            self.lines_in_engine += 1
            self.held_repeats.setdefault(custom_id, [])

    def make_requests(self, request: dict, request_id: str) -> tuple[BatchRequest | PoolingBatchRequest, list]:
        """The line's request and the engine's requests it makes, all checked, none queued; raises ValueError."""
        if is_pooling_line(request):
            pooling_request = make_pooling_request(self.llm, request, request_id)
            return pooling_request, pooling_request.requests
        batch_request = make_request(self.llm, request)
        params = final_only(batch_request.sampling_params)
        return batch_request, [self.llm.input_processor.make_request(request_id, batch_request.prompt_token_ids,
                                                                     params)]

    def repeat(self, custom_id: str, line: dict):
        if custom_id in self.held_repeats:
            self.held_repeats[custom_id].append(line)
        else:
            self.write(line)

    def finish(self, output: RequestOutput | PoolingRequestOutput):
        request, _ = self.in_engine.pop(output.request_id)
        if isinstance(request, PoolingBatchRequest):
            self.num_pooled_tokens += len(output.prompt_token_ids)
            if not request.take(output):
                return  # the line's other prompts are still in the engine
            self.write(pooling_result_line(request, self.model_name))
        else:
            self.num_generated_tokens += sum(len(c.token_ids) for c in output.outputs)
            self.write(result_line(request, output, self.model_name))
        self.lines_in_engine -= 1
        for line in self.held_repeats.pop(request.custom_id, []):
            self.write(line)

    def write(self, line: dict):
        self.output.write(line)
        if line["error"] is None:
            self.num_served += 1
        else:
            self.num_failed += 1
        self.pbar.set_postfix_str(f"output {self.num_generated_tokens / self.elapsed:.0f} tok/s", refresh=False)
        self.pbar.update()
        self.unsynced += 1
        if self.unsynced >= self.chunk_size:
            self.output.sync()
            self.unsynced = 0

    @property
    def elapsed(self) -> float:
        return max(perf_counter() - self.start, 1e-9)

    def summary(self) -> str:
        return (f"{self.num_served} served, {self.num_failed} failed, {self.num_skipped} already in "
                f"{self.output.path}; {self.num_generated_tokens} tokens generated"
                f"{f', {self.num_pooled_tokens} prompt tokens pooled' if self.num_pooled_tokens else ''}"
                f" in {self.elapsed:.1f} s")


def run_batch(llm, input_path: str, output_path: str, model_name: str, chunk_size: int = DEFAULT_CHUNK_SIZE,
              use_tqdm: bool = True) -> BatchRun:
    """Serve every line of `input_path` not yet in `output_path`, appending the results there. Raises
    BatchFileError, before anything is written, for a path that cannot be used."""
    with BatchInputFile(input_path) as source, BatchOutputFile(output_path, source.stat) as output:
        return serve_batch(llm, source, output, model_name, chunk_size, use_tqdm)


def serve_batch(llm, source: BatchInputFile, output: BatchOutputFile, model_name: str, chunk_size: int,
                use_tqdm: bool) -> BatchRun:
    """run_batch on files already checked."""
    output.start()
    with tqdm(total=source.num_lines, unit="req", desc="Batch", disable=not use_tqdm) as pbar:
        if output.num_torn_bytes:
            pbar.write(f"{output.path}: cut off a last line torn by an earlier run ({output.num_torn_bytes} bytes)")
        run = BatchRun(llm, output, model_name, pbar, chunk_size)
        try:
            run.run(source.lines())
        finally:
            llm.abort_request(list(run.in_engine))  # an error or an interrupt leaves the engine usable
    return run


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


class EngineRefused(ValueError):
    """An engine option or checkpoint the engine refuses when it starts, named in the message; nothing was written."""


def start_engine(args: dict):
    """The engine of the command line's options; raises EngineRefused."""
    from nanovllm import LLM
    try:
        return LLM(**args)
    except ValueError as error:
        raise EngineRefused(str(error)) from error


def main(argv: list[str] | None = None):
    parser = make_parser()
    args = vars(parser.parse_args(argv))
    if args["chunk_size"] < 1:
        parser.error(f"--chunk-size must be >= 1, got {args['chunk_size']}")
    options = ("input_file", "output_file", "served_model_name", "chunk_size", "no_progress")
    input_file, output_file, model_name, chunk_size, no_progress = (args.pop(name) for name in options)
    try:
        with BatchInputFile(input_file) as source, BatchOutputFile(output_file, source.stat) as output, \
                start_engine(args) as llm:
            run = serve_batch(llm, source, output, model_name or args["model"], chunk_size, use_tqdm=not no_progress)
    except (BatchFileError, EngineRefused) as e:
        sys.exit(f"{parser.prog}: error: {e}")
    print(run.summary(), file=sys.stderr)


if __name__ == "__main__":
    main()
