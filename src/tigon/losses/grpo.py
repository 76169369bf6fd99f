"""The GRPO family of RL losses from hidden states and the LM head, without the logits.

Inputs are a batch of ``B`` completions of ``T`` tokens: ``input [B, T, H]``, the policy's last
hidden states at the positions that predict each completion token, ``weight [V, H]`` (and
``bias [V]``), ``completion_ids [B, T]``, ``completion_mask [B, T]`` (1 for a real completion
token) and one ``advantage`` per completion. With ``logp`` the policy's log-prob of each token at
``temperature``, ``old`` the sampling policy's (``None``: on-policy, ``old = logp`` detached, so the
ratio is 1 and its gradient is the policy gradient) and ``ref`` a reference model's, the formulas
are those of TRL 1.16's ``GRPOTrainer`` for one process (TRL's optional top-entropy mask,
off-policy mask and vLLM importance-sampling correction are not part of it)::

    ratio r   = exp(logp − old)                          importance_sampling_level="token"
              = exp(Σ_t m·(logp − old) / Σ_t m)          "sequence" (GSPO): one per completion
    grpo, bnpo, dr_grpo, dapo, luspo:
              ℓ = −min(min(r, δ)·A, clip(r, 1 − ε_low, 1 + ε_high)·A)     (min(r, δ) only with delta)
    cispo:    ℓ = −sg(min(r, ε_high))·A·logp                              (sg: no gradient)
    sapo:     ℓ = −4/τ·σ(τ·(r − 1))·A,  τ = τ_pos if A > 0 else τ_neg
    vespo:    ℓ = −sg(φ(w))·A·logp,  φ(w) = e^λ·w^k·e^(−λw) of the completion's ratio
              w = exp Σ_t m·clamp(logp − old, ±20) (clamped to [1e-8, e^20]); k, λ by the sign of A
    + β·(exp(ref − logp) − (ref − logp) − 1)                             (the k3 KL, β > 0)

and the per-token losses ``ℓ`` are reduced over the masked tokens by the loss type: ``grpo`` and
``sapo`` average each completion's tokens, then the completions; ``bnpo`` divides the sum by the
batch's active tokens; ``dr_grpo`` by ``B · max_completion_length``; ``dapo`` and ``cispo`` by
``num_items_in_batch`` when given (the active tokens of the whole step, across micro-batches and
processes, as the caller counts them), else by the batch's active tokens, as does ``vespo``;
``luspo`` sums each completion's tokens and averages the completions. Every token count is
clamped to at least 1, as TRL's are: a completion (or batch) without active tokens gives 0, not
NaN.

The per-token log-probs and the gradients come from the chunk loop of
:mod:`tigon.ops.fused_linear_logprobs` (gradients computed in the forward pass, ``6·N·H·V``
FLOPs): no ``[B·T, V]`` logits exist, only one chunk's, within ``chunk_memory_bytes`` whatever
the completions' length. At ``importance_sampling_level="token"`` every loss type but vespo has a
per-token ``ℓ`` that reads only that token's log-prob and constants (its old and reference
log-probs, its completion's advantage, the mask's token counts of the reduction): chunks are rows
of the ``B·T`` tokens and split completions. GSPO's ratio and vespo's φ(w) read a whole
completion's log-probs: chunks of whole completions, and for completions longer than the budget
two passes, the log-probs of every token first, then the gradients, recomputing all chunks' logits
but the last (``8·N·H·V`` FLOPs at most).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from tigon._checks import (
    INDEX_DTYPES,
    check_choice,
    check_constant,
    check_head,
    check_input_weight_order,
    check_numbers,
    check_same_device,
    check_shape,
    check_tensor,
    vocab_sharded_head,
)
from tigon.losses._module import KeywordTailLoss
from tigon.ops.fp8 import RecipeName as Fp8Recipe
from tigon.ops.fp8 import check_recipe
from tigon.ops.fused_linear_logprobs import fused_linear_logprob_loss
from tigon.ops.vocab_parallel import vocab_shard

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["LOSS_TYPES", "FusedLinearGRPOLoss", "fused_linear_grpo"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class GRPOOptions:
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    max_completion_length: int | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def check(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, ("token", "sequence"))
        for name in ("beta", "epsilon_low", "epsilon_high"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.delta is not None and not self.delta > 0.0:
            raise ValueError(f"delta must be None or > 0, got {self.delta!r}")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.max_completion_length is not None and not self.max_completion_length > 0:
            raise ValueError(f"max_completion_length must be None or > 0, got {self.max_completion_length!r}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def importance_ratio(logps: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``[k, T]`` per-token ratios, or ``[k, 1]`` per completion for ``level="sequence"``."""
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return log_ratio.exp()


