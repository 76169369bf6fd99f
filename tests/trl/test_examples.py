"""The TRL examples run as a user would run them, for a couple of steps."""

import math
import re
import runpy
import sys
from pathlib import Path

from utils import needs_trl_fused_head

# The examples are written for TRL 1.16's trainers and fused LM head.
pytestmark = needs_trl_fused_head()

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SFT_EXAMPLE = EXAMPLES / "train_sft_trl.py"
SFT_ARGUMENTS = ["--steps", "2", "--batch-size", "2", "--seq-len", "32"]
GRPO_EXAMPLE = EXAMPLES / "grpo_trl.py"
GRPO_ARGUMENTS = [
    "--steps", "2", "--hidden-size", "32", "--layers", "1", "--prompts-per-step", "1", "--num-generations", "2",
    "--max-completion-length", "4",
]


def run_example(path, arguments, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), *arguments])
    runpy.run_path(str(path), run_name="__main__")
    return capsys.readouterr().out


def sft_losses(printed):
    """The first logged, the average train and the eval loss the SFT example prints last."""
    match = re.search(r"first logged loss (\S+), train loss (\S+), eval loss (\S+)", printed)
    assert match, printed
    return [float(loss) for loss in match.groups()]


def test_sft_trainer_example_runs(monkeypatch, tmp_path, capsys):
    printed = run_example(SFT_EXAMPLE, [*SFT_ARGUMENTS, "--output-dir", str(tmp_path)], monkeypatch, capsys)
    assert "norm layer: TigonLlamaRMSNorm" in printed
    assert all(math.isfinite(loss) for loss in sft_losses(printed))


def test_sft_trainer_example_matches_trl(monkeypatch, capsys):
    # Plain first: patching changes Llama's modeling module and TRL's head until the fixtures
    # restore them.
    plain = run_example(SFT_EXAMPLE, [*SFT_ARGUMENTS, "--no-tigon"], monkeypatch, capsys)
    patched = run_example(SFT_EXAMPLE, SFT_ARGUMENTS, monkeypatch, capsys)
    assert "norm layer: LlamaRMSNorm" in plain and "norm layer: TigonLlamaRMSNorm" in patched
    # The same weights and batches: the first step's loss agrees, and so does the eval loss after
    # training (the first step's learning rate is 0 in warmup; the second updates the weights from
    # gradients through tigon's backward).
    (plain_first, _, plain_eval), (patched_first, _, patched_eval) = sft_losses(plain), sft_losses(patched)
    assert math.isclose(patched_first, plain_first, abs_tol=1e-4)
    assert math.isclose(patched_eval, plain_eval, abs_tol=1e-4)


def test_grpo_example_runs(monkeypatch, tmp_path, capsys):
    printed = run_example(GRPO_EXAMPLE, [*GRPO_ARGUMENTS, "--output-dir", str(tmp_path)], monkeypatch, capsys)
    assert "norm layer: TigonLlamaRMSNorm" in printed
    steps = re.findall(r"step (\d+): loss (\S+), reward (\S+), entropy (\S+)", printed)
    assert [int(step) for step, *_ in steps] == [1, 2], printed
    assert all(math.isfinite(float(value)) for _, *values in steps for value in values)
    assert "mean reward of the first 1 steps" in printed
