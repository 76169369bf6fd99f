"""One rank of the vocabulary-parallel tests: runs every case of :data:`CASES` on this rank's shard
of the LM head and saves what it got.

    python vocab_parallel_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR

A gloo group on CPU (Triton's interpreter). The head of :func:`problem` is split along the
vocabulary: for the ``"group"`` API into the uneven shards of :data:`GROUP_SPLITS` (plain tensors
and ``process_group``), for the DTensor APIs by ``distribute_tensor(..., [Shard(0)])``
(``torch.chunk``'s split: 51 and 50 rows of V = 101 over two ranks). Each rank writes
``OUT_DIR/rank<r>.pt``: per case the outputs (loss, z-loss or the log-probs fields), the gradient
of the input and this rank's slices of the weight's and bias's gradients; and per bad call of
:data:`BAD_CALLS` the error it raised (type and message).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import tigon  # noqa: F401  (first: without a GPU it switches on Triton's interpreter)

import torch
import torch.distributed as dist

import tigon.functional as tf
from tigon.losses import fused_linear_grpo
from tigon.testing import reference

N_TOKENS, HIDDEN, VOCAB = (3, 13), 16, 101
IGNORE_EVERY = 7
# Rows per chunk (of the largest shard): the 39 tokens run in 4 chunks, the last partial.
CHUNK_ROWS = 10
# The uneven shards of the "group" API, per world size (torch.chunk's split is the DTensor cases'),
# one of them empty.
GROUP_SPLITS = {2: (60, 41), 4: (30, 0, 51, 20)}
ALL_OPTIONS = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=3.0)
LOGPROB_OPTIONS = dict(temperature=0.7, softcap=2.0, logit_scale=1.3)
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

# name → (loss, api, bias, options): loss "flce" (fused_linear_cross_entropy), "logprobs"
# (fused_linear_logprobs, every field, with gradients from log_probs and entropy),
# "logprobs_sft" (the same, the gradient from half the sum of the log-probs alone),
# "logprobs_weighted" (from a weighted sum of the log-probs alone), "trl_head" (as "logprobs",
# through tigon.trl.TigonLogProbHead.apply, TRL's call) or "grpo"
# (fused_linear_grpo off-policy, the loss and every metric; "chunk_rows" sets its chunks: 26 holds
# two whole completions, 10 less than one, so GSPO's and VESPO's losses take two passes); api "group"
# (plain shards and process_group), "dtensor" (a DTensor weight, a plain input) or
# "dtensor_input" (the input a DTensor placed Replicate(), its gradient Partial).
# The fused cross entropy's reduction × API × bias grid.
FLCE_GRID: dict[str, tuple[str, str, bool, dict]] = {
    f"flce-{reduction}-{api}{'-bias' if bias else ''}": ("flce", api, bias, dict(reduction=reduction))
    for reduction in ("mean", "sum", "none") for api in ("group", "dtensor") for bias in (False, True)
}
CASES: dict[str, tuple[str, str, bool, dict]] = {
    **FLCE_GRID,
    **{
        f"flce-options-{reduction}": ("flce", "group", True, dict(reduction=reduction, return_z_loss=True, **ALL_OPTIONS))
        for reduction in ("mean", "none")
    },
    "flce-dtensor_input": ("flce", "dtensor_input", True, dict(reduction="mean", label_smoothing=0.1)),
    "logprobs-group": ("logprobs", "group", True, dict(LOGPROB_OPTIONS)),
    "logprobs-plain-group": ("logprobs", "group", False, {}),
    "logprobs-dtensor": ("logprobs", "dtensor", True, dict(LOGPROB_OPTIONS)),
    "logprobs-dtensor_input": ("logprobs", "dtensor_input", False, {}),
    # grad_in_forward: kept (a mean of the log-probs, SFT's NLL), then broken by a gradient that
    # differs between tokens or one that reaches the entropy (backward recomputes).
    "logprobs-sft-group": ("logprobs_sft", "group", True, dict(grad_in_forward=True)),
    "logprobs-sft-dtensor": ("logprobs_sft", "dtensor", False, dict(LOGPROB_OPTIONS, grad_in_forward=True)),
    "logprobs-sft_broken-group": ("logprobs_weighted", "group", True, dict(grad_in_forward=True)),
    "logprobs-sft_entropy-dtensor": ("logprobs", "dtensor", True, dict(grad_in_forward=True)),
    # TRL's fused head as tigon.trl serves it, on a tensor-parallel model's DTensor lm_head.
    "trl_head-dtensor": ("trl_head", "dtensor", False, dict(LOGPROB_OPTIONS)),
    "grpo-dapo-kl-group": ("grpo", "group", True, dict(loss_type="dapo", beta=0.1, temperature=0.9)),
    "grpo-gspo-dtensor": ("grpo", "dtensor", True, dict(loss_type="grpo", importance_sampling_level="sequence",
                                                         chunk_rows=26)),
    "grpo-gspo-two_pass-group": ("grpo", "group", False, dict(loss_type="grpo", importance_sampling_level="sequence")),
    "grpo-vespo-dtensor_input": ("grpo", "dtensor_input", False, dict(loss_type="vespo", beta=0.05)),
}

# On 4 ranks, FLCE_GRID is run in two of its cases (2 ranks run it all): the rest of it goes
# through the same code, split in two shards instead of four. Every other case runs on both.
FLCE_GRID_ON_FOUR_RANKS = ("flce-mean-group-bias", "flce-none-dtensor")


def cases_for(world_size: int) -> list[str]:
    """The names of the cases run on ``world_size`` ranks."""
    return [name for name in CASES if world_size == 2 or name not in FLCE_GRID or name in FLCE_GRID_ON_FOUR_RANKS]


def problem(bias: bool, seed: int = 0):
    """``(input, weight, bias, target, upstream)``: fp32 ``input [3, 13, H]``, ``weight [V, H]``,
    ``bias [V]`` (or ``None``), ``target`` with every IGNORE_EVERY-th token ignored (-100), and
    ``upstream``: fp32 gradients for the per-token outputs (``[3, 13]`` each: the loss of
    ``"none"``, the log-probs, the entropy)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*N_TOKENS, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * HIDDEN**-0.5 * 2.0
    b = torch.randn(VOCAB, generator=generator) if bias else None
    target = torch.randint(0, VOCAB, N_TOKENS, generator=generator)
    target.view(-1)[::IGNORE_EVERY] = -100
    upstream = torch.randn(2, *N_TOKENS, generator=generator)
    return x, weight, b, target, upstream