def vespo_weights(
    logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, options: GRPOOptions,
) -> torch.Tensor:
    """``[k, 1]`` φ(w) of each completion (constants: no gradient); ``advantages`` is ``[k, 1]``."""
    log_ratio = (logps - old).detach().clamp(-20.0, 20.0)
    log_w = (log_ratio * mask).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, options.vespo_k_pos, options.vespo_k_neg)
    lam = torch.where(nonnegative, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def per_token_losses(
    logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
    options: GRPOOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ℓ`` of the module docstring for ``[k, T]`` log-probs (``[k, 1]`` at sequence level
    without KL), and the ratio ``r`` the clip metrics read (φ(w) for vespo)."""
    ratio = importance_ratio(logps, old, mask, options.importance_sampling_level)
    advantages = advantages.unsqueeze(-1)
    if options.loss_type == "vespo":
        ratio = vespo_weights(logps, old, advantages, mask, options)
        losses = -ratio * advantages * logps
    elif options.loss_type == "cispo":
        losses = -ratio.clamp(max=options.epsilon_high).detach() * advantages * logps
    elif options.loss_type == "sapo":
        tau = torch.where(advantages > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
        losses = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages
    else:
        clipped = ratio.clamp(1.0 - options.epsilon_low, 1.0 + options.epsilon_high)
        if options.delta is not None:
            ratio = ratio.clamp(max=options.delta)
        losses = -torch.minimum(ratio * advantages, clipped * advantages)
    if options.beta != 0.0:
        assert ref is not None, "_check_args requires ref_per_token_logps where beta != 0"
        losses = losses + options.beta * k3_kl(logps, ref)
    return losses, ratio


def k3_kl(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return torch.exp(ref - logps) - (ref - logps) - 1.0


def token_weights(mask: torch.Tensor, options: GRPOOptions, num_items_in_batch: int | torch.Tensor | None) -> torch.Tensor:
    """``[B, T]`` weights such that the loss is ``Σ ℓ · weights`` (the reduction of the loss type)."""
    n_completions, seq_len = mask.shape
    if options.loss_type in ("grpo", "sapo"):
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / n_completions
    if options.loss_type == "luspo":
        return mask / n_completions
    if options.loss_type == "dr_grpo":
        return mask / (n_completions * (options.max_completion_length or seq_len))
    if options.loss_type in ("dapo", "cispo", "vespo") and num_items_in_batch is not None:
        return mask / torch.as_tensor(num_items_in_batch, dtype=mask.dtype, device=mask.device).clamp(min=1.0)
    return mask / mask.sum().clamp(min=1.0)


def splits_completions(options: GRPOOptions) -> bool:
    """Whether chunks may split a completion: at the token level each token's ``ℓ`` reads only its
    own log-prob and constants known before the chunk loop (its old and reference log-probs, its
    completion's advantage; :func:`token_weights` counts tokens from the mask alone). GSPO's ratio
    and VESPO's φ(w) (at either level) read the whole completion's log-probs."""
    return options.importance_sampling_level == "token" and options.loss_type != "vespo"


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, per_completion: bool = False) -> torch.Tensor:
    """Mean over the active tokens, or over the completions for per-completion values."""
    if per_completion:
        return values.mean()
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _metrics(
    logps: torch.Tensor, entropy: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, advantages: torch.Tensor,
    mask: torch.Tensor, options: GRPOOptions,
) -> dict[str, torch.Tensor]:
    """TRL's logged metrics, from the detached per-token values."""
    metrics = {"entropy": _masked_mean(entropy, mask)}
    ratio = per_token_losses(logps, old, ref, advantages, mask, options)[1]
    advantages = advantages.unsqueeze(-1)
    if options.beta != 0.0:
        assert ref is not None, "_check_args requires ref_per_token_logps where beta != 0"
        metrics["kl"] = _masked_mean(k3_kl(logps, ref), mask)
    per_completion = options.importance_sampling_level == "sequence"
    if options.loss_type in CLIPPED_TYPES:
        low = (ratio < 1.0 - options.epsilon_low) & (advantages < 0)
        high = (ratio > 1.0 + options.epsilon_high) & (advantages > 0)
        metrics["clip_ratio_low"] = _masked_mean(low.double(), mask, per_completion)
        metrics["clip_ratio_high"] = _masked_mean(high.double(), mask, per_completion)
        metrics["clip_ratio_region"] = _masked_mean((low | high).double(), mask, per_completion)
    elif options.loss_type == "cispo":
        clipped = (ratio > options.epsilon_high) & (advantages > 0)
        metrics["cispo_clip_ratio"] = _masked_mean(clipped.double(), mask, per_completion)
    elif options.loss_type == "vespo":
        metrics["vespo_phi_seq_mean"] = ratio.mean()
    return {name: value.float() for name, value in metrics.items()}


def _check_args(
    input: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
    advantages: torch.Tensor, bias: torch.Tensor | None, old_per_token_logps: torch.Tensor | None,
    ref_per_token_logps: torch.Tensor | None, num_items_in_batch: int | torch.Tensor | None, options: GRPOOptions,
) -> None:
    options.check()
    check_input_weight_order(input, weight, "completion_ids", completion_ids)
    check_head("", input, weight, bias, input_dim=3)
    completions = tuple(input.shape[:2])
    check_tensor("completion_ids", completion_ids, dtypes=INDEX_DTYPES, dim=2)
    check_shape("completion_ids", completion_ids, completions, "the completions and tokens of input")
    check_tensor("completion_mask", completion_mask, dtypes=(torch.bool, *INDEX_DTYPES, torch.float32), dim=2)
    check_shape("completion_mask", completion_mask, completions, "the completions and tokens of input")
    check_tensor("advantages", advantages, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16), dim=1)
    check_shape("advantages", advantages, completions[:1], "one per completion")
    for name, logps in (("old_per_token_logps", old_per_token_logps), ("ref_per_token_logps", ref_per_token_logps)):
        if logps is not None:
            check_tensor(name, logps, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16), dim=2)
            check_shape(name, logps, completions, "the completions and tokens of input")
    # Constants of the loss, as in TRL (computed without grad): a gradient asked of them is refused.
    for name, value, why in (
        ("completion_mask", completion_mask, "the mask selects tokens and is not differentiated"),
        ("advantages", advantages, "advantages are constants of the policy-gradient loss"),
        ("old_per_token_logps", old_per_token_logps, "the sampling policy's log-probs are constants of the ratio"),
        ("ref_per_token_logps", ref_per_token_logps, "the reference model's log-probs are constants of the KL"),
        ("num_items_in_batch", num_items_in_batch, "it is a count of tokens"),
    ):
        check_constant(name, value, why)
    if options.beta != 0.0 and ref_per_token_logps is None:
        raise ValueError(f"beta = {options.beta} weights a KL to the reference model: ref_per_token_logps is required")
    check_same_device(
        input=input, weight=weight, completion_ids=completion_ids, completion_mask=completion_mask,
        advantages=advantages, bias=bias, old_per_token_logps=old_per_token_logps,
        ref_per_token_logps=ref_per_token_logps,
    )


def fused_linear_grpo(
    input: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
    advantages: torch.Tensor, *, bias: torch.Tensor | None = None, old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None, num_items_in_batch: int | torch.Tensor | None = None,
    beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.2, delta: float | None = None,
    loss_type: LossType = "dapo", importance_sampling_level: ImportanceSamplingLevel = "token",
    temperature: float = 1.0, max_completion_length: int | None = None, sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0, chunk_memory_bytes: int | None = None,
    process_group: ProcessGroup | None = None, fp8: Fp8Recipe | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-family loss of the module docstring → ``(loss, metrics)``.

    Everything after ``advantages`` is keyword-only: ``old_per_token_logps`` and
    ``ref_per_token_logps`` have one shape, and Liger's loss takes them in the other order, so a
    positional swap would silently give another loss.

    Args:
        input: ``[B, T, H]``; weight: ``[V, H]``; bias: ``[V]`` or ``None``; one float dtype.
        completion_ids: ``[B, T]`` int64/int32, in ``[0, V)`` where ``completion_mask`` is set
            (checked once the kernels are queued, as :func:`tigon.functional.cross_entropy`'s
            targets; the masked-out positions may hold anything).
        completion_mask: ``[B, T]`` bool or 0/1.
        advantages: ``[B]``. old_per_token_logps, ref_per_token_logps: ``[B, T]`` or ``None``.
        num_items_in_batch: the step's active tokens for ``dapo``/``cispo`` (int or tensor), or ``None``.
        chunk_memory_bytes: logits memory per chunk (default 512 MiB, see
            :func:`tigon.ops.fused_linear.chunk_rows_for`), for completions of any length.
        process_group: ``weight`` (and ``bias``) this rank's shard of an LM head sharded along the
            vocabulary, as in :func:`tigon.functional.fused_linear_cross_entropy`, which also takes
            ``weight`` as a DTensor placed ``(Shard(0),)`` (and ``input`` and ``completion_ids``
            as DTensors placed ``Replicate()``). Every rank gets the whole loss and metrics.
        fp8: the head's matmuls in FP8 by a torchao recipe, as in
            :func:`tigon.functional.fused_linear_cross_entropy` (not with ``process_group``).
    The mask, advantages, old and reference log-probs, ``num_items_in_batch`` and the options are
    constants of the loss: given as tensors that require grad (with grad mode on), they are refused.
    Returns: the fp32 scalar loss, and a dict of detached fp32 scalars: ``entropy`` (mean over
        the active tokens), ``kl`` (with ``beta``), ``clip_ratio_low``, ``clip_ratio_high`` and
        ``clip_ratio_region`` (clipped loss types), ``cispo_clip_ratio`` or ``vespo_phi_seq_mean``,
        as TRL logs them.
    """
    numbers: dict[str, Any] = dict(
        beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, temperature=temperature,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
    )
    check_numbers(**numbers)
    as_floats: dict[str, Any] = {name: None if value is None else float(value) for name, value in numbers.items()}
    options = GRPOOptions(
        loss_type=loss_type, importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length, **as_floats,
    )
    sharded = vocab_sharded_head(input, weight, bias, completion_ids, process_group, "completion_ids")
    if sharded is not None:
        input, weight, bias, completion_ids, group, reduce_grad_input = sharded
    _check_args(input, weight, completion_ids, completion_mask, advantages, bias, old_per_token_logps,
                ref_per_token_logps, num_items_in_batch, options)
    check_recipe(fp8, weight.shape)
    if fp8 is not None and sharded is not None:
        raise ValueError(f"fp8={fp8!r} with a vocabulary-sharded head: not supported; pass fp8=None")
    shard = None if sharded is None else vocab_shard(weight, completion_ids.numel(), group, reduce_grad_input)
    mask = completion_mask.bool()
    target = torch.where(mask, completion_ids, IGNORE_INDEX)
    ids = torch.where(mask, completion_ids, 0)
    # The per-token constants contiguous, so that a chunk's tokens are a view of them.
    mask = mask.double().contiguous()
    weights = token_weights(mask, options, num_items_in_batch)
    advantages64 = advantages.detach().double()
    old = None if old_per_token_logps is None else old_per_token_logps.detach().double().contiguous()
    ref = None if ref_per_token_logps is None else ref_per_token_logps.detach().double().contiguous()
    seq_len = mask.shape[1]
    token_advantages = advantages64.unsqueeze(-1).expand(-1, seq_len).contiguous()
    split = splits_completions(options)
    # A chunk's tokens, rows of the flattened [B·T] tokens, are viewed as [k, L]: L = 1 when chunks
    # may split a completion (each token's loss is then that of a one-token completion), else k
    # whole completions of L = T tokens.
    tokens_per_row = 1 if split else seq_len

    def chunk_tokens(values: torch.Tensor, rows: slice) -> torch.Tensor:
        """The tokens ``rows`` of ``values [B, T]`` as ``[k, L]``."""
        return values.view(-1)[rows].view(-1, tokens_per_row)

    def loss_share(rows: slice, logps: torch.Tensor) -> torch.Tensor:
        logps = logps.view(-1, tokens_per_row)
        chunk_old = logps.detach() if old is None else chunk_tokens(old, rows)
        chunk_ref = None if ref is None else chunk_tokens(ref, rows)
        losses = per_token_losses(logps, chunk_old, chunk_ref, chunk_tokens(token_advantages, rows)[:, 0],
                                  chunk_tokens(mask, rows), options)[0]
        return (losses * chunk_tokens(weights, rows)).sum()

    loss, log_probs, entropy = fused_linear_logprob_loss(
        input, weight, target, bias, loss_share, split, IGNORE_INDEX, options.temperature, chunk_memory_bytes,
        ids=("completion_ids", ids), shard=shard, fp8=fp8,
    )
    logps = log_probs.double()
    metrics = _metrics(logps, entropy.double(), logps if old is None else old, ref, advantages64, mask, options)
    return loss, metrics


class FusedLinearGRPOLoss(KeywordTailLoss):
    """:func:`fused_linear_grpo` with its options fixed: ``loss, metrics = loss_fn(input, weight,
    completion_ids, completion_mask, advantages, bias=..., old_per_token_logps=...,
    ref_per_token_logps=..., num_items_in_batch=...)``, everything after ``advantages``
    keyword-only, as the options of the constructor."""

    def __init__(
        self, *, beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.2, delta: float | None = None,
        loss_type: LossType = "dapo", importance_sampling_level: ImportanceSamplingLevel = "token",
        temperature: float = 1.0, max_completion_length: int | None = None, sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0, chunk_memory_bytes: int | None = None,
        fp8: Fp8Recipe | None = None,
    ) -> None:
        super().__init__()
        self.options: dict[str, Any] = dict(
            beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, loss_type=loss_type,
            importance_sampling_level=importance_sampling_level, temperature=temperature,
            max_completion_length=max_completion_length, sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
            vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg, chunk_memory_bytes=chunk_memory_bytes,
            fp8=fp8,
        )
        GRPOOptions(**{k: v for k, v in self.options.items() if k not in ("chunk_memory_bytes", "fp8")}).check()

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
        advantages: torch.Tensor, *, bias: torch.Tensor | None = None, old_per_token_logps: torch.Tensor | None = None,
        ref_per_token_logps: torch.Tensor | None = None, num_items_in_batch: int | torch.Tensor | None = None,
        process_group: ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return fused_linear_grpo(
            input, weight, completion_ids, completion_mask, advantages, bias=bias,
            old_per_token_logps=old_per_token_logps, ref_per_token_logps=ref_per_token_logps,
            num_items_in_batch=num_items_in_batch, process_group=process_group, **self.options,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())
