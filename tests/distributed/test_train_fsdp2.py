"""examples/train_fsdp2.py on two processes (gloo on CPU, NCCL on GPUs) under DDP, FSDP2 and
DeepSpeed ZeRO-3 gives the per-step losses and gradient norms of one process, with tigon's fused
linear cross entropy computing the loss (no logits built), and under FSDP2 with tigon's MoE experts.

Every step covers the same 4 sequences: 4 micro-batches of one in one process, 2 in each of two,
with gradient accumulation, gradient checkpointing and AdamW. Their prompts (labels -100) differ
in length, so the two processes hold different numbers of tokens: a loss normalised per process
instead of over the step would show. The gradient norm (clipped to 1, over every shard) checks the
gradients' scale, which AdamW's update alone would hide.
"""

import dataclasses
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from utils import launch_worker, wait_for

HERE = Path(__file__).resolve().parent
TINY = ["--hidden-size", "32", "--layers", "2", "--seq-len", "16", "--micro-batch", "1", "--steps", "2"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
# FSDP2 with torchao's tensorwise float8 (the weights all-gathered in FP8, tigon's fused loss reading
# the head's FP8 weight as FSDP2 hands it over), patched and plain: FP8 rounding apart, the same.
FP8_RUNS = {
    "fsdp2-fp8": ("--strategy", "fsdp2", "--precision", "bf16", "--fp8", "tensorwise"),
    "fsdp2-fp8-plain": ("--strategy", "fsdp2", "--precision", "bf16", "--fp8", "tensorwise", "--no-tigon"),
}
FP8_TOLERANCE = 2e-3


@dataclasses.dataclass(frozen=True)
class Run:
    arguments: tuple[str, ...]
    reference: str  # the one-process run it is compared with
    tolerance: float  # relative, on each step's loss; 10 times this on the gradient norm

    @property
    def needs_deepspeed(self) -> bool:
        return "zero3" in self.arguments


ONE_PROCESS = {
    "fp32": ("--precision", "fp32"),
    "fp32-tied": ("--precision", "fp32", "--tie-embeddings"),
    # torch.autocast in one process; each engine's own bf16 below.
    "bf16": ("--precision", "bf16"),
    "fp32-moe": ("--precision", "fp32", "--model", "qwen3_moe"),
}
# fp32: the same sums in another order. bf16: FSDP2 and DeepSpeed run the norms and the loss in
# bf16 as well, where autocast keeps them in fp32.
TWO_PROCESSES = {
    "ddp": Run(("--strategy", "ddp", "--precision", "fp32"), "fp32", 1e-5),
    # lm_head resharded after its forward: tigon must use the weight inside it.
    "fsdp2-lm-head-unit": Run(("--strategy", "fsdp2", "--precision", "fp32", "--shard-lm-head"), "fp32", 1e-5),
    "fsdp2-tied": Run(("--strategy", "fsdp2", "--precision", "fp32", "--tie-embeddings"), "fp32-tied", 1e-5),
    # Qwen3-MoE layers, their experts on tigon's kernel, the expert weights sharded by expert.
    "fsdp2-moe": Run(("--strategy", "fsdp2", "--precision", "fp32", "--model", "qwen3_moe"), "fp32-moe", 1e-5),
    # Every layer's checkpointed input in host memory on each rank, MoE experts included.
    "fsdp2-offload": Run(("--strategy", "fsdp2", "--precision", "fp32", "--offload"), "fp32", 1e-5),
    "fsdp2-moe-offload": Run(
        ("--strategy", "fsdp2", "--precision", "fp32", "--model", "qwen3_moe", "--offload"), "fp32-moe", 1e-5
    ),
    "zero3": Run(("--strategy", "zero3", "--precision", "fp32"), "fp32", 1e-5),
    "fsdp2-bf16": Run(("--strategy", "fsdp2", "--precision", "bf16"), "bf16", 1e-3),
    "zero3-bf16": Run(("--strategy", "zero3", "--precision", "bf16"), "bf16", 1e-3),
}


def _launch(processes: int, runs: dict, out: Path, name: str) -> subprocess.Popen:
    runs_file = out / f"{name}.runs"
    runs_file.write_text(json.dumps({name: [*TINY, *arguments] for name, arguments in runs.items()}))
    return launch_worker(HERE / "run_example.py", str(runs_file), str(out), processes=processes)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every run's record, by name. The one-process and two-process launches run side by side."""
    out = tmp_path_factory.mktemp("train_fsdp2")
    single = {
        name: ("--strategy", "single", "--grad-accum", "4", *arguments) for name, arguments in ONE_PROCESS.items()
    }
    pair = {
        name: ("--grad-accum", "2", *run.arguments)
        for name, run in TWO_PROCESSES.items() if HAS_DEEPSPEED or not run.needs_deepspeed
    }
    if HAS_TORCHAO:
        pair.update({name: ("--grad-accum", "2", *arguments) for name, arguments in FP8_RUNS.items()})
    wait_for([_launch(1, single, out, "one"), _launch(2, pair, out, "two")], timeout=900)
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


@pytest.mark.slow
@pytest.mark.parametrize("name", TWO_PROCESSES)
def test_two_processes_match_one(results, name):
    run = TWO_PROCESSES[name]
    if run.needs_deepspeed and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    two, one = results[name], results[run.reference]
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["fused_loss"] and one["fused_loss"], "the loss was not tigon's fused one (logits were built)"
    assert two["experts"] == one["experts"] == (["tigon"] if "qwen3_moe" in run.arguments else [])
    assert len(two["losses"]) == len(one["losses"]) == 2
    assert two["losses"] == pytest.approx(one["losses"], rel=run.tolerance)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=10 * run.tolerance)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_fsdp2_with_fp8_weights_all_gathered_matches_torchao_alone(results):
    ours, plain = results["fsdp2-fp8"], results["fsdp2-fp8-plain"]
    assert ours["fused_loss"] and not plain["fused_loss"]
    assert ours["losses"] == pytest.approx(plain["losses"], rel=FP8_TOLERANCE)
    assert ours["grad_norms"] == pytest.approx(plain["grad_norms"], rel=10 * FP8_TOLERANCE)
