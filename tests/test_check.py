"""``tigon check`` end to end, in-process: every op runs against its reference and passes, and a
failing op, or a gradient tigon does not compute, turns into a failing exit status rather than a
silent "yes"."""

import pytest

from tigon import check
from tigon.cli import main as cli


@pytest.mark.slow
def test_every_op_passes(capsys):
    assert cli(["check"]) == 0

    lines = capsys.readouterr().out.splitlines()
    names = [case.name for case in check._cases(small=True)]
    for name in names:
        rows = [line for line in lines if line.split()[:1] == [name]]
        assert len(rows) == 1, f"{name}: expected one row, got {rows}"
        assert rows[0].split()[-1] == "yes", rows[0]
    assert lines[-1] == f"{len(names)} passed, 0 failed"


def test_an_op_over_its_tolerance_fails(capsys, monkeypatch):
    rms_norm = next(case for case in check._cases(small=True) if case.name == "rms_norm")
    monkeypatch.setattr(check, "_cases", lambda small: [rms_norm])
    monkeypatch.setattr(check, "TOLERANCE", {rms_norm.dtype: 0.0})

    assert check.main() == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split()[0] == "rms_norm" and lines[-2].split()[-1] == "NO"
    assert lines[-1] == "0 passed, 1 failed"


def test_a_missing_gradient_fails(capsys, monkeypatch):
    """An input the reference differentiates but tigon leaves without a gradient fails the op (an
    infinite gradient error), rather than dropping out of the comparison."""
    rope = next(case for case in check._cases(small=True) if case.name == "rope")
    run = rope.run

    def tables_dropped(module, inputs):
        if module is check.F:
            inputs = {**inputs, "cos": inputs["cos"].detach(), "sin": inputs["sin"].detach()}
        return run(module, inputs)

    monkeypatch.setattr(rope, "run", tables_dropped)
    monkeypatch.setattr(check, "_cases", lambda small: [rope])

    assert check.main() == 1
    row = capsys.readouterr().out.splitlines()[-2].split()
    assert row[0] == "rope" and row[-1] == "NO" and "inf" in row
