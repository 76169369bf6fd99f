"""The fused linear cross entropy, the log-probs head and the GRPO family on an LM head sharded
along the vocabulary (tigon.ops.vocab_parallel), in 2 and 4 gloo processes on CPU, against one
process: tigon's op on the whole head and the fp64 reference, within 1e-5 in fp32, for the loss
(every log-probs field, every GRPO metric) and every gradient (input, each rank's weight and bias slices put together). Every rank must
get the whole loss. vocab_parallel_worker.py runs the ranks; each world size is one launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tigon.functional as tf
from tigon.testing import reference
from utils import ON_GPU, relative_error
from vocab_parallel_worker import CASES, FIELDS, call, cases_for, grpo_constants, grpo_outputs, loss_to_backward, problem

HERE = Path(__file__).resolve().parent
WORLD_SIZES = (2, 4)
TOLERANCE = 1e-5
LAUNCH_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(ON_GPU, reason="the vocabulary-parallel CPU test runs gloo processes on the CPU")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """world size → the ranks' saved results (launched once per world size, both at once)."""
    launches = {}
    for world_size in WORLD_SIZES:
        out_dir = tmp_path_factory.mktemp(f"vocab_parallel_{world_size}")
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        launches[world_size] = out_dir, [
            subprocess.Popen(
                [sys.executable, str(HERE / "vocab_parallel_worker.py"), str(rank), str(world_size),
                 str(out_dir / "init"), str(out_dir)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for rank in range(world_size)
        ]
    saved = {}
    for world_size, (out_dir, processes) in launches.items():
        outputs = [process.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for process in processes]
        failed = [f"rank {rank} of {world_size}:\n{output[-3000:]}"
                  for rank, (process, output) in enumerate(zip(processes, outputs)) if process.returncode != 0]
        assert not failed, "\n".join(failed)
        saved[world_size] = [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]
    return saved


def one_process(name: str, double: bool):
    """The case on the whole head in one process: tigon's op, or the fp64 reference."""
    kind, _, bias, options = CASES[name]
    options = {key: value for key, value in options.items() if key != "chunk_rows"}
    x, weight, b, target, upstream = problem(bias)
    if double:
        x, weight, b, upstream = (None if t is None else t.double() for t in (x, weight, b, upstream))
    leaves = [t.requires_grad_() if t is not None else None for t in (x, weight, b)]
    if double:
        if kind == "grpo":
            constants = grpo_constants(bias, options.get("temperature", 1.0))
            constants = {key: value.double() if value.is_floating_point() else value for key, value in constants.items()}
            outputs = grpo_outputs(*reference.grpo_loss(
                x, weight, constants.pop("completion_ids"), constants.pop("completion_mask"),
                constants.pop("advantages"), b, **constants, **options,
            ))
        elif kind == "flce":
            outputs = reference.fused_linear_cross_entropy(x, weight, target, b, **options)
        else:
            outputs = reference.fused_linear_logprobs(x, weight, target, b, outputs=FIELDS, **options)
    else:
        outputs = call(kind, x, weight, b, target, options)
    loss_to_backward(kind, options, outputs, upstream).backward()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [out.detach() for out in outputs], [None if t is None else t.grad for t in leaves]


def assert_within(what: str, actual: torch.Tensor, truth: torch.Tensor) -> None:
    if truth.dtype == torch.bool:
        assert torch.equal(actual, truth), what
        return
    error = relative_error(actual.double(), truth.double())
    assert error <= TOLERANCE, f"{what}: relative error {error:.3g}"


@pytest.mark.parametrize(("world_size", "name"),
                         [(world_size, name) for world_size in WORLD_SIZES for name in cases_for(world_size)])
def test_matches_one_process(results, world_size, name):
    ranks = [saved["cases"][name] for saved in results[world_size]]
    for truth_name, (truth_outputs, truth_grads) in (("tigon", one_process(name, False)),
                                                     ("fp64", one_process(name, True))):
        for rank, got in enumerate(ranks):
            assert len(got["outputs"]) == len(truth_outputs)
            for index, (out, truth) in enumerate(zip(got["outputs"], truth_outputs)):
                assert_within(f"output {index} of rank {rank} vs {truth_name}", out, truth)
            assert_within(f"grad of input on rank {rank} vs {truth_name}", got["grads"][0], truth_grads[0])
        for index, param in ((1, "weight"), (2, "bias")):
            if truth_grads[index] is None:
                continue
            whole = torch.cat([got["grads"][index] for got in ranks])
            assert_within(f"grad of {param} (every rank's slice) vs {truth_name}", whole, truth_grads[index])


BAD_CALLS = {
    "weight_shard1": ("ValueError", "weight is a DTensor placed (Shard(dim=1),)"),
    "weight_replicate": ("ValueError", "expected (Shard(0),) on a 1-D mesh"),
    "bias_plain": ("ValueError", "bias must be None or a DTensor placed (Shard(0),) on weight's mesh, as weight; got a plain tensor"),
    "bias_replicate": ("ValueError", "got a DTensor placed (Replicate(),)"),
    "input_shard": ("ValueError", "input is a DTensor placed (Shard(dim=0),)"),
    "group_and_dtensor": ("ValueError", "process_group must be None when weight is a DTensor"),
    "dtensor_input_plain_weight": ("TypeError", "input is a DTensor but weight is not"),
    "tokens_differ": ("ValueError", "input must hold the same tokens on every rank"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_placements_are_refused(results, name):
    for world_size in WORLD_SIZES:
        for rank, saved in enumerate(results[world_size]):
            got = saved["errors"][name]
            assert got is not None, f"{name} did not raise on rank {rank} of {world_size}"
            kind, message = got
            assert kind == BAD_CALLS[name][0] and BAD_CALLS[name][1] in message, got


def test_whole_head_takes_the_one_process_path(monkeypatch):
    """Without a DTensor or process_group, the one-process op runs: no layout is gathered."""

    def no_collective(*args):
        raise AssertionError("a whole head took the vocabulary-parallel path")

    monkeypatch.setattr(tf._vocab_parallel, "vocab_shard", no_collective)
    x, weight, b, target, _ = problem(True)
    loss = tf.fused_linear_cross_entropy(x, weight, target, b, process_group=None)
    assert_within("loss", loss, reference.fused_linear_cross_entropy(x.double(), weight.double(), target, b.double()))
    log_probs = tf.fused_linear_logprobs(x, weight, target, b)[0]
    assert_within("log_probs", log_probs, reference.fused_linear_logprobs(x.double(), weight.double(), target,
                                                                          b.double())[0])
