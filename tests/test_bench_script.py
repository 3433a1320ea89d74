"""bench.py's arguments: lengths it cannot draw from are refused by name before any work."""
import sys

import pytest

import bench


@pytest.mark.parametrize("flag", ["--max-input-len", "--max-output-len"])
def test_a_length_under_the_shortest_draw_is_refused(monkeypatch, capsys, flag):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--random-checkpoint", "/nonexistent", flag, "64"])
    with pytest.raises(SystemExit):
        bench.parse_args()
    assert f"{flag} must be at least 100" in capsys.readouterr().err
