"""tigon under DeepSpeed's AutoTP tensor parallelism (training), 2 processes on gloo: the patched
model trains as the plain one does under the same sharding, within 1e-5 in fp32 (every step's loss,
every rank's gradient shard of the first step), with tigon's fused loss computed
vocabulary-parallel on the head AutoTP shards along the vocabulary (no logits built, the weight
never gathered), its SwiGLU on the MLP's column shards and its RoPE on the rank's heads."""

import importlib.util
from pathlib import Path

import pytest
import torch

from utils import launch_worker, relative_error, wait_for

HERE = Path(__file__).resolve().parent
TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("autotp") / "autotp.pt"
    wait_for([launch_worker(HERE / "autotp_worker.py", str(out), processes=2)], timeout=600)
    return torch.load(out)


@pytest.mark.slow
def test_tigon_trains_as_plain_under_autotp(record):
    plain, tigon = record["runs"]["plain"], record["runs"]["tigon"]
    assert plain["head"] == tigon["head"] == "LinearLayer", "AutoTP did not shard lm_head along the vocabulary"
    assert tigon["fused_loss"] and not plain["fused_loss"]
    assert tigon["losses"] == pytest.approx(plain["losses"], rel=TOLERANCE)
    for rank, grads in enumerate(record["grads_by_rank"]):
        assert grads["tigon"].keys() == grads["plain"].keys()
        for name, grad in grads["tigon"].items():
            assert relative_error(grad, grads["plain"][name]) <= TOLERANCE, (rank, name)
