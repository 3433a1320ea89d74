"""A batch output file that a run can be killed in and resumed from.

Each result is one line written with a single write and flushed, so a killed run leaves whole lines
and at most one torn last line. Opening the file again cuts that line off and counts, per custom_id,
the lines already there; the runner skips that many occurrences of each custom_id in the input, so a
run killed at any moment and started again serves every input line exactly once.
"""
import json
import os
from collections import Counter

TAIL_BLOCK_BYTES = 1 << 16


class BatchOutputFile:

    def __init__(self, path: str):
        self.path = path
        self.num_torn_bytes = cut_torn_last_line(path) if os.path.exists(path) else 0
        self.num_written = count_custom_ids(path) if os.path.exists(path) else Counter()
        self.file = open(path, "a", encoding="utf-8")

    def write(self, line: dict):
        self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.file.flush()  # in the kernel's hands: survives the process being killed

    def sync(self):
        """Flush to the disk itself, so that a result written survives a power loss too."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self):
        self.sync()
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def cut_torn_last_line(path: str) -> int:
    """Truncate the file after its last newline; returns the number of bytes cut."""
    with open(path, "rb+") as f:
        size = end = f.seek(0, os.SEEK_END)
        keep = 0
        while end > 0:
            start = max(0, end - TAIL_BLOCK_BYTES)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        f.truncate(keep)
    return size - keep


def count_custom_ids(path: str) -> Counter:
    """custom_id -> lines with it (None: lines whose input had no readable custom_id)."""
    counts = Counter()
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            try:
                counts[json.loads(line)["custom_id"]] += 1
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path} line {line_no} is not a batch output line ({e!r}): "
                                 f"give a new output file, or the one an earlier run wrote") from e
    return counts
