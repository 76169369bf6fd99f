"""``tigon check`` end to end, in-process: every public op has a case and passes in fp32 and bf16,
and a wrong output, an op over its tolerance, a gradient tigon does not compute or an op that
raises turns into a failing exit status rather than a silent "yes"."""

import dataclasses
import inspect
import re

import pytest
import torch

import tigon.functional
import tigon.losses
from tigon import check
from tigon.cli import main as cli


def _case(name):
    return next(case for case in check.cases(small=True) if case.name == name)


def _rows(lines, name):
    return [line.split() for line in lines if line.split()[:1] == [name]]


@pytest.mark.slow
def test_every_op_passes(capsys):
    assert cli(["check"]) == 0

    lines = capsys.readouterr().out.splitlines()
    names = [case.name for case in check.cases(small=True)]
    for name in names:
        rows = _rows(lines, name)
        assert [row[-6] for row in rows] == list(check.DEFAULT_DTYPES), f"{name}: one row per dtype, got {rows}"
        assert all(row[-1] == "yes" for row in rows), rows
    assert lines[-1] == f"{len(names) * len(check.DEFAULT_DTYPES)} passed, 0 failed"


def test_every_public_op_has_a_case():
    """A new function of tigon.functional or loss of tigon.losses cannot be left out of the check.
    A loss function counts as checked through the loss class whose code calls it."""
    ops = {case.op for case in check.cases(small=True)}
    functional = [
        function for name, function in inspect.getmembers(tigon.functional, inspect.isfunction)
        if not name.startswith("_") and function.__module__ == tigon.functional.__name__
    ]
    assert sorted(f.__name__ for f in functional) == sorted(tigon.functional.__all__)
    assert [f.__name__ for f in functional if f not in ops] == []

    public = [getattr(tigon.losses, name) for name in tigon.losses.__all__]
    classes = [obj for obj in public if inspect.isclass(obj)]
    assert [cls.__name__ for cls in classes if cls not in ops] == []
    checked_classes = "\n".join(inspect.getsource(op) for op in ops if inspect.isclass(op))
    unchecked = [
        f.__name__ for f in public
        if not inspect.isclass(f) and f not in ops and not re.search(rf"\b{f.__name__}\b", checked_classes)
    ]
    assert unchecked == []


def test_a_wrong_output_fails(capsys, monkeypatch):
    """swiglu's output 5% too large: its rows fail and the exit status is 1."""
    swiglu = _case("swiglu")
    monkeypatch.setattr(swiglu, "op", lambda gate, up: 1.05 * tigon.functional.swiglu(gate, up))
    monkeypatch.setattr(check, "cases", lambda small: [swiglu])

    assert cli(["check"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [row[-1] for row in _rows(lines, "swiglu")] == ["NO", "NO"]
    assert lines[-1] == "0 passed, 2 failed"


def test_fp16_on_request(capsys):
    """fp16, tested by the suite, is checked on request against its own tolerance."""
    assert check.main(["rms_norm", "--dtypes", "fp16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    [row] = _rows(lines, "rms_norm")
    assert row[-6] == "fp16" and row[-1] == "yes"
    assert float(row[-3]) == check.TOLERANCE[torch.float16]


def test_an_op_over_its_tolerance_fails(capsys, monkeypatch):
    monkeypatch.setattr(check, "TOLERANCE", {dtype: 0.0 for dtype in check.TOLERANCE})

    assert check.main(["rms_norm", "--dtypes", "bf16"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [row[-1] for row in _rows(lines, "rms_norm")] == ["NO"]
    assert lines[-1] == "0 passed, 1 failed"


def test_a_missing_gradient_fails(capsys, monkeypatch):
    """An input the reference differentiates but tigon leaves without a gradient fails the op (an
    infinite gradient error), rather than dropping out of the comparison."""
    rope = _case("rope")

    def tables_dropped(cos, sin, **inputs):
        return tigon.functional.rope(cos=cos.detach(), sin=sin.detach(), **inputs)

    monkeypatch.setattr(rope, "op", tables_dropped)
    monkeypatch.setattr(check, "cases", lambda small: [rope])

    assert check.main(["--dtypes", "fp32"]) == 1
    row = capsys.readouterr().out.splitlines()[-2].split()
    assert row[0] == "rope" and row[-1] == "NO" and "inf" in row


def test_an_op_that_raises_fails_and_the_others_still_run(capsys, monkeypatch):
    def broken(**_):
        raise RuntimeError("kernel exploded")

    relu2 = _case("relu2")
    cases = [dataclasses.replace(relu2, name="broken", op=broken), relu2]
    monkeypatch.setattr(check, "cases", lambda small: cases)

    assert check.main(["--dtypes", "bf16"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "raised RuntimeError: kernel exploded" in lines[-3] and lines[-3].endswith("NO")
    assert _rows(lines, "relu2")[0][-1] == "yes"
    assert lines[-1] == "1 passed, 1 failed"


def test_unknown_op_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        check.main(["rms_nrom"])
    assert exit_info.value.code == 2
    assert "unknown op(s) rms_nrom" in capsys.readouterr().err
