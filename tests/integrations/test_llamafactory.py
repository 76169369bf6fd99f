"""tigon's LLaMA-Factory launcher and v1 kernel plugin, under LLaMA-Factory's real trainer.

Skipped where LLaMA-Factory is not installed (the project's venv); ``.ci/llamafactory`` builds a
venv with LLaMA-Factory 0.9.5's pins and runs this file there. Each v0 training run is a
subprocess, as a user runs it: ``llamafactory-cli train config.yaml`` for plain LLaMA-Factory and
``python -m tigon.integrations.llamafactory train config.yaml`` for tigon, on a tiny Llama saved to
disk (random weights, a word-level tokenizer that needs no download) and a local alpaca-style
dataset registered in a ``dataset_info.json``, in fp32 on the CPU, where tigon's kernels run through
Triton's interpreter.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("llamafactory")

from tiny_checkpoint import save_tiny_llama, tiny_llama_config
from transformers import LlamaForCausalLM

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "log",
    "red",
    "blue",
    "big",
    "small",
    "and",
    "then",
    "quickly",
    "slowly",
]
# The words of LLaMA-Factory's ``default`` template, whose punctuation the tokenizer splits off.
TEMPLATE_WORDS = ["Human", "Assistant", ":"]
STEPS = 3
# fp32 on the CPU: tigon's kernels and PyTorch's layers differ by summation order only.
RELATIVE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A directory with ``model/`` (the tiny Llama) and ``data/`` (32 instruction-answer pairs of
    random words, registered as the dataset ``tiny`` in ``data/dataset_info.json``)."""
    root = tmp_path_factory.mktemp("llamafactory")
    save_tiny_llama(root / "model", WORDS + TEMPLATE_WORDS, prefix_bos=False)
    rng = random.Random(0)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    (root / "data").mkdir()
    pairs = [
        {"instruction": words(4, 12), "input": "", "output": words(4, 16)}
        for _ in range(32)
    ]
    (root / "data" / "tiny.json").write_text(json.dumps(pairs))
    (root / "data" / "dataset_info.json").write_text(
        json.dumps({"tiny": {"file_name": "tiny.json"}})
    )
    return root


def train_v0(
    workspace: Path, name: str, launcher: list[str], finetuning_type: str
) -> tuple[list[float], str]:
    """Train the tiny Llama for :data:`STEPS` SFT steps with LLaMA-Factory v0 started by
    ``launcher``; returns the losses of its ``trainer_log.jsonl`` and the run's log."""
    output_dir = workspace / name
    config = {
        "model_name_or_path": str(workspace / "model"),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": finetuning_type,
        "lora_target": "all",
        "dataset": "tiny",
        "dataset_dir": str(workspace / "data"),
        "template": "default",
        "cutoff_len": 64,
        "output_dir": str(output_dir),
        "overwrite_output_dir": True,
        "per_device_train_batch_size": 4,
        "max_steps": STEPS,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    config_path = workspace / f"{name}.yaml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    environment = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "DISABLE_VERSION_CHECK": "1",
    }
    run = subprocess.run(
        [*launcher, "train", str(config_path)],
        check=False,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    with open(output_dir / "trainer_log.jsonl") as records:
        losses = [
            record["loss"] for record in map(json.loads, records) if "loss" in record
        ]
    return losses, log


LLAMAFACTORY_CLI = [str(Path(sys.executable).with_name("llamafactory-cli"))]
TIGON_LAUNCHER = [sys.executable, "-m", "tigon.integrations.llamafactory"]


@pytest.mark.parametrize("finetuning_type", ["lora", "full"])
def test_v0_sft_losses_match_plain_llamafactory(workspace, finetuning_type):
    """SFT through the launcher (tigon's defaults: the fused loss, LoRA through tigon) logs the
    losses plain LLaMA-Factory logs, having patched the Llama modeling module."""
    plain, _ = train_v0(
        workspace, f"plain-{finetuning_type}", LLAMAFACTORY_CLI, finetuning_type
    )
    patched, log = train_v0(
        workspace, f"tigon-{finetuning_type}", TIGON_LAUNCHER, finetuning_type
    )
    assert len(plain) == STEPS, plain
    assert patched == pytest.approx(plain, rel=RELATIVE_TOLERANCE)
    assert "tigon: patched transformers.models.llama.modeling_llama (" in log, log[
        -6000:
    ]
    assert "'fused_linear_cross_entropy': True" in log


def test_v1_kernel_plugin_patches_a_peft_model():
    """Importing the module registers ``tigon`` in LLaMA-Factory v1's kernel registry; called as v1's
    model engine calls it, it patches a PEFT-wrapped Llama with tigon's layers and keeps the logits
    v1's trainers read (no fused loss), and a comma list turns on those flags alone."""
    import peft
    from llamafactory.v1.plugins.model_plugins.kernels.interface import KernelPlugin

    import tigon.integrations.llamafactory  # noqa: F401
    from tigon.integrations import tigon_layer_counts
    from tigon.integrations.llamafactory import kernel_flags

    torch.manual_seed(0)
    model = peft.get_peft_model(
        LlamaForCausalLM(tiny_llama_config(32)), peft.LoraConfig(r=4, target_modules="all-linear")
    )
    model.train()
    input_ids = torch.randint(32, (2, 8))
    expected = model(input_ids=input_ids, labels=input_ids).logits

    patched = KernelPlugin("tigon")(model=model, include_kernels="auto")
    assert patched is model
    assert tigon_layer_counts(model), "no module of the model is tigon's"
    torch.testing.assert_close(
        model(input_ids=input_ids, labels=input_ids).logits,
        expected,
        rtol=1e-5,
        atol=1e-5,
    )

    assert {
        flag
        for flag, on in kernel_flags("rope, rms_norm", require_logits=True).items()
        if on
    } == {"rope", "rms_norm"}
    assert kernel_flags(None, require_logits=True) is None
    with pytest.raises(ValueError, match="swigloo"):
        kernel_flags("swigloo", require_logits=True)
