"""``tigon bench axolotl``: Axolotl's own ``axolotl train``, plain, with Axolotl's Liger plugin and
with tigon's plugin, on the same model, data and config: tokens/s, peak memory and the losses.

Needs Axolotl installed (0.21: ``pip install axolotl==0.21.0``, and ``liger-kernel`` for the Liger
setup). The model is Llama-3-8B's shapes (:mod:`tigon.bench.e2e_models`) with ``--layers`` decoder
layers (default 4), random weights (seed 0) saved in bf16 to a workspace folder with a word-level
tokenizer over the whole vocabulary (nothing downloaded); the data are ``--samples`` texts of random
words, each exactly ``--seq-len`` tokens with its ``<s>``, so that no sample is dropped or padded.
Every setup trains the same Axolotl config (:func:`axolotl_config`): ``--adapter lora`` (default;
PEFT LoRA r 16 on every linear layer of the decoder, Axolotl's own LoRA kernels off, since they
replace the layers tigon's keys take) or ``none`` (every weight), bf16, SDPA attention, gradient
checkpointing, ``--micro-batch`` × ``--seq-len`` tokens per step, AdamW, ``--steps`` steps:

- ``axolotl``: nothing more.
- ``liger``: ``axolotl.integrations.liger.LigerPlugin`` with ``liger_rope``, ``liger_rms_norm``,
  ``liger_glu_activation`` and ``liger_fused_linear_cross_entropy``.
- ``tigon``: ``tigon.integrations.axolotl.TigonPlugin`` with ``tigon_rope``, ``tigon_rms_norm``,
  ``tigon_glu_activation``, ``tigon_fused_linear_cross_entropy`` and (with LoRA) ``tigon_lora``.

Each setup is an ``axolotl train`` process of its own, with the timing plugin of
:mod:`tigon.bench.axolotl_timer` added to its plugins: tokens/s is the tokens of the steps after the
first ``--warmup`` (default 2) over their synchronized wall time; peak memory is PyTorch's peak
allocated over the whole run. Writes ``axolotl_llama_<adapter>_l<layers>.json`` and ``.csv`` to
``--out`` (default ``tigon-out/bench-<gpu>``). ``--smoke`` (the only run without a GPU) trains the
tiny Llama of :mod:`tigon.bench.e2e_models` in fp32, 3 steps of 2 × 64 tokens, through the same
commands (``axolotl_smoke.json``): its timings mean nothing.

    tigon bench axolotl [--setups axolotl liger tigon] [--adapter lora | none] [--layers 4]
        [--seq-len 4096] [--micro-batch 2] [--steps 12] [--warmup 2] [--samples 64] [--timeout S]
        [--smoke] [--workspace DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from tigon.bench.e2e_models import MODELS
from tigon.bench.machine import default_out, environment, run_device, version
from tigon.bench.processes import launch

SETUPS = {
    "axolotl": {},
    "liger": {
        "plugins": ["axolotl.integrations.liger.LigerPlugin"],
        "liger_rope": True, "liger_rms_norm": True, "liger_glu_activation": True,
        "liger_fused_linear_cross_entropy": True,
    },
    "tigon": {
        "plugins": ["tigon.integrations.axolotl.TigonPlugin"],
        "tigon_rope": True, "tigon_rms_norm": True, "tigon_glu_activation": True,
        "tigon_fused_linear_cross_entropy": True,
    },
}
TIMER_PLUGIN = "tigon.bench.axolotl_timer.StepTimerPlugin"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def save_model(directory: Path, layers: int, smoke: bool) -> int:
    """Llama-3-8B's shapes (the tiny ones with ``smoke``, in fp32) with ``layers`` layers (seed 0,
    bf16) and a word-level tokenizer whose words are the vocabulary's ids past the special tokens;
    returns the vocabulary's size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**MODELS["llama"].config(layers, smoke), bos_token_id=1, eos_token_id=2, pad_token_id=3)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update((f"w{index}", index) for index in range(len(SPECIAL_TOKENS), config.vocab_size))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(directory)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(directory)
    return config.vocab_size


def save_data(path: Path, vocab_size: int, samples: int, seq_len: int) -> None:
    """``samples`` JSONL texts of ``seq_len - 1`` random words (seed 0): ``seq_len`` tokens with ``<s>``."""
    rng = random.Random(0)
    words = range(len(SPECIAL_TOKENS), vocab_size)
    with open(path, "w") as data:
        for _ in range(samples):
            text = " ".join(f"w{rng.choice(words)}" for _ in range(seq_len - 1))
            data.write(json.dumps({"text": text}) + "\n")


