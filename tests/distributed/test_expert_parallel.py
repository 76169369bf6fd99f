"""transformers' expert parallelism (``DistributedConfig(enable_expert_parallel=True)``, gloo on
CPU) with tigon's experts: each rank's local experts on tigon's kernel, transformers' dispatch
(its router hook: the rank's expert ids remapped, the others' slots set to a sentinel) and combine
(an all-reduce of the ranks' outputs) around them. A tiny Qwen3-MoE (8 experts, top-2, 2 sparse
layers, the router's load-balancing loss on) saved to disk and loaded in every process trains
for three SGD steps (expert_parallel_worker.py) with the losses, every parameter's gradient at
every step and the final parameters of one process, within 1e-5 in fp32:

- on 2 and 4 processes with ``apply_tigon``, against one process with ``apply_tigon`` and against
  transformers' own experts on the same processes; on 2 with gradient checkpointing as well;
- on 2 processes with transformers' tensor parallelism of the experts (``tp_plan`` "auto": every
  expert's intermediate features sharded), tigon's experts alone, against one process.

A tiny GPT-OSS (the same sizes; transposed weights, interleaved gate and up columns, biases
sharded with the experts, the clamped SwiGLU) does the same on 2 processes.

transformers' own expert parallelism matches one process as well (the reference is sound), and
every process ends with the same parameters.
"""

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from utils import launch_worker, relative_error, wait_for

HERE = Path(__file__).resolve().parent
STEPS = 3  # the worker's
TOLERANCE = 1e-5  # fp32: the same sums in another order
EXPERTS, TOP_K = 8, 2
KERNEL = "MoEExpertsFunctionBackward"  # tigon's experts in the autograd graph
GROUPED_MM = "GroupedMm"  # transformers' grouped_mm: torch's GroupedMmBackward0, or its fallback's node


@dataclasses.dataclass(frozen=True)
class Run:
    processes: int
    parallel: str = "none"  # "none" | "ep" | "tp"
    tigon: str = "none"  # "none" | "experts" | "apply"
    model: str = "qwen3_moe"
    checkpointing: bool = False

    @property
    def settings(self) -> dict:
        return dataclasses.asdict(self)


RUNS = {
    "one": Run(1),
    "one-tigon": Run(1, tigon="apply"),
    "ep2": Run(2, "ep"),
    "ep2-tigon": Run(2, "ep", "apply"),
    "ep2-tigon-checkpointing": Run(2, "ep", "apply", checkpointing=True),
    "tp2-tigon-experts": Run(2, "tp", "experts"),
    "ep4": Run(4, "ep"),
    "ep4-tigon": Run(4, "ep", "apply"),
    "gpt_oss-one-tigon": Run(1, tigon="apply", model="gpt_oss"),
    "gpt_oss-ep2": Run(2, "ep", model="gpt_oss"),
    "gpt_oss-ep2-tigon": Run(2, "ep", "apply", model="gpt_oss"),
}
HIDDEN, INTER = 32, 48
# The tiny models, seed 0: width 32, 2 layers whose MLPs are all sparse, 8 experts of width 48,
# top-2, the router's load-balancing loss on.
_COMMON = dict(
    vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, num_experts_per_tok=TOP_K, max_position_embeddings=64, output_router_logits=True,
    router_aux_loss_coef=0.1,
)
MODELS = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        intermediate_size=64, moe_intermediate_size=INTER, num_experts=EXPERTS, decoder_sparse_step=1, **_COMMON
    )),
    "gpt_oss": lambda: GptOssForCausalLM(GptOssConfig(
        intermediate_size=INTER, num_local_experts=EXPERTS, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], **_COMMON,
    )),
}


def save_checkpoints(directory: Path) -> None:
    for name, build in MODELS.items():
        torch.manual_seed(0)
        build().save_pretrained(directory / name)


