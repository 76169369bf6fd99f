"""benchmarks/e2e_families.py's smoke run (--smoke) end to end: tiny Qwen2.5-VL, DeepSeek-V3 and GPT-OSS
models trained on CPU by Hugging Face alone and with tigon; the same first loss from both (fp32)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_families.py"
FAMILIES = ("qwen2_5_vl", "deepseek_v3", "gpt_oss")


@pytest.mark.slow
def test_smoke_run_trains_each_family_with_hf_and_tigon(tmp_path):
    # One warm-up and one timed step of 64 tokens (the image takes 38 of them): two processes,
    # ~30 s of imports and ~30 s of tigon's kernels through Triton's interpreter.
    command = [sys.executable, str(SCRIPT), "--smoke", "--setups", "hf", "tigon", "--warmup", "1", "--steps", "1",
               "--seq-len", "64", "--out", str(tmp_path)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    for family in FAMILIES:
        record = json.loads((tmp_path / f"e2e_{family}.json").read_text())
        assert (tmp_path / f"e2e_{family}.png").is_file()
        assert record["config"]["smoke"] and record["config"]["dtype"] == "fp32"
        setups = {r["setup"]: r for r in record["setups"]}
        assert set(setups) == {"hf", "tigon"}, record["setups"]
        for setup, result in setups.items():
            assert "error" not in result, f"{family} {setup}: {result['error']}\n{completed.stderr[-3000:]}"
            assert len(result["losses"]) == 2 and all(math.isfinite(loss) for loss in result["losses"])
            assert result["tokens_per_second"] > 0 and result["peak_memory_gib"] is None
        # The same weights and batch: tigon's kernels in fp32 give Hugging Face's loss.
        assert math.isclose(setups["tigon"]["losses"][0], setups["hf"]["losses"][0], rel_tol=1e-4), family
        assert setups["tigon"]["step0_loss_rel_diff_vs_hf"] < 1e-4