def grpo_constants(bias: bool, temperature: float) -> dict:
    """The GRPO loss's other inputs for :func:`problem`'s head: the completions' mask (the tokens
    not ignored) and ids, one advantage per completion, old and reference log-probs near the
    policy's (fp32)."""
    x, weight, b, target, _ = problem(bias)
    generator = torch.Generator().manual_seed(1)
    mask = target != -100
    with torch.no_grad():
        logps = reference.fused_linear_logprobs(
            x.double(), weight.double(), target, None if b is None else b.double(), temperature=temperature,
        )[0]
    return {
        "completion_ids": torch.where(mask, target, 0), "completion_mask": mask,
        "advantages": torch.tensor([1.0, -0.7, 0.4]),
        "old_per_token_logps": (logps - 0.3 * torch.randn(logps.shape, generator=generator, dtype=logps.dtype)).float(),
        "ref_per_token_logps": (logps + 0.2 * torch.randn(logps.shape, generator=generator, dtype=logps.dtype)).float(),
    }


def grpo_outputs(loss: torch.Tensor, metrics: dict) -> tuple:
    """The loss and the metrics in the order of their names."""
    return (loss, *(metrics[name] for name in sorted(metrics)))


def loss_to_backward(kind: str, options: dict, outputs, upstream: torch.Tensor) -> torch.Tensor:
    """The scalar whose backward the case checks, from the op's ``outputs``."""
    if kind == "grpo":
        return outputs[0] * 0.75
    if kind == "logprobs_sft":
        return outputs[0].sum() * 0.5
    if kind == "logprobs_weighted":
        return (outputs[0] * upstream[0]).sum()
    if kind in ("logprobs", "trl_head"):
        log_probs, entropy = outputs[:2]
        return (log_probs * upstream[0]).sum() + (entropy * upstream[1]).sum()
    loss = outputs[0] if options.get("return_z_loss") else outputs
    return (loss * upstream[0]).sum() if options["reduction"] == "none" else loss * 0.75


def call(kind: str, x, weight, b, target, options: dict, **extra):
    if kind == "grpo":
        constants = grpo_constants(b is not None, options.get("temperature", 1.0))
        ids = constants.pop("completion_ids")
        if hasattr(target, "full_tensor"):  # a DTensor: the ids placed as it
            ids = type(target).from_local(ids, target.device_mesh, target.placements)
        return grpo_outputs(*fused_linear_grpo(x, weight, ids, advantages=constants.pop("advantages"), bias=b,
                                               **constants, **options, **extra))
    if kind == "flce":
        return tf.fused_linear_cross_entropy(x, weight, target, b, **options, **extra)
    if kind == "trl_head":
        from tigon.trl import TigonLogProbHead

        TigonLogProbHead.grad_in_forward = True  # as patch_trl leaves it
        return TigonLogProbHead.apply(
            x, weight, b, target, options.get("temperature", 1.0), 0, options.get("softcap"),
            options.get("logit_scale", 1.0), FIELDS,
        )
    return tf.fused_linear_logprobs(x, weight, target, b, outputs=FIELDS, **options, **extra)


