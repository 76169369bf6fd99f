"""Preference losses from hidden states and the LM head, without building any model's logits.

Every loss here takes ``input [S, T, H]`` (the policy's last hidden states), the head ``weight
[V, H]`` (and ``bias [V]``), ``target [S, T]`` already aligned with ``input`` (no shift inside;
``ignore_index`` masks the prompt and the padding) and, optionally, the reference model's hidden
states and head. A sequence's log-probability ``logp`` is the sum over its unmasked tokens of
``log softmax(x @ Wᵀ + b)[target]``; ``avg_logp`` divides it by the number of those tokens (0 for
a sequence without any, as TRL's ``DPOTrainer`` clamps that count to 1; ``nll`` likewise is 0
when no chosen token is counted, where a plain cross entropy's mean would be NaN: one empty
completion then does not make the whole step NaN). Without a reference model the reference
log-probabilities are 0.

Paired losses (DPO, CPO, SimPO, ORPO) take ``S = 2B`` sequences: the ``B`` chosen ones first,
then the ``B`` rejected ones, pair ``i`` being sequences ``i`` and ``B + i``. Their loss is a
mean over pairs; ``nll`` is the cross entropy of the chosen tokens averaged over those tokens.
The formulas are those of TRL's trainers, as each docstring writes; ``σ`` is the sigmoid.

The optional tensors (``bias``, the reference's ``ref_input``, ``ref_weight``, ``ref_bias``,
KTO's ``kl``) and the options are keyword-only: ``bias`` and ``ref_bias`` share a shape, so a
positional mix-up would go unnoticed. Each call returns ``(loss, metrics)``: the fp32 scalar loss
and a dict of detached fp32 tensors, per pair (or per sequence for KTO). Gradients flow to
``input``, ``weight`` and ``bias``; the reference's tensors, KTO's ``kl`` and the options
(``beta``...) are constants: given as tensors that require grad, they are refused rather than
silently left without a gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tigon._checks import (
    INDEX_DTYPES,
    check_constant,
    check_head,
    check_input_weight_order,
    check_numbers,
    check_same_device,
    check_shape,
    check_tensor,
)
from tigon.losses._module import KeywordTailLoss
from tigon.ops.fused_linear_preference import SequenceLoss, fused_linear_preference, sequence_logps

# (loss, metrics): the fp32 scalar loss and detached fp32 metrics.
PreferenceResult = tuple[torch.Tensor, dict[str, torch.Tensor]]

__all__ = [
    "fused_linear_dpo",
    "fused_linear_cpo",
    "fused_linear_simpo",
    "fused_linear_orpo",
    "fused_linear_kto",
    "fused_linear_sequence_logps",
    "FusedLinearDPOLoss",
    "FusedLinearCPOLoss",
    "FusedLinearSimPOLoss",
    "FusedLinearORPOLoss",
    "FusedLinearKTOLoss",
]


def _check_args(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ref_input: torch.Tensor | None, ref_weight: torch.Tensor | None, ref_bias: torch.Tensor | None, paired: bool,
    ignore_index: int,
) -> None:
    check_input_weight_order(input, weight, "target", target)
    check_head("", input, weight, bias, input_dim=3)
    check_tensor("target", target, dtypes=INDEX_DTYPES, dim=2)
    check_shape("target", target, tuple(input.shape[:2]), "the sequences and tokens of input")
    if paired and input.shape[0] % 2:
        raise ValueError(
            f"input has {input.shape[0]} sequences; a paired loss needs an even number, "
            "the B chosen sequences followed by the B rejected ones"
        )
    if (ref_input is None) != (ref_weight is None):
        raise ValueError("ref_input and ref_weight must be given together (or neither, for reference log-probs of 0)")
    if ref_input is None and ref_bias is not None:
        raise ValueError("ref_bias was given without ref_input and ref_weight")
    if ref_input is not None and ref_weight is not None:
        check_head("ref_", ref_input, ref_weight, ref_bias, input_dim=3)
        for name, tensor in (("ref_input", ref_input), ("ref_weight", ref_weight), ("ref_bias", ref_bias)):
            check_constant(name, tensor, "the reference model is fixed: its log-probs are constants of the loss")
        if ref_input.shape[:2] != input.shape[:2]:
            raise ValueError(
                f"ref_input must have shape {tuple(input.shape[:2]) + (ref_input.shape[-1],)} (the sequences and "
                f"tokens of input), got {tuple(ref_input.shape)}"
            )
        if ref_weight.shape[0] != weight.shape[0]:
            raise ValueError(
                f"ref_weight has {ref_weight.shape[0]} rows (vocabulary) but weight has {weight.shape[0]}"
            )
    check_same_device(
        input=input, weight=weight, target=target, bias=bias, ref_input=ref_input, ref_weight=ref_weight,
        ref_bias=ref_bias,
    )
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def _n_tokens(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[S]`` fp32: each sequence's unmasked tokens."""
    return (target != ignore_index).sum(1, dtype=torch.float32)


