"""A batch output file that a run can be killed in and resumed from, and that takes nothing but results.

Each result is one line written with a single write and flushed, so a killed run leaves whole lines and at
most one torn last line. A file already there is read through before anything is written or cut, and is
taken only as this tool's own output: every line begins as `write` begins one, every whole line is a
result object, and what follows the last newline can only be a line a killed run left unfinished.
Anything else (notes, a request file, the input itself) is refused and left as it was. Then the torn line
is cut off and the lines already there are counted per custom_id; the runner skips that many occurrences
of each custom_id in the input, so a run killed at any moment and started again serves every input line
exactly once. The file is locked while a run holds it, so two runs cannot append to it at once.

A terminal or a pipe (`-o /dev/stdout`) takes the results as a stream, with nothing to resume.
"""
import fcntl
import json
import os
import stat
from collections import Counter

from nanovllm.entrypoints.input_file import BatchFileError

RESULT_KEYS = {"id", "custom_id", "response", "error"}
LINE_START = b'{"id": "nanovllm-'  # how every line of result_line and error_line begins


class BatchOutputFile:

    def __init__(self, path: str, input_stat: os.stat_result | None = None):
        """Check `path` without writing to it: a file that can be made, or this tool's output, and not the
        input. Raises BatchFileError."""
        self.path, self.file = path, None
        self.num_written, self.num_torn_bytes, self.size = Counter(), 0, 0
        self.stat = check_output_path(path, input_stat)
        self.is_stream = self.stat is not None and not stat.S_ISREG(self.stat.st_mode)
        if self.stat is not None and not self.is_stream:
            self.file = self._open_locked(os.O_RDWR)
            try:
                self.num_written, num_whole_bytes, self.num_torn_bytes = read_results(self.file, path)
            except BatchFileError:
                self.file.close()
                raise
            self.size = num_whole_bytes + self.num_torn_bytes

    def start(self):
        """Make the file, or cut off its torn last line, and write from its end."""
        if self.is_stream:
            self.file = open(self.path, "ab")
        elif self.file is None:
            self.file = self._open_locked(os.O_RDWR | os.O_CREAT | os.O_EXCL)
        else:
            self._check_unchanged()
            self.file.truncate(self.size - self.num_torn_bytes)
            self.file.seek(0, os.SEEK_END)

    def _open_locked(self, flags: int):
        try:
            file = os.fdopen(os.open(self.path, flags, 0o666), "rb+")
        except FileExistsError:  # made by another run or program while the engine was built
            raise BatchFileError(f"output file {self.path!r} was made by another program after it was checked: "
                                 f"start again (a run's own output is resumed)") from None
        except OSError as e:
            raise BatchFileError(f"output file {self.path!r} cannot be opened for writing: {e.strerror}") from e
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise BatchFileError(f"output file {self.path!r} is being written by another run") from None
        return file

    def _check_unchanged(self):
        """Another program may have written to the file while the engine was built."""
        try:
            now = os.stat(self.path)
        except OSError:
            now = None
        if now is None or not os.path.samestat(now, os.fstat(self.file.fileno())) or now.st_size != self.size:
            raise BatchFileError(f"output file {self.path!r} changed after it was checked: start again")

    def write(self, line: dict):
        self.file.write(encode(line))
        self.file.flush()  # in the kernel's hands: survives the process being killed

    def sync(self):
        """Flush to the disk itself, so that a result written survives a power loss too."""
        self.file.flush()
        if not self.is_stream:
            os.fsync(self.file.fileno())

    def close(self):
        if self.file is not None:
            self.sync()
            self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def encode(line: dict) -> bytes:
    try:
        return (json.dumps(line, ensure_ascii=False) + "\n").encode()
    except UnicodeEncodeError:  # a lone surrogate, from a "\ud800" in the input: kept as that escape
        return (json.dumps(line) + "\n").encode()


def check_output_path(path: str, input_stat: os.stat_result | None) -> os.stat_result | None:
    """The stat of what is at `path` (None where nothing is yet); raises BatchFileError where no results
    can go."""
    name = f"output file {path!r}"
    try:
        found = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):  # it cannot be made as a file of its own, nor its target through it
            raise BatchFileError(f"{name} is a link to {os.readlink(path)!r}, which does not exist: give the "
                                 f"target's own path, or remove the link") from None
        folder = os.path.dirname(path) or "."
        if not os.path.basename(path):
            raise BatchFileError(f"{name} names a folder, not a file") from None
        if not os.path.isdir(folder):
            raise BatchFileError(f"{name} cannot be made: folder {folder!r} does not exist") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise BatchFileError(f"{name} cannot be made: folder {folder!r} is not writable") from None
        return None
    except OSError as e:
        raise BatchFileError(f"{name} cannot be used: {e.strerror}") from e
    mode = found.st_mode
    if input_stat is not None and os.path.samestat(found, input_stat) and not stat.S_ISCHR(mode):
        raise BatchFileError(f"{name} is the input file: give the results a file of their own")
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        raise BatchFileError(f"{name} is {'a folder' if stat.S_ISDIR(mode) else 'not a file'}")
    return found


def read_results(file, path: str) -> tuple[Counter, int, int]:
    """(custom_id -> result lines, bytes up to the last newline, bytes after it) of an existing output file;
    raises BatchFileError for a file that is not this tool's output."""
    if not begins_like_a_result(file.read(len(LINE_START))):  # before reading a first line of any length
        raise not_ours(path, 1, "it does not begin like one")
    file.seek(0)
    num_written, num_whole_bytes = Counter(), 0
    for line_no, line in enumerate(file, 1):
        if not begins_like_a_result(line):
            raise not_ours(path, line_no, "it does not begin like one")
        if not line.endswith(b"\n"):
            return num_written, num_whole_bytes, len(line)
        num_written[result_custom_id(path, line_no, line)] += 1
        num_whole_bytes += len(line)
    return num_written, num_whole_bytes, 0


def begins_like_a_result(line: bytes) -> bool:
    """Whether `line` starts with LINE_START, or is a start of it."""
    return line[:len(LINE_START)] == LINE_START[:len(line)]


def result_custom_id(path: str, line_no: int, line: bytes) -> str | None:
    try:
        result = json.loads(line.decode())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise not_ours(path, line_no, f"{type(e).__name__}: {e}") from None
    if not is_result(result):
        raise not_ours(path, line_no, "it is not a result object")
    return result["custom_id"]


def is_result(line) -> bool:
    """The shape of what result_line and error_line make: a response or an error, not both."""
    return (isinstance(line, dict) and line.keys() == RESULT_KEYS and isinstance(line["id"], str)
            and isinstance(line["custom_id"], str | None) and None in (line["response"], line["error"])
            and isinstance(line["response"], dict) != isinstance(line["error"], dict))


def not_ours(path: str, line_no: int, why: str) -> BatchFileError:
    return BatchFileError(f"output file {path!r} line {line_no} is not a batch output line ({why}); the file was "
                          f"left unchanged: give a new output file, or the one an earlier run wrote")