def axolotl_config(args: argparse.Namespace, workspace: Path, setup: str) -> dict:
    """The Axolotl config of ``setup``: the shared training config and the setup's plugin keys."""
    config = {
        "base_model": str(workspace / "model"),
        "datasets": [{"path": str(workspace / "data.jsonl"), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": str(workspace / "prepared"), "dataset_processes": 1,
        "output_dir": str(workspace / setup),
        "sequence_len": args.seq_len, "sample_packing": False, "pad_to_sequence_len": True, "train_on_inputs": True,
        "micro_batch_size": args.micro_batch, "gradient_accumulation_steps": 1, "max_steps": args.steps,
        "num_epochs": 1, "optimizer": "adamw_torch" if args.smoke else "adamw_torch_fused",
        "lr_scheduler": "constant", "learning_rate": 1e-4,
        "val_set_size": 0, "logging_steps": 1, "save_strategy": "no", "seed": 42,
        "bf16": not args.smoke, "fp16": False, "tf32": not args.smoke, "attn_implementation": "sdpa",
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
    }
    if args.adapter == "lora":
        config |= {
            "adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "lora_target_linear": True,
            "lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False,
            "lora_embedding_kernel": False,
        }
    keys: dict[str, Any] = dict(SETUPS[setup])
    if setup == "tigon" and args.adapter == "lora":
        keys["tigon_lora"] = True
    keys["plugins"] = [*keys.get("plugins", []), TIMER_PLUGIN]
    return config | keys


def run_setup(args: argparse.Namespace, workspace: Path, setup: str) -> dict:
    """One ``axolotl train`` of ``setup``: its timings and losses, or the error that stopped it."""
    config = axolotl_config(args, workspace, setup)
    path = workspace / f"{setup}.yml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    axolotl = Path(sys.executable).parent / "axolotl"
    command = [str(axolotl) if axolotl.exists() else "axolotl", "train", str(path)]
    env = {**os.environ, "AXOLOTL_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = launch(command, f"axolotl train ({setup})", args.timeout, env)
    if result is None:
        return {"setup": setup, "error": "axolotl train printed no result (its output is above)"}
    timed = result["step_seconds"][args.warmup:]
    tokens = args.micro_batch * args.seq_len
    return {
        "setup": setup, "steps": len(result["step_seconds"]), "timed_steps": len(timed),
        "step_seconds": statistics.median(timed) if timed else None,
        "tokens_per_s": tokens * len(timed) / sum(timed) if timed else None,
        "peak_gib": result["peak_gib"], "losses": result["losses"], "all_step_seconds": result["step_seconds"],
    }


def print_table(record: dict) -> None:
    rows = record["results"]
    base = next((row for row in rows if row["setup"] == "axolotl" and row.get("tokens_per_s")), None)
    print(f"\n{record['title']}")
    print(f"{'setup':<10} {'tokens/s':>10} {'× axolotl':>10} {'peak GiB':>9}  losses")
    for row in rows:
        if row.get("error"):
            print(f"{row['setup']:<10} {row['error']}")
            continue
        ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] is not None else "-"
        losses = " ".join(f"{loss:.4f}" for loss in row["losses"][:4])
        print(f"{row['setup']:<10} {row['tokens_per_s']:>10.0f} {ratio:>10} {peak:>9}  {losses} ...")


def write_results(record: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    with open(out / f"{stem}.csv", "w", newline="") as table:
        writer = csv.writer(table)
        writer.writerow(["setup", "tokens_per_s", "step_seconds", "peak_gib", "first_loss", "last_loss", "error"])
        for row in record["results"]:
            losses = row.get("losses") or [None]
            writer.writerow([row["setup"], row.get("tokens_per_s"), row.get("step_seconds"), row.get("peak_gib"),
                             losses[0], losses[-1], row.get("error")])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tigon bench axolotl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--adapter", choices=["lora", "none"], default="lora")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per setup (default 1200)")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny Llama in fp32, 64 tokens, 3 steps (the default without a GPU); times nothing")
    parser.add_argument("--workspace", type=Path, help="where the model, data and runs go (default: under --out)")
    parser.add_argument("--out", type=Path, help="results folder (default: tigon-out/bench-<gpu>)")
    args = parser.parse_args(argv)
    if args.smoke or not torch.cuda.is_available():
        args.smoke, args.seq_len, args.steps, args.warmup = True, 64, 3, 1
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup}): no step would be timed")
    if args.samples < args.steps * args.micro_batch:
        parser.error(f"--samples ({args.samples}) must be at least --steps × --micro-batch "
                     f"({args.steps * args.micro_batch}): the epoch would end first")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("axolotl") is None and not (Path(sys.executable).parent / "axolotl").exists():
        print("tigon bench axolotl: Axolotl is not installed (pip install axolotl==0.21.0)", file=sys.stderr)
        return 2
    smoke, device, gpu = run_device(args.smoke)
    out = args.out or default_out(smoke, gpu)
    workspace = args.workspace or out / "axolotl-workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    vocab_size = save_model(workspace / "model", args.layers, smoke)
    save_data(workspace / "data.jsonl", vocab_size, args.samples, args.seq_len)
    adapter = "LoRA r 16" if args.adapter == "lora" else "every weight"
    shapes = "the tiny stand-in for Llama-3-8B (smoke run: timings mean nothing)" if smoke else "Llama-3-8B shapes"
    record: dict[str, Any] = {
        "title": f"Axolotl train, {shapes}, {args.layers} layers, {adapter}, "
                 f"{args.micro_batch} × {args.seq_len} tokens per step, {'fp32' if smoke else 'bf16'}",
        "config": {key: value for key, value in vars(args).items() if key not in ("out", "workspace")},
        "environment": environment(device.type) | {name: version(name) for name in ("axolotl", "liger-kernel")},
        "results": [],
    }
    stem = "axolotl_smoke" if smoke else f"axolotl_llama_{args.adapter}_l{args.layers}"
    for setup in args.setups:
        record["results"].append(run_setup(args, workspace, setup))
        write_results(record, out, stem)
    print_table(record)
    return 0
