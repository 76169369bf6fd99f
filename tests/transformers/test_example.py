"""The Trainer and SFTTrainer examples run as a user would run them, for a couple of steps."""

import math
import re
import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "train_hf_trainer.py"
SFT_EXAMPLE = EXAMPLES / "train_sft_trl.py"
SFT_ARGUMENTS = ["--steps", "2", "--batch-size", "2", "--seq-len", "32"]


def run_example(path, arguments, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), *arguments])
    runpy.run_path(str(path), run_name="__main__")
    return capsys.readouterr().out


def sft_losses(printed):
    """The first logged, the average train and the eval loss the SFT example prints last."""
    match = re.search(r"first logged loss (\S+), train loss (\S+), eval loss (\S+)", printed)
    assert match, printed
    return [float(loss) for loss in match.groups()]


def test_trainer_example_runs(monkeypatch, tmp_path, capsys):
    arguments = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--output-dir", str(tmp_path)]
    printed = run_example(EXAMPLE, arguments, monkeypatch, capsys)
    assert "norm layer: TigonLlamaRMSNorm" in printed and "eval_loss" in printed


def test_sft_trainer_example_runs(monkeypatch, tmp_path, capsys):
    printed = run_example(SFT_EXAMPLE, [*SFT_ARGUMENTS, "--output-dir", str(tmp_path)], monkeypatch, capsys)
    assert "norm layer: TigonLlamaRMSNorm" in printed
    assert all(math.isfinite(loss) for loss in sft_losses(printed))


def test_sft_trainer_example_matches_hugging_face(monkeypatch, capsys):
    # Unpatched first: patching changes Llama's modeling module until the fixture restores it.
    plain = run_example(SFT_EXAMPLE, [*SFT_ARGUMENTS, "--no-tigon"], monkeypatch, capsys)
    patched = run_example(SFT_EXAMPLE, SFT_ARGUMENTS, monkeypatch, capsys)
    assert "norm layer: LlamaRMSNorm" in plain and "norm layer: TigonLlamaRMSNorm" in patched
    # The same weights and batches: the first step's loss agrees, and so does the eval loss after
    # training (the first step's learning rate is 0 in warmup; the second updates the weights from
    # gradients through tigon's backward).
    (plain_first, _, plain_eval), (patched_first, _, patched_eval) = sft_losses(plain), sft_losses(patched)
    assert math.isclose(patched_first, plain_first, abs_tol=1e-4)
    assert math.isclose(patched_eval, plain_eval, abs_tol=1e-4)
