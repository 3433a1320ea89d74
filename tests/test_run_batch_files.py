"""What `run_batch` reads and what it writes to: the input read as bytes, a line at a time, whatever kind of file
it is; the output taken only when it is this tool's own, and both paths checked before the engine is built.
The references are the bytes on disk and the JSON the tests parse themselves."""
import json
import os

import pytest

from nanovllm import LLM
from nanovllm.entrypoints.input_file import BatchFileError
from nanovllm.entrypoints.output_file import BatchOutputFile
from nanovllm.run_batch import BatchRun, main, run_batch

from conftest import read_jsonl

ENGINE_ARGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=256)

RESULT = {"id": "nanovllm-1", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None}
ERROR = {"id": "nanovllm-2", "custom_id": None, "response": None, "error": {"code": "invalid_json", "message": "x"}}


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    with LLM(tiny_gqa, **ENGINE_ARGS) as engine:
        yield engine


def jsonl(*lines) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def request_line(custom_id) -> bytes:
    return jsonl({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "hello world", "max_tokens": 2, "temperature": 0}})


def assert_error(line, code, message):
    assert line["custom_id"] is None and line["response"] is None
    assert line["error"]["code"] == code and message in line["error"]["message"], line["error"]


def serve_bytes(llm, tmp_path, data: bytes) -> tuple[BatchRun, list[dict]]:
    (tmp_path / "in.jsonl").write_bytes(data)
    run = run_batch(llm, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "tiny", 4, use_tqdm=False)
    return run, read_jsonl(tmp_path / "out.jsonl")


# --- the output file: only this tool's own is written to ---

NOT_RESULTS = {
    "a note without a newline": b"my notes",
    "JSON without a trailing newline": b'{\n  "a": 1\n}',
    "a request file": request_line("a") + request_line("b"),
    "a request file without a trailing newline": (request_line("a") + request_line("b"))[:-1],
    "results with a request after them": jsonl(RESULT) + request_line("b"),
    "results and a last line that is not a result's start": jsonl(RESULT, ERROR) + b"PS: more notes",
    "a line begun like a result that is not one": jsonl(RESULT, {"id": "nanovllm-3", "custom_id": "b"}),
    "a result with a request's fields": jsonl({**RESULT, "method": "POST"}),
    "a result with neither response nor error": jsonl({**RESULT, "response": None}),
    "a result line that is not UTF-8": jsonl(RESULT) + b'{"id": "nanovllm-\xff"}\n',
    "a result line nested too deep": b'{"id": "nanovllm-4", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
}


@pytest.mark.parametrize("content", NOT_RESULTS.values(), ids=NOT_RESULTS.keys())
def test_an_output_file_that_is_not_this_tools_results_is_refused_byte_for_byte_unchanged(tmp_path, content):
    path = tmp_path / "out.jsonl"
    path.write_bytes(content)
    with pytest.raises(BatchFileError, match="is not a batch output line.*left unchanged") as e:
        BatchOutputFile(str(path))
    assert str(path) in str(e.value)
    assert path.read_bytes() == content


TAKEN = {  # (whole lines, what a killed run left after them, custom_id -> lines)
    "an empty file": (b"", b"", {}),
    "whole results": (jsonl(RESULT, ERROR, RESULT), b"", {"a": 2, None: 1}),
    "results and a torn last line": (jsonl(RESULT, ERROR), b'{"id": "nanovllm-5", "custom_id": "b", "resp',
                                     {"a": 1, None: 1}),
    "a torn first line, cut inside its opening": (b"", b'{"id": "na', {}),
}


@pytest.mark.parametrize("whole, torn, counts", TAKEN.values(), ids=TAKEN.keys())
def test_this_tools_output_is_taken_its_torn_line_cut_only_when_writing_starts(tmp_path, whole, torn, counts):
    path = tmp_path / "out.jsonl"
    path.write_bytes(whole + torn)
    with BatchOutputFile(str(path)) as output:
        assert (dict(output.num_written), output.num_torn_bytes) == (counts, len(torn))
        assert path.read_bytes() == whole + torn
        output.start()
        output.write(ERROR)
    assert path.read_bytes() == whole + jsonl(ERROR)


