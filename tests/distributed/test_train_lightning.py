"""examples/train_lightning.py, run as a user runs it: with tigon applied in ``configure_model`` its
per-step losses and gradient norms are plain Hugging Face's, with tigon's fused linear cross
entropy computing the loss (no logits built); and two processes (Lightning's own launcher, gloo on
CPU) under DDP and under FSDP2 (``ModelParallelStrategy``) give one process's.

Every step covers the same 4 sequences: 4 in one process, 2 in each of two, with gradient
checkpointing, gradient clipping and AdamW. Their prompts (labels -100) differ in length, so the
two processes hold different numbers of tokens: a loss normalised per process instead of over the
step would show. The gradient norm (before clipping to 1, over every shard) checks the gradients'
scale, which AdamW's update alone would hide.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_lightning.py"
TINY = ["--hidden-size", "32", "--layers", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "3",
        "--precision", "32-true"]
RUNS = {
    "plain": ["--no-tigon"],
    "tigon": [],
    "ddp": ["--strategy", "ddp", "--devices", "2"],
    "fsdp2": ["--strategy", "fsdp2", "--devices", "2"],
}
# fp32 throughout: other kernels, or the same sums split over processes, in another order. The
# gradient norm, before clipping, moves more than the loss (tigon against plain: 2.5e-5 at most).
LOSS_TOLERANCE, GRAD_NORM_TOLERANCE = 1e-5, 1e-4


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict:
    """Every run's ``--losses-out`` record, by name; the runs go side by side."""
    out = tmp_path_factory.mktemp("train_lightning")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    launches = {
        name: subprocess.Popen(
            [sys.executable, str(EXAMPLE), *TINY, *arguments, "--losses-out", str(out / f"{name}.json")],
            cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name, arguments in RUNS.items()
    }
    for launch in launches.values():
        output, _ = launch.communicate(timeout=300)
        assert launch.returncode == 0, f"{' '.join(launch.args)} failed:\n{output[-6000:]}"
    return {name: json.loads((out / f"{name}.json").read_text()) for name in RUNS}


@pytest.mark.slow
def test_tigon_matches_plain_hugging_face(records):
    tigon, plain = records["tigon"], records["plain"]
    assert tigon["norm_layer"] == "TigonLlamaRMSNorm" and plain["norm_layer"] == "LlamaRMSNorm"
    assert tigon["fused_loss"], "the loss was not tigon's fused one (logits were built)"
    assert not plain["fused_loss"]
    assert len(tigon["losses"]) == len(tigon["grad_norms"]) == 3
    assert tigon["losses"] == pytest.approx(plain["losses"], rel=LOSS_TOLERANCE)
    assert tigon["grad_norms"] == pytest.approx(plain["grad_norms"], rel=GRAD_NORM_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_match_one(records, strategy):
    two, one = records[strategy], records["tigon"]
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["norm_layer"] == "TigonLlamaRMSNorm"
    assert two["fused_loss"], "the loss was not tigon's fused one (logits were built)"
    assert len(two["losses"]) == len(two["grad_norms"]) == 3
    assert two["losses"] == pytest.approx(one["losses"], rel=LOSS_TOLERANCE)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=GRAD_NORM_TOLERANCE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs Lightning runs FSDPStrategy")
def test_fsdp_strategy_needs_gpus(monkeypatch):
    """What docs/integrations/lightning.md says: Lightning refuses ``FSDPStrategy`` without GPUs
    (FSDP2 through ``--strategy fsdp2`` runs on CPU instead)."""
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    import train_lightning

    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        train_lightning.main(["--strategy", "fsdp", "--devices", "2", "--steps", "1"])