def shard_rows(world_size: int, rank: int, api: str) -> slice:
    if api == "group":
        sizes = GROUP_SPLITS[world_size]
    else:
        sizes = [len(chunk) for chunk in torch.arange(VOCAB).chunk(world_size)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def run_case(kind, api, bias, options, rank, world_size, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x, weight, b, target, upstream = problem(bias)
    rows = shard_rows(world_size, rank, api)
    chunk_memory_bytes = CHUNK_ROWS * max(rows.stop - rows.start for rows in (
        shard_rows(world_size, r, api) for r in range(world_size))) * 4
    options = dict(options)
    options["chunk_memory_bytes"] = options.pop("chunk_rows", CHUNK_ROWS) * chunk_memory_bytes // CHUNK_ROWS
    if api == "group":
        weight_shard = weight[rows].clone().requires_grad_()
        bias_shard = None if b is None else b[rows].clone().requires_grad_()
        x.requires_grad_()
        outputs = call(kind, x, weight_shard, bias_shard, target, options, process_group=dist.group.WORLD)

        def grads():
            return x.grad, weight_shard.grad, None if bias_shard is None else bias_shard.grad

    else:
        weight_d = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
        bias_d = None if b is None else distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
        x_in = distribute_tensor(x, mesh, [Replicate()]).requires_grad_() if api == "dtensor_input" else x.requires_grad_()
        target_in = distribute_tensor(target, mesh, [Replicate()]) if api == "dtensor_input" else target
        outputs = call(kind, x_in, weight_d, bias_d, target_in, options)

        def grads():
            # A DTensor input's gradient is Partial: the whole gradient is its sum over the ranks.
            grad_input = x_in.grad.full_tensor() if api == "dtensor_input" else x_in.grad
            assert weight_d.grad.placements == (Shard(0),)
            return grad_input, weight_d.grad.to_local(), None if bias_d is None else bias_d.grad.to_local()

    loss_to_backward(kind, options, outputs, upstream).backward()
    detached = [None if out is None else out.detach() for out in (outputs if isinstance(outputs, tuple) else (outputs,))]
    return {"outputs": detached, "grads": [None if g is None else g.detach().clone() for g in grads()]}


def bad_calls(world_size, mesh):
    """name → a call that must raise."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x, weight, b, target, _ = problem(True)
    weight_d = distribute_tensor(weight, mesh, [Shard(0)])
    return {
        "weight_shard1": lambda: tf.fused_linear_cross_entropy(
            x, distribute_tensor(weight, mesh, [Shard(1)]), target),
        "weight_replicate": lambda: tf.fused_linear_logprobs(
            x, distribute_tensor(weight, mesh, [Replicate()]), target),
        "bias_plain": lambda: tf.fused_linear_cross_entropy(x, weight_d, target, b),
        "bias_replicate": lambda: tf.fused_linear_cross_entropy(
            x, weight_d, target, distribute_tensor(b, mesh, [Replicate()])),
        "input_shard": lambda: tf.fused_linear_cross_entropy(
            distribute_tensor(x, mesh, [Shard(0)]), weight_d, target),
        "group_and_dtensor": lambda: tf.fused_linear_cross_entropy(
            x, weight_d, target, process_group=dist.group.WORLD),
        "dtensor_input_plain_weight": lambda: tf.fused_linear_cross_entropy(
            distribute_tensor(x, mesh, [Replicate()]), weight, target),
        # Rank 0 holds one token fewer than the others: every rank must raise.
        "tokens_differ": lambda: tf.fused_linear_cross_entropy(
            x.view(-1, HIDDEN)[: 38 if dist.get_rank() == 0 else 39],
            weight[shard_rows(world_size, dist.get_rank(), "dtensor")],
            target.view(-1)[: 38 if dist.get_rank() == 0 else 39], process_group=dist.group.WORLD),
    }


def main(rank: int, world_size: int, init_file: str, out_dir: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    results = {name: run_case(*CASES[name], rank, world_size, mesh) for name in cases_for(world_size)}
    errors = {}
    for name, bad in bad_calls(world_size, mesh).items():
        try:
            bad()
        except (TypeError, ValueError) as error:
            errors[name] = (type(error).__name__, str(error))
        else:
            errors[name] = None
    torch.save({"cases": results, "errors": errors}, out_dir / f"rank{rank}.pt")
    # The mesh holds the group: a gloo group first freed at interpreter exit aborts the process.
    del mesh
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
