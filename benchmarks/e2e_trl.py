"""End to end under TRL: SFTTrainer alone, + Liger-Kernel, + tigon; GRPO's policy log-probs with TRL's head and tigon's.

The model is tigon bench e2e's (4 layers of Llama-3-8B's shapes, random seeded weights, bf16, SDPA,
non-reentrant gradient checkpointing). Two measurements:

1. **SFT**: TRL's ``SFTTrainer`` (which computes its loss from TRL's fused LM head,
   ``add_fused_lm_head``) on batches of 4 × 4096 tokens, PyTorch's fused AdamW
   (``optim="adamw_torch_fused"``), ``bf16=True``. Setups: ``trl`` (TRL alone), ``liger``
   (``use_liger_kernel=True``: TRL applies Liger's RMSNorm, SwiGLU and RoPE and keeps its own
   head) and ``tigon`` (``apply_tigon(model)`` then ``tigon.trl.patch_trl()`` before the trainer
   is built: tigon's layers and tigon's kernel behind TRL's head). The data is built in memory:
   pre-tokenized documents of random tokens and random lengths, which TRL packs ("wrapped": cut
   into rows of exactly 4096 tokens) so that every batch is 4 full rows with causal attention, as
   in tigon bench e2e. (TRL's default "bfd" packing flattens a batch into one row of 16384 tokens
   with position ids, for varlen flash attention; under SDPA that turns into a 16384² masked
   attention, four times the work, which no one would train with.) The tokenizer is three
   words, for the padding and end-of-sequence ids the trainer asks for. Same seed, same data
   order and same initial weights in every setup, so their per-step losses compare.
   Timing: a ``TrainerCallback`` synchronises the GPU at the end of step ``--warmup`` and of the
   last step and times that window: ``--steps`` whole steps as the trainer runs them (batch
   collation, forward, backward, clipping, optimizer, TRL's metrics and logging). Peak memory is
   ``torch.cuda.max_memory_allocated`` from after the model's creation to the end of training
   (warm-up included, where the optimizer's state is created), and separately over the timed
   steps alone.
2. **GRPO policy log-probs, forward + backward**: ``add_fused_lm_head(model, temperature,
   outputs=("log_probs", "entropy"))`` looked up in ``trl.trainer.grpo_trainer`` (the name
   ``GRPOTrainer`` calls), then the call ``GRPOTrainer`` makes, ``model(input_ids=...,
   attention_mask=..., labels=..., fused_lm_head=True)`` under bf16 autocast, on 4 sequences of
   4096 tokens: a prompt of ``--prompt-len`` tokens (labels -100) and a completion of random
   length, right-padded. The loss is GRPO's per-token ``-exp(lp - lp.detach()) * advantage``
   (one random advantage per sequence), masked mean over the completion tokens. Variants:
   ``trl`` (TRL's head), ``tigon_head`` (``patch_trl()`` only), ``tigon`` (``apply_tigon(model)``
   and ``patch_trl()``), ``liger`` (Liger's layers, TRL's head; not run by default). Timed:
   ``--grpo-steps`` forward + backward passes after ``--grpo-warmup``, synchronised; peak memory
   from after the model's creation. The mean log-prob, mean entropy and the gradient's norm of
   the first pass are recorded, so the heads can be checked against each other.

Each setup and variant runs in its own process (patching is global; peak memory must start from
nothing), TRL alone first so that a run cut short keeps the baseline; the JSON is rewritten after
each. ``--tiny`` is a CPU smoke run (a 2-layer model of hidden size 64, a few steps, every setup in
one process, as on CPU the imports dominate and memory is not measured); its timings mean nothing.

    python benchmarks/e2e_trl.py [--setups trl liger tigon] [--grpo-setups trl tigon_head tigon] [--out DIR]
    python benchmarks/e2e_trl.py --tiny [--out DIR]          # CPU smoke run, into tigon-out/e2e_trl-tiny

On the GPU machine, one call (``carry: [".whl"]``; trl 1.16.0, datasets 5.2.0 with dill and
multiprocess, and liger-kernel 0.8.5 travel as wheels in the git-ignored .whl/; torch, triton,
transformers, accelerate, pyarrow and the rest are there)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/trl-1.16.0-*.whl .whl/datasets-5.2.0-*.whl .whl/dill-0.4.1-*.whl .whl/multiprocess-0.70.19-*.whl \
      .whl/liger_kernel-0.8.5-*.whl && export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 || exit; \
    set -o pipefail; python3 benchmarks/e2e_trl.py --out $OUT 2>&1 | tee $OUT/e2e_trl.log

Expected wall time on an H100: 3 to 5 minutes. Six processes of 25-60 s each: imports (~10 s),
the model's build, Triton's first compilations (TRL's head, Liger's and tigon's kernels; the disk
cache serves later processes), 13 SFT steps of ~0.35 s or 7 GRPO passes of ~0.3 s.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch

from e2e_fsdp2 import launch
from tigon.bench.e2e import build_model, gpu_slug

HERE = Path(__file__).resolve().parent
SFT_SETUPS = ("trl", "liger", "tigon")
GRPO_SETUPS = ("trl", "tigon_head", "tigon", "liger")
SFT_LABELS = {"trl": "TRL", "liger": "TRL + Liger-Kernel", "tigon": "TRL + tigon"}
GRPO_LABELS = {
    "trl": "TRL's head", "tigon_head": "tigon's head", "tigon": "tigon's head and layers",
    "liger": "TRL's head, Liger's layers",
}
LABELS = {"sft": SFT_LABELS, "grpo": GRPO_LABELS}
# The smoke run's model and sizes (--tiny): small enough for Triton's interpreter on two CPU cores.
TINY_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256)
TINY_SIZES = dict(layers=2, batch=2, seq_len=16, warmup=1, steps=1, grpo_warmup=1, grpo_steps=1, prompt_len=4)
# What the issue asks of tigon under SFT, against TRL alone.
TARGETS = {"speedup_vs_trl": 1.20, "memory_vs_trl": 0.80}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def new_model(args, device: str, kernels: str = "hf"):
    """tigon bench e2e's model (the same weights in every process), its decoder layers Hugging Face's or,
    patched on the built model as a TRL user would, tigon's (``kernels="tigon"``) or Liger's."""
    model = build_model("hf", args.layers, device, **(TINY_SHAPE if args.tiny else {}))
    if kernels == "tigon":
        from tigon.transformers import apply_tigon

        apply_tigon(model)
    elif kernels == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False, model=model)
    return model


def head_state() -> dict:
    """Whose kernel TRL's fused head ran, and tigon's mode after the run (gradients computed in the
    forward pass, which serves sum/mean losses, or a recomputing backward, which GRPO's needs)."""
    from tigon.trl import TigonLogProbHead, is_patched

    if not is_patched():
        return {"head": "TRL"}
    mode = "gradients in forward" if TigonLogProbHead.grad_in_forward else "recomputing backward"
    return {"head": "tigon", "head_mode": mode}


def pad_tokenizer():
    """A tokenizer of three words: the data is already token ids, and the trainer only asks for the
    padding and end-of-sequence ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def documents(n_rows: int, seq_len: int, vocab_size: int):
    """Pre-tokenized documents of random tokens, between seq_len / 8 and 3 seq_len / 4 long (the last
    one cut), ``n_rows · seq_len`` tokens in all, the same in every process. Wrapped packing cuts
    them into exactly ``n_rows`` full rows: it keeps a partial last row, which would bring padding."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    docs, left = [], n_rows * seq_len
    while left:
        length = min(left, int(torch.randint(seq_len // 8, 3 * seq_len // 4 + 1, (), generator=generator)))
        docs.append(torch.randint(0, vocab_size, (length,), generator=generator).tolist())
        left -= length
    return Dataset.from_dict({"input_ids": docs})


def step_timer(warmup: int, device: str):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """The wall time of the steps after the first ``warmup``, between synchronisations at the end of
        step ``warmup`` and of the last step, and the peak memory of those steps."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (warmup, args.max_steps):
                synchronize(device)
                now = time.perf_counter()
            if state.global_step == warmup:
                self.start, self.warmup_peak_gib = now, peak_gib(device)
                reset_peak(device)
            if state.global_step == args.max_steps:
                self.seconds = now - self.start
                self.timed_peak_gib = peak_gib(device)

    return StepTimer()


def run_sft(setup: str, args, device: str) -> dict:
    from trl import SFTConfig, SFTTrainer

    # Liger's layers are TRL's to apply (use_liger_kernel=True below).
    model = new_model(args, device, "tigon" if setup == "tigon" else "hf")
    if setup == "tigon":
        from tigon.trl import patch_trl

        patch_trl()
    synchronize(device)
    model_gib = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
    reset_peak(device)
    max_steps = args.warmup + args.steps
    dataset = documents(max_steps * args.batch, args.seq_len, model.config.vocab_size)  # one epoch
    timer = step_timer(args.warmup, device)
    with tempfile.TemporaryDirectory() as scratch:
        config = SFTConfig(
            output_dir=scratch, max_length=args.seq_len, packing=True, packing_strategy="wrapped",
            per_device_train_batch_size=args.batch, max_steps=max_steps, learning_rate=1e-5,
            lr_scheduler_type="constant", optim="adamw_torch_fused", bf16=True, gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False}, use_liger_kernel=setup == "liger",
            logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
            seed=0, use_cpu=device == "cpu",
        )
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=pad_tokenizer(),
                             callbacks=[timer])
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "setup": setup, "label": LABELS["sft"][setup], **head_state(),
        "tokens_per_second": args.batch * args.seq_len * args.steps / timer.seconds,
        "seconds_per_step": timer.seconds / args.steps,
        # From the model's creation to the end: the larger of the warm-up's and the timed steps' peaks.
        "peak_memory_gib": max(timer.warmup_peak_gib, timer.timed_peak_gib) if device == "cuda" else None,
        "peak_memory_timed_gib": timer.timed_peak_gib, "model_memory_gib": model_gib,
        "losses": [entry["loss"] for entry in logs], "grad_norms": [entry.get("grad_norm") for entry in logs],
        "entropy": [entry.get("entropy") for entry in logs],
    }
    del trainer, model
    return result


def grpo_batch(args, vocab_size: int, device: str) -> dict:
    """Prompts of ``prompt_len`` tokens, completions of random lengths (half to all of the rest),
    right-padded; labels only on the completions; one advantage per sequence."""
    generator = torch.Generator().manual_seed(1)
    batch, seq_len, prompt_len = args.batch, args.seq_len, args.prompt_len
    input_ids = torch.randint(0, vocab_size, (batch, seq_len), generator=generator)
    longest = seq_len - prompt_len
    completion_len = torch.randint(longest // 2, longest + 1, (batch, 1), generator=generator)
    attention_mask = (torch.arange(seq_len) < prompt_len + completion_len).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :prompt_len] = -100
    advantages = torch.randn(batch, generator=generator)
    return {name: tensor.to(device) for name, tensor in (
        ("input_ids", input_ids), ("attention_mask", attention_mask), ("labels", labels), ("advantages", advantages),
    )}


def run_grpo(variant: str, args, device: str) -> dict:
    import trl.trainer.grpo_trainer as grpo_trainer

    model = new_model(args, device, "hf" if variant == "tigon_head" else variant)
    if variant in ("tigon_head", "tigon"):
        from tigon.trl import patch_trl

        patch_trl()
    # The name GRPOTrainer calls, looked up after patching: what patch_trl must reach.
    grpo_trainer.add_fused_lm_head(model, temperature=args.temperature, outputs=("log_probs", "entropy"))
    inputs = grpo_batch(args, model.config.vocab_size, device)
    advantages = inputs.pop("advantages")
    completion_mask = inputs["labels"][:, 1:] != -100
    synchronize(device)
    reset_peak(device)

    def forward_backward():
        with torch.autocast(device, dtype=torch.bfloat16):
            outputs = model(**inputs, fused_lm_head=True)
        log_probs = outputs.log_probs  # [B, T - 1], zero where the label is -100
        ratio = torch.exp(log_probs - log_probs.detach())  # 1, but its gradient is d log_probs
        loss = (-ratio * advantages[:, None] * completion_mask).sum() / completion_mask.sum()
        loss.backward()
        return log_probs.detach(), outputs.entropy.detach()

    log_probs, entropy = forward_backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    first = {
        "mean_log_prob": (log_probs.float().sum() / completion_mask.sum()).item(),
        "mean_entropy": (entropy.float() * completion_mask).sum().item() / completion_mask.sum().item(),
        "grad_norm": grad_norm.item(),
    }
    model.zero_grad(set_to_none=True)
    for _ in range(args.grpo_warmup - 1):
        forward_backward()
        model.zero_grad(set_to_none=True)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(args.grpo_steps):
        forward_backward()
        model.zero_grad(set_to_none=True)
    synchronize(device)
    seconds = (time.perf_counter() - start) / args.grpo_steps
    result = {
        "setup": variant, "label": LABELS["grpo"][variant], **head_state(), "ms_per_step": seconds * 1e3,
        "tokens_per_second": args.batch * args.seq_len / seconds, "peak_memory_gib": peak_gib(device),
        "completion_tokens": int(completion_mask.sum()), **first,
    }
    del model, inputs
    return result


def run_child(jobs: list[str], args) -> list[dict]:
    """Run ``jobs`` ("sft:<setup>" or "grpo:<variant>") in this process, one after the other; a job that
    fails records its error and the next still runs."""
    import tigon  # noqa: F401  (first: without a GPU it switches Triton's interpreter on before TRL loads Triton)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for job in jobs:
        kind, setup = job.split(":")
        try:
            result = (run_sft if kind == "sft" else run_grpo)(setup, args, device)
        except Exception as error:  # noqa: BLE001  (reported in the JSON; a missing peer is not fatal)
            reason = f"{type(error).__name__}: {error}"
            if setup == "liger" and device == "cpu":
                reason = f"skipped: Liger-Kernel does not run without a GPU here ({reason})"
            result = {"setup": setup, "label": LABELS[kind][setup], "error": reason,
                      "traceback": traceback.format_exc()[-3000:]}
        results.append({"job": kind, **result})
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def environment(device: str) -> dict:
    versions = {}
    for package in ("torch", "triton", "transformers", "trl", "liger-kernel", "datasets", "accelerate", "tigon"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    # No commit is recorded: the GPU machine's copy of the working tree carries a stale .git.
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "python": sys.version.split()[0],
        "cuda": torch.version.cuda, **versions,
    }


def add_ratios(results: list[dict]) -> None:
    """Speed-up and memory against the ``trl`` row, and the largest difference of a step's loss from it."""
    base = next((r for r in results if r["setup"] == "trl" and "error" not in r), None)
    if base is None:
        return
    for r in results:
        if "error" in r:
            continue
        r["speedup_vs_trl"] = r["tokens_per_second"] / base["tokens_per_second"]
        if r["peak_memory_gib"] is not None:
            r["memory_vs_trl"] = r["peak_memory_gib"] / base["peak_memory_gib"]
        if "losses" in r:
            r["max_loss_diff_vs_trl"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))


def targets(sft: list[dict]) -> dict | None:
    """Whether TRL + tigon meets each of TARGETS, and is faster than TRL + Liger."""
    by_setup = {r["setup"]: r for r in sft if "error" not in r}
    tigon = by_setup.get("tigon")
    if tigon is None or "speedup_vs_trl" not in tigon or tigon.get("memory_vs_trl") is None:
        return None
    speedup, memory = TARGETS["speedup_vs_trl"], TARGETS["memory_vs_trl"]
    met = {
        f"tokens/s >= {speedup:.2f}x TRL alone": tigon["speedup_vs_trl"] >= speedup,
        f"peak memory <= {memory:.0%} of TRL alone": tigon["memory_vs_trl"] <= memory,
    }
    if "liger" in by_setup:
        met["tokens/s ahead of TRL + Liger"] = tigon["tokens_per_second"] > by_setup["liger"]["tokens_per_second"]
    return met


def print_table(title: str, rows: list[dict], columns: tuple[tuple[str, str, str], ...]) -> None:
    """One line per setup: its label, then each column's (heading, key, format); "-" where a value is missing."""
    print(f"\n{title}\n{'':<28}" + "".join(f"{heading:>13}" for heading, _, _ in columns))
    for r in rows:
        if "error" in r:
            print(f"{r['label']:<28} not run: {r['error']}")
            continue
        cells = (format(r[key], spec) if r.get(key) is not None else "-" for _, key, spec in columns)
        print(f"{r['label']:<28}" + "".join(f"{cell:>13}" for cell in cells))


def print_tables(record: dict) -> None:
    config = record["config"]
    if config["tiny"]:
        print("\nsmoke run (--tiny): the timings below mean nothing")
    against_trl = (("speed-up", "speedup_vs_trl", ".3f"), ("peak GiB", "peak_memory_gib", ".2f"),
                   ("memory", "memory_vs_trl", ".1%"))
    print_table(f"SFT, batch {config['batch']} x {config['seq_len']}", record["sft"],
                (("tokens/s", "tokens_per_second", ",.0f"), *against_trl,
                 ("max |dloss|", "max_loss_diff_vs_trl", ".2e")))
    print_table("GRPO policy log-probs, forward + backward", record["grpo"],
                (("ms", "ms_per_step", ".1f"), *against_trl, ("mean logp", "mean_log_prob", ".5f"),
                 ("grad norm", "grad_norm", ".4f")))
    if record["targets"]:
        verdicts = (f"{name}: {'met' if met else 'NOT met'}" for name, met in record["targets"].items())
        print("\ntargets: " + ", ".join(verdicts))


SETUP_COLORS = {"trl": "tab:gray", "liger": "tab:orange", "tigon_head": "lightsteelblue", "tigon": "tab:blue"}


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("sft", "tokens_per_second", "SFT tokens/s"), ("sft", "peak_memory_gib", "SFT peak memory (GiB)"),
        ("grpo", "ms_per_step", "GRPO log-probs fwd + bwd (ms)"), ("grpo", "peak_memory_gib", "GRPO peak memory (GiB)"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (part, key, title) in zip(axes, panels):
        rows = [r for r in record[part] if "error" not in r and r.get(key) is not None]
        values = [r[key] for r in rows]
        # One colour per kind of setup in every panel: TRL alone grey, Liger orange, tigon blues.
        colors = [SETUP_COLORS.get(r["setup"], "tab:green") for r in rows]
        bars = ax.bar(range(len(rows)), values, color=colors)
        ax.bar_label(bars, [f"{v:,.0f}" if v > 100 else f"{v:.2f}" for v in values], fontsize=8)
        ax.set_xticks(range(len(rows)), [r["label"].replace(" and ", "\n+ ").replace(", ", ",\n") for r in rows],
                      fontsize=8)
        ax.set_title(title)
    config = record["config"]
    model = f"tiny {config['layers']}-layer Llama" if config["tiny"] else f"{config['layers']}-layer Llama-3-8B shapes"
    fig.suptitle(f"{model} under TRL {record['environment']['trl']}, bf16, batch {config['batch']} × "
                 f"{config['seq_len']} — {record['environment']['device']}"
                 + (" (smoke run: timings mean nothing)" if config["tiny"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="*", choices=SFT_SETUPS, default=list(SFT_SETUPS))
    parser.add_argument("--grpo-setups", nargs="*", choices=GRPO_SETUPS, default=["trl", "tigon_head", "tigon"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3, help="SFT steps before the timed ones")
    parser.add_argument("--steps", type=int, default=10, help="timed SFT steps")
    parser.add_argument("--grpo-warmup", type=int, default=2)
    parser.add_argument("--grpo-steps", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0, help="GRPO's sampling temperature (its default)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: " + ", ".join(
        f"{k.replace('_', '-')} {v}" for k, v in TINY_SIZES.items()) + ", a model of hidden size 64")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        for name, value in TINY_SIZES.items():
            setattr(args, name, value)
    if min(args.warmup, args.steps, args.grpo_warmup, args.grpo_steps) < 1:
        parser.error("--warmup, --steps, --grpo-warmup and --grpo-steps take at least 1")
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, args)))
        return 0

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        parser.error("without a GPU only --tiny runs")
    out = args.out or (HERE.parent / "tigon-out" / "e2e_trl-tiny" if args.tiny else HERE / "results" / gpu_slug())
    out.mkdir(parents=True, exist_ok=True)
    # On a GPU, SFT first, TRL alone first: a run cut short loses the least. In one process (--tiny),
    # TRL's head first, then tigon's, then Liger's: apply_tigon and Liger patch the modeling module's
    # RoPE (Liger its RMSNorm and MLP classes too), which models built afterwards would use.
    order = ("trl", "tigon_head", "tigon", "liger")
    jobs = [("sft", s) for s in args.setups] + [("grpo", s) for s in args.grpo_setups]
    jobs.sort(key=lambda job: (order.index(job[1]), job[0]) if args.tiny else (job[0] != "sft", order.index(job[1])))
    jobs = [f"{kind}:{setup}" for kind, setup in jobs]
    options = ["--tiny"] if args.tiny else [
        "--layers", str(args.layers), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
        "--warmup", str(args.warmup), "--steps", str(args.steps), "--grpo-warmup", str(args.grpo_warmup),
        "--grpo-steps", str(args.grpo_steps), "--prompt-len", str(args.prompt_len),
    ]
    options += ["--temperature", str(args.temperature)]
    # On a GPU each job has a process of its own; on CPU the imports would dominate, so one runs them all.
    groups = [jobs] if args.tiny else [[job] for job in jobs]
    record = {
        "environment": environment(device),
        "config": {name: getattr(args, name) for name in (
            "tiny", "layers", "batch", "seq_len", "warmup", "steps", "grpo_warmup", "grpo_steps", "prompt_len",
            "temperature")} | {"optimizer": "adamw_torch_fused", "attention": "sdpa", "gradient_checkpointing": True},
        "sft": [], "grpo": [], "targets": None,
    }
    for group in groups:
        results = launch([sys.executable, __file__, "--child", *group, *options], " ".join(group))
        if results is None:
            results = [{"job": kind, "setup": setup, "label": LABELS[kind][setup], "error": "its process failed"}
                       for kind, setup in (job.split(":") for job in group)]
        for result in results:
            kind = result.pop("job")
            record[kind].append(result)
            record[kind].sort(key=lambda r: order.index(r["setup"]))
            summary = {k: v for k, v in result.items() if k not in ("traceback", "losses", "grad_norms", "entropy")}
            print(f"{kind}:{result['setup']}: {json.dumps(summary)}", flush=True)
        add_ratios(record["sft"])
        add_ratios(record["grpo"])
        record["targets"] = None if args.tiny else targets(record["sft"])
        # Written after every process: a call cut short keeps what it measured.
        (out / "e2e_trl.json").write_text(json.dumps(record, indent=2))
    print_tables(record)
    plot(record, out / "e2e_trl.png")
    print(f"wrote {out / 'e2e_trl.json'} and {out / 'e2e_trl.png'}")
    return 0 if any("error" not in r for r in record["sft"] + record["grpo"]) else 1


if __name__ == "__main__":
    sys.exit(main())
