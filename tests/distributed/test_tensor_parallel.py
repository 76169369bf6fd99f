"""apply_tigon on tensor-parallel models, 2 and 4 processes on gloo, against one process.

A tiny Llama checkpoint (4 heads, so that 4 ranks hold one each) is trained for a few AdamW steps,
sharded by examples/train_tp.py's plans and patched after: transformers' ``tp_plan="auto"``
(activations replicated between layers: tigon's RMSNorm on replicated ones, its SwiGLU on the
rank's columns, its RoPE on the rank's heads), the same under gradient checkpointing, and torch's
``parallelize_module`` with sequence-parallel norms (tigon's RMSNorm on ``Shard(1)`` DTensors, its
weight gradient summed over the ranks). The loss is tigon's vocabulary-parallel fused loss on the
sharded lm_head (tigon's cross entropy over the gathered logits where asked for; the model's own,
with a warning, for a head left a replicated DTensor). Every step's loss and every parameter's gradient (gathered whole) must match one
process, patched and plain, within 1e-5 in fp32. Placements that tigon cannot compute on shards
are refused with an error naming them.

Without tigon's DTensor handling, the sequence-parallel norms fail (the kernels get DTensors), and
a reduce-scatter's pending output reaching a kernel loses its gradient's path to the embedding.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils import launch_worker, load_example, relative_error, wait_for

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
train_tp = load_example("train_tp")

LAUNCHES = {
    "one": ["reference"],
    "2": [
        "auto", "auto-checkpointing", "auto-cross-entropy", "auto-replicated-head", "sequence-parallel",
        "sequence-parallel-patched-first", "refusals", "local-ops",
    ],
    "4": ["auto", "sequence-parallel", "local-ops"],
}
RUNS = [(tp, case) for tp in ("2", "4") for case in LAUNCHES[tp] if case not in ("refusals", "local-ops")]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict:
    """Each launch's records, by launch; the three launches run side by side."""
    out = tmp_path_factory.mktemp("tensor_parallel")
    checkpoint = train_tp.save_tiny_llama(str(out / "checkpoint"))
    wait_for([
        launch_worker(HERE / "tensor_parallel_worker.py", checkpoint, str(out / f"{name}.pt"), *cases,
                      processes=1 if name == "one" else int(name))
        for name, cases in LAUNCHES.items()
    ], timeout=600)
    return {name: torch.load(out / f"{name}.pt") for name in LAUNCHES}


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["tigon", "plain"])
@pytest.mark.parametrize("tp, case", RUNS)
def test_matches_one_process(records, tp, case, reference):
    run, truth = records[tp][case], records["one"][reference]
    expected = ["TigonLlamaAttention", "TigonLlamaMLP", "TigonLlamaRMSNorm"]
    assert run["classes"] == records["one"]["tigon"]["classes"] == expected
    # Logits are returned where the loss is over them: tigon's cross entropy, or the model's own
    # where tigon leaves a replicated DTensor head to it (saying so once).
    assert run["fused_loss"] == (case not in ("auto-cross-entropy", "auto-replicated-head"))
    assert run["warnings"] == (["ShardedHeadWarning"] if case == "auto-replicated-head" else [])
    assert run["losses"] == pytest.approx(truth["losses"], rel=TOLERANCE)
    for step, (grads, true_grads) in enumerate(zip(run["grads"], truth["grads"], strict=True)):
        assert grads.keys() == true_grads.keys()
        for name, grad in grads.items():
            error = relative_error(grad, true_grads[name])
            assert error <= TOLERANCE, f"step {step}: {name}'s gradient is {error:.2e} off"


@pytest.mark.slow
@pytest.mark.parametrize("tp", ["2", "4"])
@pytest.mark.parametrize("op", [
    "swiglu_mlp", "rope", "rms_norm",
    "functional_rms_norm", "functional_layer_norm", "functional_gates", "functional_rope",
])
def test_ops_on_local_shards(records, tp, op):
    """The output and every gradient of a DTensor-sharded call equal the whole-tensor call's."""
    assert records[tp]["local-ops"][op] <= TOLERANCE


REFUSALS = {
    "hidden-sharded input": ("Shard(dim=2)", "cannot run on shards"),
    "hidden-sharded weight": ("needs weight replicated", "Shard(dim=0)"),
    "partial input": ("Partial(sum)", "redistribute it"),
    "position-sharded rope": ("rope got q", "Shard(dim=2)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", REFUSALS)
def test_refuses_what_shards_cannot_compute(records, name):
    error = records["2"]["refusals"][name]
    assert error is not None, f"{name}: no error"
    kind, message = error
    assert kind == "ShardingError"
    for part in REFUSALS[name]:
        assert part in message


@pytest.mark.slow
@pytest.mark.parametrize("arguments", [["--tp", "2", "--plan", "sequence-parallel"], ["--ep"]], ids=" ".join)
def test_example_runs_as_documented(arguments):
    """examples/train_tp.py as a user starts it, on its default tiny model (a Llama, a Qwen3-MoE
    with --ep)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "train_tp.py"), *arguments, "--steps", "2",
    ]
    run = subprocess.run(
        command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "step 1: loss" in run.stdout


@pytest.mark.parametrize("arguments", [["--ep", "--tp", "2"], ["--ep", "--plan", "auto"]])
def test_example_refuses_tensor_parallel_options_with_ep(arguments, capsys):
    with pytest.raises(SystemExit):
        train_tp.parse_args(arguments)
    assert "drop --tp and --plan" in capsys.readouterr().err
