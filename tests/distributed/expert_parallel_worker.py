"""Trains a tiny MoE model loaded from a checkpoint for a few SGD steps: in one process, or in
each process of a torchrun launch under transformers' expert parallelism (or its tensor
parallelism), with Hugging Face's experts or tigon's. Several runs share one launch (one process
group, one import of everything); a launch's plain runs come before its patched ones, as
``apply_tigon`` patches the family's modeling module for the whole process.

    python expert_parallel_worker.py CHECKPOINTS RUNS.json OUT_DIR
    RUNS.json: {"name": {"model": "qwen3_moe" | ..., "parallel": "none" | "ep" | "tp",
                         "tigon": "none" | "experts" | "apply", "checkpointing": false}, ...}

``model``: the checkpoint ``CHECKPOINTS/<model>``. ``checkpointing``: Hugging Face's gradient
checkpointing (non-reentrant), whose recomputed experts forward runs transformers' hooks again.
``parallel``: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=WORLD_SIZE,
enable_expert_parallel=...))`` over every process, ``"ep"`` with expert parallelism, ``"tp"``
without. ``tigon``: ``"experts"`` loads with ``experts_implementation="tigon"`` (the experts
alone on tigon's kernel), ``"apply"`` calls ``apply_tigon`` on the loaded model (experts, norms,
RoPE, MLP and the fused loss).

Every process trains on the same batches (neither parallelism splits the data: every rank runs
every token). Each process writes ``OUT_DIR/<name>.rank<r>.pt``, a dict: ``losses`` (per step),
``grads`` (per step, each parameter's whole gradient: a DTensor's gathered over the ranks, a
plain tensor as this rank holds it, before the step), ``params`` (every parameter, whole, after
the last step), ``functions`` (the autograd nodes behind the first loss), ``local_experts`` (the
experts' weights' local shapes) and ``dtensor_refusal`` (under expert parallelism with tigon's
experts: the error of an experts forward called on the sharded weights, without transformers'
experts hook).
"""

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import tigon  # noqa: F401  (first: without a GPU it switches on Triton's interpreter)

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from tigon.transformers import apply_tigon

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils import graph_functions  # noqa: E402  (tests/utils.py)

STEPS, BATCH, SEQ = 3, 2, 12
LR = 0.1


def batch(step: int, vocab_size: int) -> dict:
    """Step ``step``'s batch, the same in every process; a prompt and a padded tail are -100."""
    generator = torch.Generator().manual_seed(step)
    input_ids = torch.randint(0, vocab_size, (BATCH, SEQ), generator=generator)
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[1, -3:] = -100
    return dict(input_ids=input_ids, labels=labels)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def load(checkpoints: Path, run: dict, world_size: int):
    # GPT-OSS's attention sinks: eager attention.
    options: dict[str, Any] = {"attn_implementation": "eager"} if run["model"] == "gpt_oss" else {}
    if run["parallel"] != "none":
        options["distributed_config"] = DistributedConfig(
            tp_size=world_size, enable_expert_parallel=run["parallel"] == "ep"
        )
    if run["tigon"] == "experts":
        options["experts_implementation"] = "tigon"
    model = AutoModelForCausalLM.from_pretrained(checkpoints / run["model"], dtype=torch.float32, **options)
    if run["tigon"] == "apply":
        model = apply_tigon(model)
    if run["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def dtensor_refusal(model) -> str | None:
    """The experts' own forward (the class's, without transformers' hook that hands it the local
    weights) called on the DTensor weights: tigon's refusal, or None if it ran."""
    experts = model.model.layers[0].mlp.experts
    hidden = torch.zeros(3, model.config.hidden_size)
    index = torch.zeros(3, model.config.num_experts_per_tok, dtype=torch.long)
    try:
        type(experts).forward(experts, hidden, index, torch.ones(index.shape))
    except ValueError as error:
        return str(error)
    return None


def train(checkpoints: Path, run: dict, world_size: int) -> dict:
    model = load(checkpoints, run, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    record: dict = {"losses": [], "grads": []}
    for step in range(STEPS):
        loss = model(**batch(step, model.config.vocab_size)).loss
        if step == 0:
            record["functions"] = sorted(graph_functions(loss))
        loss.backward()
        record["losses"].append(loss.item())
        record["grads"].append({name: whole(p.grad) for name, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record["params"] = {name: whole(p) for name, p in model.named_parameters()}
    experts = model.model.layers[0].mlp.experts
    record["local_experts"] = [
        tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for p in (experts.gate_up_proj, experts.down_proj)
    ]
    if run["parallel"] == "ep" and run["tigon"] != "none":
        record["dtensor_refusal"] = dtensor_refusal(model)
    return record


def main() -> None:
    checkpoints, runs, out = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, run in runs.items():
        torch.save(train(checkpoints, run, world_size), out / f"{name}.rank{rank}.pt")
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
