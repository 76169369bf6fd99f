"""tigon's Axolotl plugin under Axolotl's real ``axolotl train``, against plain Axolotl.

Skipped where Axolotl is not installed (the project's venv); ``.ci/axolotl`` builds a venv with
Axolotl 0.21's pins and runs this file there. Each training run is a subprocess of the ``axolotl``
command, as a user runs it, on a tiny Llama saved to disk (random weights, a word-level tokenizer
that needs no download) and a local JSONL dataset, in fp32 on the CPU, where tigon's kernels run
through Triton's interpreter.

Axolotl's Liger plugin is not compared here: Liger 0.8.4's kernels fail under Triton's interpreter
(its RMSNorm and SwiGLU kernels call ``.to`` on a scalar argument, which the interpreter passes as a
Python float), so it cannot train on the CPU.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import save_tiny_llama
from transformers import LlamaForCausalLM

if importlib.util.find_spec("axolotl") is None:
    pytest.skip("Axolotl is not installed (.ci/axolotl builds a venv with it)", allow_module_level=True)
# Before Axolotl's CLI is imported, which starts its telemetry then unless told not to; and no hub:
# the runs here, in this process and in the `axolotl` commands it starts, are offline.
os.environ.update(AXOLOTL_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
from axolotl.cli.config import load_cfg

WORDS = [
    "the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "red", "blue", "big", "small", "and", "then",
    "quickly", "slowly",
]
STEPS = 3
# fp32 on the CPU: tigon's kernels and PyTorch's layers differ by summation order only.
RELATIVE_TOLERANCE = 1e-5
TIGON_KEYS = {
    "plugins": ["tigon.integrations.axolotl.TigonPlugin"],
    "tigon_rope": True,
    "tigon_rms_norm": True,
    "tigon_glu_activation": True,
    "tigon_fused_linear_cross_entropy": True,
    "tigon_lora": True,
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A directory with ``model/`` (the tiny Llama) and ``data.jsonl`` (32 texts of 8 to 30 words)."""
    root = tmp_path_factory.mktemp("axolotl")
    save_tiny_llama(root / "model", WORDS, prefix_bos=True)
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as data:
        texts = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))) for _ in range(32))
        data.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return root


def axolotl_config(workspace: Path, name: str, adapter: str | None, **keys) -> dict:
    """A config training the tiny Llama for :data:`STEPS` steps in fp32, saving a checkpoint (and
    with it the logged losses) at the last; Axolotl's own LoRA kernels, which need CUDA, off."""
    config = {
        "base_model": str(workspace / "model"),
        "datasets": [{"path": str(workspace / "data.jsonl"), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": str(workspace / name / "prepared"),
        "output_dir": str(workspace / name),
        "sequence_len": 64, "sample_packing": False, "micro_batch_size": 2, "gradient_accumulation_steps": 1,
        "max_steps": STEPS, "num_epochs": 1, "optimizer": "adamw_torch", "lr_scheduler": "constant",
        "learning_rate": 1e-3, "val_set_size": 0, "logging_steps": 1, "save_strategy": "steps",
        "save_steps": STEPS, "bf16": False, "fp16": False, "tf32": False, "seed": 42,
    }
    if adapter is not None:
        config |= {
            "adapter": adapter, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_linear": True,
            "lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False,
            "lora_embedding_kernel": False,
        }
    return config | keys


def axolotl_train(workspace: Path, config: dict) -> tuple[list[dict], str]:
    """Run ``axolotl train`` on ``config`` (written as YAML; JSON is YAML); returns the logged
    training steps (loss, grad_norm, ...) and the command's output."""
    path = Path(config["output_dir"] + ".yml")
    path.write_text(json.dumps(config, indent=1))
    bin_dir = Path(sys.executable).parent
    environment = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",  # `axolotl` launches `accelerate`
        "CUDA_VISIBLE_DEVICES": "",
        "TRITON_INTERPRET": "1",
        "LOG_LEVEL": "INFO",  # shows the INFO logs of plugins outside Axolotl's package
    }
    result = subprocess.run(
        [str(bin_dir / "axolotl"), "train", str(path)], cwd=workspace, env=environment,
        capture_output=True, text=True, timeout=600, check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    state = json.loads((Path(config["output_dir"]) / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry], output


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["lora", None], ids=["lora", "full"])
def test_tigon_plugin_trains_as_plain_axolotl(workspace, adapter):
    name = adapter or "full"
    plain_steps, _ = axolotl_train(workspace, axolotl_config(workspace, f"plain-{name}", adapter))
    tigon_steps, output = axolotl_train(workspace, axolotl_config(workspace, f"tigon-{name}", adapter, **TIGON_KEYS))

    counts = "{'TigonLlamaAttention': 2, 'TigonLlamaMLP': 2, 'TigonLlamaRMSNorm': 5}"
    assert f"tigon: layers on tigon's kernels: {counts}" in output
    assert [step["step"] for step in plain_steps] == [step["step"] for step in tigon_steps] == [1, 2, 3]
    # The first loss checks the forward; the next two, and every gradient norm, the backward.
    for plain, tigon in zip(plain_steps, tigon_steps):
        assert tigon["loss"] == pytest.approx(plain["loss"], rel=RELATIVE_TOLERANCE)
        assert tigon["grad_norm"] == pytest.approx(plain["grad_norm"], rel=RELATIVE_TOLERANCE)


def config_file(workspace: Path, config: dict) -> str:
    """``config`` written where the validation tests load it from."""
    path = workspace / "validation.yml"
    path.write_text(json.dumps(config))
    return str(path)


def lora_kernel_keys(workspace: Path, **keys) -> dict[str, bool]:
    """Axolotl's LoRA kernel keys after loading a LoRA config without them and with ``keys``."""
    config = axolotl_config(workspace, "validation", "lora", **keys)
    for kernel in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel"):
        del config[kernel]
    cfg = load_cfg(config_file(workspace, config))
    return {kernel: cfg[kernel] for kernel in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")}


def test_axolotl_lora_kernels_yield_the_layers_tigon_computes(workspace):
    # Axolotl turns its LoRA kernels on for a LoRA adapter; the plugin keeps those tigon leaves alone.
    assert lora_kernel_keys(workspace, plugins=TIGON_KEYS["plugins"]) == dict.fromkeys(
        ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"), True
    )
    assert lora_kernel_keys(workspace, **TIGON_KEYS) == dict.fromkeys(
        ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"), False
    )
    glu_only = {"plugins": TIGON_KEYS["plugins"], "tigon_glu_activation": True}
    assert lora_kernel_keys(workspace, **glu_only) == {
        "lora_mlp_kernel": False, "lora_qkv_kernel": True, "lora_o_kernel": True,
    }


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"tigon_cross_entropy": True, "tigon_fused_linear_cross_entropy": True}, "at most one of tigon_cross_entropy"),
        ({"tigon_lora": True, "lora_mlp_kernel": True}, "lora_mlp_kernel replace the LoRA layers"),
        ({"tigon_memory_budget_gib": 40, "gradient_checkpointing": "offload"}, "not 'offload'"),
        ({"tigon_memory_budget_gib": -1}, "tigon_memory_budget_gib"),
        (
            {"plugins": [*TIGON_KEYS["plugins"], "axolotl.integrations.liger.LigerPlugin"], "tigon_rms_norm": True,
             "liger_rms_norm": True},
            "tigon_rms_norm and liger_rms_norm replace the same layers",
        ),
    ],
    ids=["two-losses", "axolotl-lora-kernel", "axolotl-offload", "negative-budget", "liger"],
)
def test_clashing_keys_are_refused(workspace, keys, message):
    config = axolotl_config(workspace, "validation", "lora", plugins=TIGON_KEYS["plugins"]) | keys
    with pytest.raises(ValueError, match=message):
        load_cfg(config_file(workspace, config))