def test_two_runs_cannot_hold_one_output_file(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(jsonl(RESULT))
    with BatchOutputFile(str(path)):
        with pytest.raises(BatchFileError, match="is being written by another run"):
            BatchOutputFile(str(path))


def test_an_output_file_written_to_between_its_check_and_the_run_is_not_cut(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(jsonl(RESULT) + b'{"id": "nanovllm-5", "cus')
    with BatchOutputFile(str(path)) as output:
        with open(path, "ab") as other_program:
            other_program.write(b'tom_id": "b"}\n')
        with pytest.raises(BatchFileError, match="changed after it was checked"):
            output.start()
    assert path.read_bytes() == jsonl(RESULT) + b'{"id": "nanovllm-5", "custom_id": "b"}\n'


def test_an_output_file_made_between_its_check_and_the_run_is_left_alone(tmp_path):
    """Two runs started at once on one new output: the second to open it is refused, saying why."""
    path = tmp_path / "out.jsonl"
    with BatchOutputFile(str(path)) as output:
        path.write_bytes(jsonl(RESULT))
        with pytest.raises(BatchFileError, match="was made by another program after it was checked: start again"):
            output.start()
    assert path.read_bytes() == jsonl(RESULT)


def test_results_stream_into_a_pipe(llm, tmp_path):
    read_end, write_end = os.pipe()
    (tmp_path / "in.jsonl").write_bytes(request_line("a") + request_line("b"))
    run_batch(llm, str(tmp_path / "in.jsonl"), f"/dev/fd/{write_end}", "tiny", use_tqdm=False)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        lines = [json.loads(line) for line in pipe]
    assert sorted(line["custom_id"] for line in lines) == ["a", "b"] and all(line["error"] is None for line in lines)


# --- both paths are checked before the engine is built ---

def refusal(tmp_path, input_path, output_path) -> str:
    """main's error for these paths, with a model that does not exist: a check that came after the engine
    was built would fail on the model instead."""
    with pytest.raises(SystemExit) as e:
        main(["-i", str(input_path), "-o", str(output_path), "--model", str(tmp_path / "no-model"), "--no-progress"])
    return str(e.value.code)


def test_a_missing_or_unreadable_input_is_refused_before_the_engine_and_no_output_is_made(tmp_path):
    out = tmp_path / "out.jsonl"
    assert f"input file '{tmp_path / 'missing.jsonl'}' cannot be read: No such file or directory" in \
        refusal(tmp_path, tmp_path / "missing.jsonl", out)
    assert f"input file '{tmp_path}' cannot be read: Is a directory" in refusal(tmp_path, tmp_path, out)
    assert not out.exists()


def test_an_output_path_that_cannot_take_results_is_refused_before_the_engine(tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_bytes(request_line("a"))
    assert f"'{tmp_path / 'none' / 'out.jsonl'}' cannot be made: folder '{tmp_path / 'none'}' does not exist" in \
        refusal(tmp_path, requests, tmp_path / "none" / "out.jsonl")
    assert f"output file '{tmp_path}' is a folder" in refusal(tmp_path, requests, tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes")
    assert f"output file '{notes}' line 1 is not a batch output line" in refusal(tmp_path, requests, notes)
    assert notes.read_bytes() == b"my notes"
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "notes.txt"]


def test_a_link_to_nothing_as_the_output_is_refused_before_the_engine(tmp_path):
    """Opening it would fail once the engine was built, with "File exists"."""
    requests = tmp_path / "in.jsonl"
    requests.write_bytes(request_line("a"))
    os.symlink(tmp_path / "elsewhere.jsonl", tmp_path / "link.jsonl")
    assert f"output file '{tmp_path / 'link.jsonl'}' is a link to '{tmp_path / 'elsewhere.jsonl'}', which does not " \
           f"exist" in refusal(tmp_path, requests, tmp_path / "link.jsonl")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "link.jsonl"]


def test_an_engine_option_or_checkpoint_refused_ends_the_run_with_its_message(tmp_path):
    """One line naming the problem, as for the files, not a traceback; no output file is made."""
    requests = tmp_path / "in.jsonl"
    requests.write_bytes(request_line("a"))
    assert refusal(tmp_path, requests, tmp_path / "out.jsonl") == \
        f"nanovllm-run-batch: error: model folder '{tmp_path / 'no-model'}' does not exist"
    assert not (tmp_path / "out.jsonl").exists()


def test_the_input_is_refused_as_the_output_under_any_name(tmp_path):
    requests = tmp_path / "in.jsonl"
    content = request_line("a") + request_line("b")[:-1]
    requests.write_bytes(content)
    os.symlink(requests, tmp_path / "link.jsonl")
    os.link(requests, tmp_path / "hard.jsonl")
    for name in ("in.jsonl", "link.jsonl", "hard.jsonl"):
        assert f"output file '{tmp_path / name}' is the input file" in refusal(tmp_path, requests, tmp_path / name)
    assert requests.read_bytes() == content


# --- the input: bytes, decoded a line at a time ---

def test_a_line_that_cannot_be_read_fails_alone_and_a_rerun_skips_it(llm, tmp_path):
    data = (b"\xef\xbb\xbf" + request_line("bom") +  # a UTF-8 byte-order mark opens the file
            b'{"custom_id": "latin-1 \xe9t\xe9"}\n' +
            b"[" * 100_000 + b"]" * 100_000 + b"\n" +
            b'{"custom_id": "big", "n": ' + b"9" * 5000 + b"}\n" +
            request_line("last"))
    run, lines = serve_bytes(llm, tmp_path, data)
    assert (run.num_served, run.num_failed) == (2, 3)
    assert sorted(line["custom_id"] for line in lines if line["error"] is None) == ["bom", "last"]
    errors = [line for line in lines if line["error"] is not None]
    assert_error(errors[0], "invalid_json", "line 2: the line is not UTF-8 text")
    assert_error(errors[1], "invalid_json", "line 3: the line nests arrays or objects too deep")
    assert_error(errors[2], "invalid_json", "line 4: the line cannot be read: Exceeds the limit (4300 digits)")

    before = (tmp_path / "out.jsonl").read_bytes()
    again = run_batch(llm, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "tiny", use_tqdm=False)
    assert (again.num_served, again.num_failed, again.num_skipped) == (0, 0, 5)
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_a_custom_id_that_is_not_valid_unicode_is_written_as_its_escape_and_resumed(llm, tmp_path):
    run, lines = serve_bytes(llm, tmp_path, request_line("\udc80") + request_line("b"))
    assert {line["custom_id"] for line in lines} == {"\udc80", "b"} and run.num_served == 2
    assert b'"custom_id": "\\udc80"' in (tmp_path / "out.jsonl").read_bytes()
    again = run_batch(llm, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "tiny", use_tqdm=False)
    assert again.num_skipped == 2


def test_a_pipe_is_read_once_and_every_line_served(llm, tmp_path):
    """`-i /dev/stdin` or `-i <(cmd)`: a stream that counting lines for the progress bar would drain."""
    read_end, write_end = os.pipe()
    os.write(write_end, request_line("a") + b"\n" + request_line("b") + request_line("c"))
    os.close(write_end)
    try:
        run = run_batch(llm, f"/dev/fd/{read_end}", str(tmp_path / "out.jsonl"), "tiny", use_tqdm=False)
    finally:
        os.close(read_end)
    assert run.num_served == 3
    assert sorted(line["custom_id"] for line in read_jsonl(tmp_path / "out.jsonl")) == ["a", "b", "c"]
