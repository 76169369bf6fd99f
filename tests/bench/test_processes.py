"""The child processes of the training benchmarks: the last ``RESULT`` line counts, and a child
that fails or runs past its time keeps what it printed."""

import sys

from tigon.bench.processes import RESULT, launch


def child(code: str) -> list[str]:
    """A Python child running ``code``, with ``print_result`` as tigon's (without importing torch)."""
    prelude = f"import json\ndef print_result(result):\n    print({RESULT!r} + json.dumps(result), flush=True)\n"
    return [sys.executable, "-c", prelude + code]


def test_the_last_result_counts():
    assert launch(child("print_result([1])\nprint('noise')\nprint_result({'a': 2})"), "child", 60) == {"a": 2}


def test_a_child_killed_or_failing_keeps_what_it_printed(capsys):
    sleeper = child("import time\nprint_result({'so_far': 1})\ntime.sleep(60)")
    assert launch(sleeper, "sleeper", 3) == {"so_far": 1}
    assert "sleeper: timed out after 3 s" in capsys.readouterr().out
    assert launch(child("print_result([1])\nraise SystemExit(3)"), "crasher", 60) == [1]
    assert "crasher: failed (exit 3)" in capsys.readouterr().out
    assert launch(child("pass"), "silent", 60) is None
    assert "silent: printed no result" in capsys.readouterr().out