def _pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's values in chunk order (its chosen sequences, then their rejected partners)."""
    chosen, rejected = values.view(2, -1)
    return chosen, rejected


def _smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``−(1 − ε)·log σ(x) − ε·log σ(−x)``: the preference is flipped with probability ε."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def _check_no_reference(
    loss_name: str, ref_input: torch.Tensor | None, ref_weight: torch.Tensor | None, ref_bias: torch.Tensor | None,
) -> None:
    if any(t is not None for t in (ref_input, ref_weight, ref_bias)):
        raise ValueError(f"{loss_name} uses no reference model; got ref_input, ref_weight or ref_bias")


# Opaque to torch.compile: the chunk loop calls back into Python between kernels.
@torch.compiler.disable
def _run(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ref_input: torch.Tensor | None, ref_weight: torch.Tensor | None, ref_bias: torch.Tensor | None,
    sequence_loss: SequenceLoss, paired: bool, ignore_index: int, chunk_memory_bytes: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_linear_preference(
        input, weight, target, bias, ref_input, ref_weight, ref_bias, sequence_loss, paired, ignore_index,
        chunk_memory_bytes,
    )


def _pair_metrics(
    logps: torch.Tensor, ref_logps: torch.Tensor, beta: float, **extra: torch.Tensor,
) -> dict[str, torch.Tensor]:
    chosen, rejected = logps.view(2, -1)
    ref_chosen, ref_rejected = ref_logps.view(2, -1)
    chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    return {
        "chosen_logps": chosen, "rejected_logps": rejected,
        "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
        "reward_margins": chosen_rewards - rejected_rewards, **extra,
    }


def _nll_metric(logps: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The chosen tokens' mean cross entropy, from the summed log-probs."""
    n_pairs = logps.shape[0] // 2
    return -logps[:n_pairs].sum() / _n_tokens(target[:n_pairs], ignore_index).sum().clamp(min=1)


def fused_linear_dpo(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, bias: torch.Tensor | None = None,
    ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None,
    beta: float = 0.1, ignore_index: int = -100, compute_nll_loss: bool = False, chunk_memory_bytes: int | None = None,
) -> PreferenceResult:
    """Direct preference optimisation (sigmoid loss)::

        loss = mean_pairs −log σ(β·((logp_c − ref_c) − (logp_r − ref_r)))  (+ nll if compute_nll_loss)

    Metrics: ``chosen_logps``, ``rejected_logps``, ``chosen_rewards = β·(logp_c − ref_c)``,
    ``rejected_rewards``, ``reward_margins`` (and ``nll_loss``).
    """
    _check_args(input, weight, target, bias, ref_input, ref_weight, ref_bias, True, ignore_index)
    check_numbers(beta=beta)
    n_pairs = input.shape[0] // 2
    n_chosen_tokens = _n_tokens(target[:n_pairs], ignore_index).sum().clamp(min=1)

    def share(ids: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
        chosen, rejected = _pairs(logps)
        ref_chosen, ref_rejected = _pairs(ref_logps)
        loss = -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).sum() / n_pairs
        return loss - chosen.sum() / n_chosen_tokens if compute_nll_loss else loss

    loss, logps, ref_logps = _run(input, weight, target, bias, ref_input, ref_weight, ref_bias, share, True,
                                  ignore_index, chunk_memory_bytes)
    extra = {"nll_loss": _nll_metric(logps, target, ignore_index)} if compute_nll_loss else {}
    return loss, _pair_metrics(logps, ref_logps, beta, **extra)


def fused_linear_cpo(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, bias: torch.Tensor | None = None,
    ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None,
    beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0, ignore_index: int = -100,
    chunk_memory_bytes: int | None = None,
) -> PreferenceResult:
    """Contrastive preference optimisation (no reference model)::

        x    = β·(logp_c − logp_r)
        loss = mean_pairs [−(1 − ε)·log σ(x) − ε·log σ(−x)] + α·nll

    Metrics: ``chosen_logps``, ``rejected_logps``, ``chosen_rewards = β·logp_c``,
    ``rejected_rewards``, ``reward_margins``, ``nll_loss``.
    """
    _check_no_reference("CPO", ref_input, ref_weight, ref_bias)
    _check_args(input, weight, target, bias, None, None, None, True, ignore_index)
    check_numbers(beta=beta, alpha=alpha, label_smoothing=label_smoothing)
    n_pairs = input.shape[0] // 2
    n_chosen_tokens = _n_tokens(target[:n_pairs], ignore_index).sum().clamp(min=1)

    def share(ids: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
        chosen, rejected = _pairs(logps)
        loss = _smoothed_sigmoid_loss(beta * (chosen - rejected), label_smoothing).sum() / n_pairs
        return loss - alpha * chosen.sum() / n_chosen_tokens

    loss, logps, _ = _run(input, weight, target, bias, None, None, None, share, True, ignore_index,
                          chunk_memory_bytes)
    return loss, _pair_metrics(logps, torch.zeros_like(logps), beta,
                               nll_loss=_nll_metric(logps, target, ignore_index))


def fused_linear_simpo(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, bias: torch.Tensor | None = None,
    ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None,
    beta: float = 2.0, gamma: float = 0.5, label_smoothing: float = 0.0, ignore_index: int = -100,
    chunk_memory_bytes: int | None = None,
) -> PreferenceResult:
    """Simple preference optimisation, on length-averaged log-probs (no reference model)::

        x    = β·(avg_logp_c − avg_logp_r) − γ
        loss = mean_pairs [−(1 − ε)·log σ(x) − ε·log σ(−x)]

    Metrics: ``chosen_logps``, ``rejected_logps`` (averaged), ``chosen_rewards = β·avg_logp_c``,
    ``rejected_rewards``, ``reward_margins``.
    """
    _check_no_reference("SimPO", ref_input, ref_weight, ref_bias)
    _check_args(input, weight, target, bias, None, None, None, True, ignore_index)
    check_numbers(beta=beta, gamma=gamma, label_smoothing=label_smoothing)
    n_pairs = input.shape[0] // 2
    n_tokens = _n_tokens(target, ignore_index).clamp(min=1)

    def share(ids: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
        chosen, rejected = _pairs(logps / n_tokens[ids])
        return _smoothed_sigmoid_loss(beta * (chosen - rejected) - gamma, label_smoothing).sum() / n_pairs

    loss, logps, _ = _run(input, weight, target, bias, None, None, None, share, True, ignore_index,
                          chunk_memory_bytes)
    return loss, _pair_metrics(logps / n_tokens, torch.zeros_like(logps), beta)


def fused_linear_orpo(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, bias: torch.Tensor | None = None,
    ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None,
    beta: float = 0.1, ignore_index: int = -100, chunk_memory_bytes: int | None = None,
) -> PreferenceResult:
    """Odds-ratio preference optimisation, on length-averaged log-probs (no reference model)::

        log_odds = (a_c − a_r) − (log(1 − exp(a_c)) − log(1 − exp(a_r)))     a = avg_logp
        loss     = nll − β·mean_pairs log σ(log_odds)

    Metrics: ``chosen_logps``, ``rejected_logps`` (averaged), ``chosen_rewards = β·a_c``,
    ``rejected_rewards``, ``reward_margins``, ``log_odds_ratio`` (``log σ(log_odds)``),
    ``log_odds_chosen`` and ``nll_loss``.
    """
    _check_no_reference("ORPO", ref_input, ref_weight, ref_bias)
    _check_args(input, weight, target, bias, None, None, None, True, ignore_index)
    check_numbers(beta=beta)
    n_pairs = input.shape[0] // 2
    n_tokens = _n_tokens(target, ignore_index).clamp(min=1)
    n_chosen_tokens = n_tokens[:n_pairs].sum()

    def log_odds(average_logps: torch.Tensor) -> torch.Tensor:
        chosen, rejected = average_logps.view(2, -1)
        # log(1 − exp(a)) as log(−expm1(a)): exact for a near 0, where 1 − exp(a) cancels.
        return (chosen - rejected) - (torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected)))

    def share(ids: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
        nll = -_pairs(logps)[0].sum() / n_chosen_tokens
        return nll - beta * F.logsigmoid(log_odds(logps / n_tokens[ids])).sum() / n_pairs

    loss, logps, _ = _run(input, weight, target, bias, None, None, None, share, True, ignore_index,
                          chunk_memory_bytes)
    odds = log_odds(logps / n_tokens)
    return loss, _pair_metrics(
        logps / n_tokens, torch.zeros_like(logps), beta, log_odds_ratio=F.logsigmoid(odds), log_odds_chosen=odds,
        nll_loss=_nll_metric(logps, target, ignore_index),
    )


def fused_linear_kto(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, preference_labels: torch.Tensor, *,
    bias: torch.Tensor | None = None, ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    kl: torch.Tensor | float | None = None, beta: float = 0.1, desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0, ignore_index: int = -100, chunk_memory_bytes: int | None = None,
) -> PreferenceResult:
    """Kahneman-Tversky optimisation, unpaired: ``preference_labels [S]`` (bool) marks the
    desirable sequences. With ``r = logp − ref`` and the KL baseline ``z = kl`` (a constant scalar,
    refused if it requires grad; in TRL the clamped mean of ``logp − ref`` over mismatched
    prompt/completion pairs, for which :func:`fused_linear_sequence_logps` gives the log-probs; 0
    when ``None``)::

        loss = mean_sequences  w_d·(1 − σ(β·(r − z)))   desirable
                               w_u·(1 − σ(β·(z − r)))   undesirable

    Metrics (per sequence): ``logps``, ``rewards = β·r``, ``preference_labels`` and ``kl``.
    """
    _check_args(input, weight, target, bias, ref_input, ref_weight, ref_bias, False, ignore_index)
    check_tensor("preference_labels", preference_labels, dtypes=(torch.bool,), dim=1)
    check_shape("preference_labels", preference_labels, (input.shape[0],), "one per sequence of input")
    check_constant("kl", kl, "KTO's KL baseline is a constant of the loss (TRL computes it without grad)")
    check_numbers(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    n_sequences = input.shape[0]
    baseline = torch.zeros((), device=input.device) if kl is None else torch.as_tensor(kl, device=input.device)
    baseline = baseline.detach().float()
    if baseline.numel() != 1:
        raise ValueError(f"kl must be a scalar, got shape {tuple(baseline.shape)}")

    def share(ids: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
        rewards = beta * (logps - ref_logps)
        desirable = preference_labels[ids]
        losses = torch.where(
            desirable,
            desirable_weight * (1 - torch.sigmoid(rewards - beta * baseline)),
            undesirable_weight * (1 - torch.sigmoid(beta * baseline - rewards)),
        )
        return losses.sum() / n_sequences

    loss, logps, ref_logps = _run(input, weight, target, bias, ref_input, ref_weight, ref_bias, share, False,
                                  ignore_index, chunk_memory_bytes)
    return loss, {
        "logps": logps, "rewards": beta * (logps - ref_logps), "preference_labels": preference_labels,
        "kl": baseline,
    }


@torch.compiler.disable
def fused_linear_sequence_logps(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, bias: torch.Tensor | None = None,
    ignore_index: int = -100, chunk_memory_bytes: int | None = None,
) -> torch.Tensor:
    """``[S]`` fp32 summed log-probabilities of ``target [S, T]`` under ``input [S, T, H] @ weightᵀ
    (+ bias)``, chunked like the losses, for constants (reference models, KTO's KL baseline): the
    result does not require grad, and inputs that require grad (with grad mode on) are refused."""
    _check_args(input, weight, target, bias, None, None, None, False, ignore_index)
    for name, tensor in (("input", input), ("weight", weight), ("bias", bias)):
        check_constant(
            name, tensor, "fused_linear_sequence_logps computes constants (reference log-probs, KTO's KL baseline)",
            f"call it under torch.no_grad() or pass {name}.detach()",
        )
    with torch.no_grad():
        return sequence_logps(input, weight, target, bias, ignore_index, chunk_memory_bytes)


class _PreferenceLoss(KeywordTailLoss):
    """A module holding a loss's options."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())


class _PairedPreferenceLoss(_PreferenceLoss):
    """``forward`` calls the functional form ``loss_fn`` with the options."""

    loss_fn: Callable[..., PreferenceResult]

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, bias: torch.Tensor | None = None,
        ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
        ref_bias: torch.Tensor | None = None,
    ) -> PreferenceResult:
        return type(self).loss_fn(input, weight, target, bias=bias, ref_input=ref_input, ref_weight=ref_weight,
                                  ref_bias=ref_bias, **self.options)


class FusedLinearDPOLoss(_PairedPreferenceLoss):
    """:func:`fused_linear_dpo` as a module."""

    loss_fn = staticmethod(fused_linear_dpo)

    def __init__(
        self, *, beta: float = 0.1, ignore_index: int = -100, compute_nll_loss: bool = False,
        chunk_memory_bytes: int | None = None,
    ) -> None:
        super().__init__(beta=beta, ignore_index=ignore_index, compute_nll_loss=compute_nll_loss,
                         chunk_memory_bytes=chunk_memory_bytes)


class FusedLinearCPOLoss(_PairedPreferenceLoss):
    """:func:`fused_linear_cpo` as a module."""

    loss_fn = staticmethod(fused_linear_cpo)

    def __init__(
        self, *, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0, ignore_index: int = -100,
        chunk_memory_bytes: int | None = None,
    ) -> None:
        super().__init__(beta=beta, alpha=alpha, label_smoothing=label_smoothing, ignore_index=ignore_index,
                         chunk_memory_bytes=chunk_memory_bytes)


class FusedLinearSimPOLoss(_PairedPreferenceLoss):
    """:func:`fused_linear_simpo` as a module."""

    loss_fn = staticmethod(fused_linear_simpo)

    def __init__(
        self, *, beta: float = 2.0, gamma: float = 0.5, label_smoothing: float = 0.0, ignore_index: int = -100,
        chunk_memory_bytes: int | None = None,
    ) -> None:
        super().__init__(beta=beta, gamma=gamma, label_smoothing=label_smoothing, ignore_index=ignore_index,
                         chunk_memory_bytes=chunk_memory_bytes)


class FusedLinearORPOLoss(_PairedPreferenceLoss):
    """:func:`fused_linear_orpo` as a module."""

    loss_fn = staticmethod(fused_linear_orpo)

    def __init__(self, *, beta: float = 0.1, ignore_index: int = -100, chunk_memory_bytes: int | None = None) -> None:
        super().__init__(beta=beta, ignore_index=ignore_index, chunk_memory_bytes=chunk_memory_bytes)


class FusedLinearKTOLoss(_PreferenceLoss):
    """:func:`fused_linear_kto` as a module; ``forward`` also takes ``preference_labels`` and ``kl``."""

    def __init__(
        self, *, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
        ignore_index: int = -100, chunk_memory_bytes: int | None = None,
    ) -> None:
        super().__init__(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                         ignore_index=ignore_index, chunk_memory_bytes=chunk_memory_bytes)

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, preference_labels: torch.Tensor, *,
        bias: torch.Tensor | None = None, ref_input: torch.Tensor | None = None,
        ref_weight: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None,
        kl: torch.Tensor | float | None = None,
    ) -> PreferenceResult:
        return fused_linear_kto(input, weight, target, preference_labels, bias=bias, ref_input=ref_input,
                                ref_weight=ref_weight, ref_bias=ref_bias, kl=kl, **self.options)
