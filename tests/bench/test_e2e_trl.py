"""benchmarks/e2e_trl.py's smoke run (--tiny) end to end: TRL alone and TRL + tigon under SFTTrainer,
TRL's and tigon's head under GRPO's loss; the same losses, log-probs and gradients from both."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_trl.py"


@pytest.mark.slow
def test_tiny_run_compares_trl_and_tigon(tmp_path):
    command = [sys.executable, str(SCRIPT), "--tiny", "--setups", "trl", "tigon", "--grpo-setups", "trl", "tigon_head",
               "--out", str(tmp_path)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    record = json.loads((tmp_path / "e2e_trl.json").read_text())
    assert (tmp_path / "e2e_trl.png").is_file()
    assert record["config"]["tiny"] and record["environment"]["trl"]

    sft = {r["setup"]: r for r in record["sft"]}
    assert set(sft) == {"trl", "tigon"} and not any("error" in r for r in sft.values()), record["sft"]
    assert sft["trl"]["head"] == "TRL" and sft["tigon"]["head"] == "tigon"
    # SFT's loss is a mean of log-probs: tigon's head keeps computing its gradients in the forward pass.
    assert sft["tigon"]["head_mode"] == "gradients in forward"
    steps = record["config"]["warmup"] + record["config"]["steps"]
    assert len(sft["trl"]["losses"]) == len(sft["tigon"]["losses"]) == steps
    assert sft["tigon"]["max_loss_diff_vs_trl"] < 1e-2  # bf16, the same data and initial weights

    grpo = {r["setup"]: r for r in record["grpo"]}
    assert set(grpo) == {"trl", "tigon_head"} and not any("error" in r for r in grpo.values()), record["grpo"]
    # GRPO's per-token weights differ between sequences: the head learns to recompute in backward.
    assert grpo["tigon_head"]["head_mode"] == "recomputing backward"
    for key, tolerance in (("mean_log_prob", 1e-3), ("mean_entropy", 1e-3), ("grad_norm", 1e-2)):
        assert math.isclose(grpo["tigon_head"][key], grpo["trl"][key], rel_tol=tolerance), key
    for part in (record["sft"], record["grpo"]):
        assert all(r["tokens_per_second"] > 0 and "speedup_vs_trl" in r for r in part)
