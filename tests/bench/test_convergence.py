"""``tigon bench convergence``: the synthetic corpus, and the smoke run's code path (bf16 against
an FP8 recipe on a tiny model, the record and the plot)."""

import json
import math

import pytest
import torch

from tigon.bench import convergence


def test_the_corpus_is_a_seeded_chain_of_known_entropy():
    successors, probabilities, entropy = convergence.synthetic_corpus(64)
    again = convergence.synthetic_corpus(64)
    assert torch.equal(successors, again[0]) and successors.shape == (64, convergence.SUCCESSORS)
    assert all(len(set(row.tolist())) == convergence.SUCCESSORS for row in successors)
    assert torch.allclose(probabilities.sum(1), torch.ones(64))
    assert 0 < entropy < math.log(convergence.SUCCESSORS)
    tokens = convergence.sample_batch(successors, probabilities, 3, 40, torch.Generator().manual_seed(0))
    # Every step follows the chain.
    follows = (successors[tokens[:, :-1]] == tokens[:, 1:, None]).any(-1)
    assert tokens.shape == (3, 40) and follows.all()


def test_the_learning_rate_warms_up_then_decays_to_a_tenth():
    steps = 100
    rates = [convergence.learning_rate(step, steps) for step in range(steps)]
    assert rates[0] < rates[4] == pytest.approx(convergence.LR)
    assert rates[-1] == pytest.approx(convergence.LR * convergence.MIN_LR_FRACTION, rel=0.01)


@pytest.mark.slow
def test_smoke_run_trains_bf16_and_fp8_and_writes_the_record(tmp_path):
    pytest.importorskip("torchao.float8")
    assert convergence.main(["--smoke", "--recipes", "rowwise", "--steps", "3", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "convergence_fp8.json").read_text())
    assert (tmp_path / "convergence_fp8.png").is_file()
    assert set(record["runs"]) == {"bf16", "rowwise"}
    assert all(len(run["losses"]) == 3 and all(map(math.isfinite, run["losses"])) for run in record["runs"].values())
    assert record["final_vs_bf16"]["rowwise"] == pytest.approx(1.0, abs=convergence.TOLERANCE)
