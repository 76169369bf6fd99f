"""The Trainer example runs as a user would run it, for a couple of steps (the TRL examples:
tests/trl/test_examples.py)."""

import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hf_trainer.py"


def test_trainer_example_runs(monkeypatch, tmp_path, capsys):
    arguments = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--output-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *arguments])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    printed = capsys.readouterr().out
    assert "norm layer: TigonLlamaRMSNorm" in printed and "eval_loss" in printed
