"""``tigon bench e2e --trl sft grpo``: the training step as TRL runs it, with TRL's fused LM head.

The model is ``MODELS[model]`` of :mod:`tigon.bench.e2e_models` as Hugging Face builds it; the
setups patch the built model, as a TRL user would: ``hf`` is TRL alone (TRL's head), ``tigon_head``
adds ``tigon.trl.patch_trl()`` (tigon's kernel behind TRL's head), ``tigon`` also
``apply_tigon(model)`` (tigon's layers), ``liger`` Liger-Kernel's layers with TRL's head.

- **sft**: TRL's ``SFTTrainer`` (its loss from TRL's fused LM head, ``add_fused_lm_head``), PyTorch's
  fused AdamW (``optim="adamw_torch_fused"``), ``bf16=True`` on a GPU; Liger through TRL's own
  ``use_liger_kernel=True``. The data is built in memory: pre-tokenized documents of random tokens and
  random lengths, packed "wrapped" (cut into rows of exactly ``seq_len`` tokens) so that every batch
  is full rows with causal attention. (TRL's default "bfd" packing flattens a batch into one row with
  position ids, for varlen flash attention; under SDPA that is a ``(B·T)²`` masked attention, which
  no one would train with.) Timing: a ``TrainerCallback`` synchronises at the end of step
  ``warmup`` and of the last step and times that window, whole steps as the trainer runs them
  (collation, forward, backward, clipping, optimizer, TRL's metrics and logging). Peak memory from
  after the model's creation to the end (warm-up included, where the optimizer's state is
  created), and separately over the timed steps.
- **grpo**: the policy's log-probs, forward + backward, as ``GRPOTrainer`` computes them:
  ``add_fused_lm_head(model, temperature, outputs=("log_probs", "entropy"))`` looked up in
  ``trl.trainer.grpo_trainer`` (the name the trainer calls, which ``patch_trl`` must reach), then
  ``model(input_ids, attention_mask, labels, fused_lm_head=True)`` (under bf16 autocast on a GPU)
  on sequences of a prompt of ``prompt_len`` tokens (labels -100) and a completion of random length,
  right-padded. The loss is GRPO's per-token ``-exp(lp - lp.detach()) * advantage`` (one random
  advantage per sequence), masked mean over the completion tokens. Timed: ``steps`` passes after
  ``warmup``, synchronised; peak memory from after the model's creation. The mean log-prob, mean
  entropy and the gradient's norm of the first pass are recorded, so the heads can be checked
  against each other.
"""

from __future__ import annotations

import tempfile
import time

import torch

from tigon.bench.e2e_models import MODELS, build_model
from tigon.bench.machine import peak_gib, reset_peak, synchronize

LOOPS = ("sft", "grpo")
LABELS = {
    "sft": {"hf": "TRL", "tigon_head": "TRL + tigon's head", "tigon": "TRL + tigon", "liger": "TRL + Liger-Kernel"},
    "grpo": {"hf": "TRL's head", "tigon_head": "tigon's head", "tigon": "tigon's head and layers",
             "liger": "TRL's head, Liger's layers"},
}


def new_model(args, model: str, setup: str, device: str, loop: str):
    """``MODELS[model]`` as Hugging Face builds it (the same weights in every process), then patched
    as a TRL user would: tigon's layers (``apply_tigon``), Liger's (for GRPO; SFT asks TRL for
    them) or none, and tigon's kernel behind TRL's head."""
    dtype = torch.float32 if args.smoke else torch.bfloat16
    built = build_model("hf", args.layers, device, model=model, dtype=dtype, tiny=args.smoke)
    if setup == "tigon":
        from tigon.transformers import apply_tigon

        apply_tigon(built)
    elif setup == "liger" and loop == "grpo":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        MODEL_TYPE_TO_APPLY_LIGER_FN[MODELS[model].model_type](
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=built,
        )
    if setup in ("tigon_head", "tigon"):
        from tigon.trl import patch_trl

        patch_trl()
    return built


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
        step ``warmup`` and of the last step, and the peak memory before and over those steps."""

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


def run_sft(args, model: str, setup: str, device: str) -> dict:
    from trl import SFTConfig, SFTTrainer

    built = new_model(args, model, setup, device, "sft")
    synchronize(device)
    model_gib = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
    reset_peak(device)
    max_steps = args.warmup + args.steps
    dataset = documents(max_steps * args.batch, args.seq_len, built.config.vocab_size)  # one epoch
    timer = step_timer(args.warmup, device)
    with tempfile.TemporaryDirectory() as scratch:
        config = SFTConfig(
            output_dir=scratch, max_length=args.seq_len, packing=True, packing_strategy="wrapped",
            per_device_train_batch_size=args.batch, max_steps=max_steps, learning_rate=1e-5,
            lr_scheduler_type="constant", optim="adamw_torch_fused", bf16=device == "cuda",
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
            use_liger_kernel=setup == "liger", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
            dataloader_num_workers=0, seed=0, use_cpu=device == "cpu",
        )
        trainer = SFTTrainer(model=built, args=config, train_dataset=dataset, processing_class=pad_tokenizer(),
                             callbacks=[timer])
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        **head_state(),
        "tokens_per_second": args.batch * args.seq_len * args.steps / timer.seconds,
        "seconds_per_step": timer.seconds / args.steps,
        # From the model's creation to the end: the larger of the warm-up's and the timed steps' peaks.
        "peak_memory_gib": max(timer.warmup_peak_gib, timer.timed_peak_gib) if device == "cuda" else None,
        "peak_memory_timed_gib": timer.timed_peak_gib, "model_memory_gib": model_gib,
        "losses": [entry["loss"] for entry in logs], "grad_norms": [entry.get("grad_norm") for entry in logs],
        "entropy": [entry.get("entropy") for entry in logs],
    }


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


def run_grpo(args, model: str, setup: str, device: str) -> dict:
    import trl.trainer.grpo_trainer as grpo_trainer

    built = new_model(args, model, setup, device, "grpo")
    grpo_trainer.add_fused_lm_head(built, temperature=args.temperature, outputs=("log_probs", "entropy"))
    inputs = grpo_batch(args, built.config.vocab_size, device)
    advantages = inputs.pop("advantages")
    completion_mask = inputs["labels"][:, 1:] != -100
    synchronize(device)
    reset_peak(device)

    def forward_backward():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            outputs = built(**inputs, fused_lm_head=True)
        log_probs = outputs.log_probs  # [B, T - 1], zero where the label is -100
        ratio = torch.exp(log_probs - log_probs.detach())  # 1, but its gradient is d log_probs
        loss = (-ratio * advantages[:, None] * completion_mask).sum() / completion_mask.sum()
        loss.backward()
        return log_probs.detach(), outputs.entropy.detach()

    log_probs, entropy = forward_backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in built.parameters()]))
    first = {
        "mean_log_prob": (log_probs.float().sum() / completion_mask.sum()).item(),
        "mean_entropy": (entropy.float() * completion_mask).sum().item() / completion_mask.sum().item(),
        "grad_norm": grad_norm.item(),
    }
    built.zero_grad(set_to_none=True)
    for _ in range(args.warmup - 1):  # the first pass above is a warm-up too
        forward_backward()
        built.zero_grad(set_to_none=True)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        forward_backward()
        built.zero_grad(set_to_none=True)
    synchronize(device)
    seconds = (time.perf_counter() - start) / args.steps
    return {
        **head_state(), "ms_per_step": seconds * 1e3, "tokens_per_second": args.batch * args.seq_len / seconds,
        "peak_memory_gib": peak_gib(device), "completion_tokens": int(completion_mask.sum()), **first,
    }
