"""A batch input file, read as bytes and decoded a line at a time by the runner, so that a line that is not
UTF-8 (or not JSON) fails alone. It is opened before the engine is built, so a path that cannot be read is
refused at once. A regular file is counted first, for the progress bar's total; a pipe (`-i /dev/stdin`,
`-i <(cmd)`) can be read only once, so it is not counted.
"""
import codecs
import os
import stat
from collections.abc import Iterator


class BatchFileError(ValueError):
    """An input or output path that cannot be used, named in the message; nothing was written."""


class BatchInputFile:

    def __init__(self, path: str):
        self.path = path
        try:
            self.file = open(path, "rb")
        except OSError as e:
            raise BatchFileError(f"input file {path!r} cannot be read: {e.strerror}") from e
        self.stat = os.fstat(self.file.fileno())
        self.num_lines = self._count_lines() if stat.S_ISREG(self.stat.st_mode) else None

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, line) for each line that is not blank; a UTF-8 byte-order mark opening the file is
        left out."""
        for line_no, line in enumerate(self.file, 1):
            if line_no == 1:
                line = line.removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield line_no, line

    def _count_lines(self) -> int:
        num_lines = sum(1 for _ in self.lines())
        self.file.seek(0)
        return num_lines

    def close(self):
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