def test_example_config_is_valid(workspace):
    # The example's model is swapped for the tiny one (validation reads the model's config), and its
    # output directory, which validation creates, for one in the workspace.
    example = Path(__file__).resolve().parents[2] / "examples" / "axolotl" / "llama-lora-tigon.yml"
    cfg = load_cfg(str(example), base_model=str(workspace / "model"), output_dir=str(workspace / "example"))
    assert cfg.tigon_lora and cfg.tigon_memory_budget_gib == 70
    assert not cfg.lora_mlp_kernel and not cfg.lora_qkv_kernel and not cfg.lora_o_kernel


def test_memory_budget_runs_the_planner_when_training_begins(workspace, monkeypatch):
    # The planner measures CUDA memory; here its call is recorded: the callback's part is the plan's
    # inputs (the largest batch, the trainer's optimizer) and the moment, when training begins.
    from tigon.integrations.axolotl import TigonPlugin, plugin
    from tigon.transformers import CheckpointingPlan

    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return CheckpointingPlan(n_layers=2, kept=1, peak_gib=60.0, budget_gib=70.0)

    monkeypatch.setattr(plugin, "fit_checkpointing", record)
    config = axolotl_config(workspace, "validation", "lora", **TIGON_KEYS, tigon_memory_budget_gib=70)
    cfg = load_cfg(config_file(workspace, config))
    (callback,) = TigonPlugin().add_callbacks_post_trainer(cfg, trainer=None)
    model = LlamaForCausalLM.from_pretrained(workspace / "model").eval()
    optimizer = torch.optim.AdamW(model.parameters())
    callback.on_train_begin(None, None, None, model=model, optimizer=optimizer)

    ((planned_model, batch, budget), options), = calls
    assert planned_model is model and model.training and budget == 70
    assert options == {"optimizer": optimizer, "offload": "auto"}
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, 64)
    assert int(batch["input_ids"].max()) < model.config.vocab_size


@pytest.mark.slow
def test_bench_axolotl_smoke_times_each_setup_on_the_same_losses(tmp_path):
    # `tigon bench axolotl` as a user runs it without a GPU: the tiny model, 3 steps of each setup
    # through `axolotl train` with the timing plugin. Liger is left out: it cannot train on the CPU.
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "tigon.bench", "axolotl", "--setups", "axolotl", "tigon", "--out", str(tmp_path)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]

    record = json.loads((tmp_path / "axolotl_smoke.json").read_text())
    plain, tigon = record["results"]
    assert (plain["setup"], tigon["setup"]) == ("axolotl", "tigon")
    for row in (plain, tigon):
        assert row["steps"] == 3 and row["timed_steps"] == 2 and row["tokens_per_s"] > 0, row
        assert len(row["losses"]) == 3 and row["peak_gib"] is None  # no memory counter on the CPU
    assert tigon["losses"] == pytest.approx(plain["losses"], rel=RELATIVE_TOLERANCE)
    assert "tigon " in result.stdout and "axolotl " in result.stdout  # the table
