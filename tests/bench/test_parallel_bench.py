"""``tigon bench parallel --smoke`` on 2 gloo processes: every benchmark runs its code paths, and what
it checks holds (the sharded losses' gradients against the whole head's, tigon's training losses
against Hugging Face's under the same plan), in fp32."""

import json

import pytest

from tigon.bench import parallel

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("parallel")
    assert parallel.main(["--smoke", "--tp", "2", "--out", str(out), "--timeout", "600"]) == 0
    return {what: json.loads((out / f"parallel_{what}.json").read_text()) for what in parallel.WHAT}


@pytest.mark.slow
def test_the_vocab_parallel_losses_match_the_whole_head(records):
    (result,) = records["loss"]["results"]
    assert set(result["providers"]) == {"tigon", "loss_parallel", "tigon_one_gpu"}
    assert not any("error" in entry for entry in result["providers"].values())
    errors = result["relative_errors_vs_one_gpu"]
    assert set(errors) == {"loss_vs_one_gpu", "loss_vs_fp32_reference", "tigon_grad_input",
                           "tigon_grad_weight_slice", "loss_parallel_grad_input", "loss_parallel_grad_weight_slice"}
    assert max(errors.values()) < TOLERANCE, errors


@pytest.mark.slow
@pytest.mark.parametrize("what", ["tp", "ep"])
def test_tigon_trains_as_hugging_face_under_the_plan(records, what):
    hf, tigon = records[what]["results"]
    assert (hf["setup"], tigon["setup"]) == ("hf", "tigon") and "error" not in hf and "error" not in tigon
    assert len(tigon["losses"]) == len(hf["losses"]) == 3  # one warm-up step, two timed
    for ours, theirs in zip(tigon["losses"], hf["losses"]):
        assert abs(ours - theirs) <= TOLERANCE * abs(theirs)
    assert tigon["first_loss_rel_diff_vs_hf"] <= TOLERANCE
    if what == "ep":
        assert hf["experts"].endswith("(grouped_mm)") and tigon["experts"].endswith("(tigon)")


def test_one_process_is_refused(capsys):
    with pytest.raises(SystemExit):
        parallel.parse_args(["--tp", "1"])
    assert "--tp takes counts of at least 2" in capsys.readouterr().err
