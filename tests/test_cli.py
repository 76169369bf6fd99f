"""The ``tigon`` command's conventions: ``--version``, help on a bare ``tigon``, a help text (and
the default, where there is one) on every option of every command, and a CPU demo that claims no
speed."""

import argparse
import importlib.metadata
import sys

import pytest
import torch

import tigon
from tigon import cli
from tigon.cli import main as tigon_command

# Each command and subcommand, as its arguments before --help.
COMMANDS = [[], ["check"], ["demo"], ["export-kernels"], ["bench"], ["bench", "e2e"], ["bench", "moe"],
            ["bench", "longctx"]]


def test_version(capsys):
    assert tigon_command(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"tigon {tigon.__version__} from ")
    assert f"torch {torch.__version__}" in line
    # The version is written twice, in pyproject.toml and in tigon/__init__.py: they must agree.
    assert tigon.__version__ == importlib.metadata.version("tigon")


def test_version_names_the_integrations_without_importing_them(capsys, monkeypatch):
    """A bug report needs the versions of the libraries tigon plugs into, read from their
    metadata: none is imported (each made unimportable here), a missing one says so."""
    for name in cli.INTEGRATIONS:
        monkeypatch.setitem(sys.modules, name, None)
    version = importlib.metadata.version

    def without_bitsandbytes(distribution):
        if distribution == "bitsandbytes":
            raise importlib.metadata.PackageNotFoundError(distribution)
        return version(distribution)

    monkeypatch.setattr(importlib.metadata, "version", without_bitsandbytes)
    assert tigon_command(["--version"]) == 0
    out = capsys.readouterr().out
    for name in ("transformers", "peft", "trl", "accelerate", "deepspeed", "torchao"):
        assert f"{name} {version(name)}" in out
    assert "bitsandbytes not installed" in out


def test_bare_tigon_prints_the_help(capsys):
    """Bare ``tigon`` is a request for help, as bare ``pip``: help on stdout, exit 0."""
    assert tigon_command([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tigon")
    for name, (_, summary) in cli.COMMANDS.items():
        assert name in out
        assert " ".join(summary.split()[:3]) in " ".join(out.split())


def test_an_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tigon_command(["chek"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'chek'" in capsys.readouterr().err


def _parsers(monkeypatch, argv):
    """Every parser that parses ``tigon <argv> --help``: the command's own, however it builds it."""
    parsers = []
    parse_known_args = argparse.ArgumentParser.parse_known_args

    def recording(self, *args, **kwargs):
        if self not in parsers:
            parsers.append(self)
        return parse_known_args(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", recording)
    with pytest.raises(SystemExit) as exit_info:
        tigon_command([*argv, "--help"])
    assert exit_info.value.code == 0
    return parsers


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(["tigon", *argv]))
def test_every_option_has_help(monkeypatch, capsys, argv):
    parsers = _parsers(monkeypatch, argv)
    assert parsers
    missing = []
    for parser in parsers:
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            name = "/".join(action.option_strings) or action.dest
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{parser.prog} {c.dest}: no help" for c in action._choices_actions if not c.help]
                continue
            if not action.help:
                missing.append(f"{parser.prog} {name}: no help")
            # A flag's False and an unset None need no mention; any other default is shown.
            elif action.default not in (None, False) and "default" not in action.help:
                missing.append(f"{parser.prog} {name}: default {action.default!r} not shown")
    assert missing == []
    assert capsys.readouterr().out.startswith(f"usage: {' '.join(['tigon', *argv])}")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU demo's output")
def test_demo_on_the_cpu_claims_no_speed(capsys, tmp_path):
    """Through the interpreter a speed says nothing of a GPU's: no tokens/s, no rate on the
    progress bars; the losses of both runs and the figure are there."""
    assert tigon_command(["demo", "--steps", "2", "--seq-len", "8", "--batch", "1", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    for speed in ("tokens/s", "it/s", "s/it", "x tokens"):
        assert speed not in captured.out and speed not in captured.err
    assert "speed is not measured" in captured.out
    assert "first loss" in captured.out and "largest per-step loss difference" in captured.out
    assert (tmp_path / "demo.png").stat().st_size > 0


def _no_work(monkeypatch):
    """Training or timing anything fails the test: the checks must stop the command before."""
    from tigon import demo
    from tigon.bench import command

    def work(*args, **kwargs):
        raise AssertionError("the command started its work")

    for module, name in ((demo, "build_model"), (demo, "train"), (command, "_sweep"), (command, "load_providers")):
        monkeypatch.setattr(module, name, work)


@pytest.mark.parametrize("argv", [["demo", "--steps", "1"], ["bench", "rms_norm"]], ids=" ".join)
def test_a_missing_bench_extra_stops_before_the_work(monkeypatch, argv):
    """Without matplotlib the command exits at once with one line saying what to install, not with
    a traceback after training or timing."""
    _no_work(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_info:
        tigon_command(argv)
    message = str(exit_info.value.code)
    assert message.startswith(f"tigon {argv[0]} needs matplotlib, not installed here")
    assert "not installed here: pip install matplotlib (tigon's bench extra" in message and "\n" not in message


@pytest.mark.parametrize("option, value, expected", [
    ("--steps", "0", "expected an integer >= 1"),
    ("--steps", "-1", "expected an integer >= 1"),
    ("--seq-len", "1", "expected an integer >= 2"),
    ("--batch", "0", "expected an integer >= 1"),
    ("--lr", "0", "expected a finite number > 0"),
    ("--lr", "nan", "expected a finite number > 0"),
    ("--seq-len", "100000", "the bundled corpus has"),
])
def test_demo_refuses_nonsensical_sizes(monkeypatch, capsys, option, value, expected):
    """argparse's usage error names the option, the value and what it expects, before any work."""
    _no_work(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        tigon_command(["demo", option, value])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"tigon demo: error: argument {option}")
    assert expected in error and value in error