def _launch(processes: int, checkpoints: Path, out: Path) -> subprocess.Popen:
    runs = {name: run.settings for name, run in RUNS.items() if run.processes == processes}
    # A launch's plain runs first: apply_tigon patches the family's modules for the whole process.
    runs = dict(sorted(runs.items(), key=lambda item: item[1]["tigon"] != "none"))
    runs_file = out / f"{processes}.runs"
    runs_file.write_text(json.dumps(runs))
    return launch_worker(
        HERE / "expert_parallel_worker.py", str(checkpoints), str(runs_file), str(out), processes=processes
    )


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict:
    """Every run's records, one per process, by name. The launches run side by side."""
    out = tmp_path_factory.mktemp("expert_parallel")
    checkpoints = out / "checkpoints"
    save_checkpoints(checkpoints)
    launches = [_launch(processes, checkpoints, out) for processes in sorted({run.processes for run in RUNS.values()})]
    wait_for(launches, timeout=900)
    return {
        name: [torch.load(out / f"{name}.rank{rank}.pt") for rank in range(run.processes)]
        for name, run in RUNS.items()
    }


def assert_same_training(actual: dict, truth: dict):
    """The same loss at every step, the same gradient of every parameter at every step, and the
    same parameters at the end."""
    assert actual["losses"] == pytest.approx(truth["losses"], rel=TOLERANCE)
    assert len(actual["grads"]) == len(truth["grads"]) == STEPS
    for step, (grads, truth_grads) in enumerate(zip(actual["grads"], truth["grads"])):
        assert grads.keys() == truth_grads.keys()
        for name, grad in truth_grads.items():
            error = relative_error(grads[name], grad)
            assert error <= TOLERANCE, f"step {step}, {name}'s gradient: relative error {error:.3g}"
    assert actual["params"].keys() == truth["params"].keys()
    for name, param in truth["params"].items():
        error = relative_error(actual["params"][name], param)
        assert error <= TOLERANCE, f"{name} after {STEPS} steps: relative error {error:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name, truth", [
    ("ep2", "one"), ("ep4", "one"),
    ("ep2-tigon", "one-tigon"), ("ep4-tigon", "one-tigon"), ("ep2-tigon-checkpointing", "one-tigon"),
    ("ep2-tigon", "ep2"), ("ep4-tigon", "ep4"),
    ("tp2-tigon-experts", "one"),
    ("gpt_oss-ep2-tigon", "gpt_oss-one-tigon"), ("gpt_oss-ep2-tigon", "gpt_oss-ep2"),
])
def test_trains_as_one_process(records, name, truth):
    for rank, record in enumerate(records[name]):
        try:
            assert_same_training(record, records[truth][0])
        except AssertionError as error:
            raise AssertionError(f"{name}, rank {rank}, against {truth}: {error}") from error


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_the_experts_run_where_asked_on_their_shard(records, name):
    """tigon's kernel computes the experts where asked (transformers' grouped_mm elsewhere), each
    rank on its own experts: E/N of them under expert parallelism, every expert's I/N
    intermediate features under tensor parallelism (GPT-OSS's weights are transposed)."""
    run = RUNS[name]
    for record in records[name]:
        functions = set(record["functions"])
        grouped_mm = any(GROUPED_MM in function for function in functions)
        assert (KERNEL in functions, grouped_mm) == ((True, False) if run.tigon != "none" else (False, True))
        experts, inter = EXPERTS, INTER
        if run.parallel == "ep":
            experts //= run.processes
        if run.parallel == "tp":
            inter //= run.processes
        shapes = [(experts, 2 * inter, HIDDEN), (experts, HIDDEN, inter)]
        if run.model == "gpt_oss":
            shapes = [(experts, HIDDEN, 2 * inter), (experts, inter, HIDDEN)]
        assert record["local_experts"] == shapes


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if run.parallel == "ep" and run.tigon != "none"])
def test_sharded_weights_outside_transformers_hook_are_refused(records, name):
    for record in records[name]:
        refusal = record["dtensor_refusal"]
        assert refusal is not None and "gate_up_proj" in refusal and "DTensor" in refusal
        assert "moe_tp_experts" in refusal and "Shard(dim=0)" in refusal
