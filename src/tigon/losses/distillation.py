"""Distillation losses: divergences between a student's and a teacher's token distributions.

:func:`kl_div`, :func:`jsd` and :func:`tvd` take the two distributions row by row (``[..., V]``
log-probabilities or probabilities, as each says); :func:`fused_linear_jsd` takes both models'
last hidden states and heads and never builds either model's ``[N, V]`` logits. Every loss is
computed with fp32 math in one pass over memory, its gradient during the forward pass (see
:mod:`tigon.ops.divergence` and :mod:`tigon.ops.fused_linear_jsd` for the formulas and their
derivatives). The options (``reduction``, ``beta``...) are keyword-only, as PyTorch's
``kl_div``, whose third positional argument is the deprecated ``size_average``. ``labels``
(optional, ``[...]``) mask rows: a row whose label is ``ignore_index``
has no loss and no gradient, and means are over the other rows, 0 when there are none: TRL's GKD
loss, whose convention :func:`jsd` follows, clamps that divisor to 1 on purpose (a completion
truncated to nothing then trains nothing rather than making the step NaN), where a plain PyTorch
mean would be NaN. :func:`kl_div` is ``torch.nn.functional.kl_div``'s, NaN included: its
``"mean"`` and ``"batchmean"`` of an input without elements (or rows) are 0 / 0.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from tigon._checks import (
    INDEX_DTYPES,
    check_choice,
    check_constant,
    check_head,
    check_input_weight_order,
    check_numbers,
    check_positive,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from tigon.ops import divergence as _divergence
from tigon.ops import fused_linear_jsd as _fused_linear_jsd

__all__ = [
    "kl_div",
    "jsd",
    "tvd",
    "fused_linear_jsd",
    "KLDivLoss",
    "JSDLoss",
    "TVDLoss",
    "FusedLinearJSDLoss",
]

KL_REDUCTIONS = ("mean", "batchmean", "sum", "none")
TVD_REDUCTIONS = ("batchmean", "mean", "sum", "none")

DivergenceReduction = Literal["mean", "batchmean", "sum", "none"]


def _check_distributions(input: torch.Tensor, target: torch.Tensor) -> None:
    check_tensor("input", input)
    check_tensor("target", target)
    if target.shape != input.shape:
        raise ValueError(
            f"target must have input's shape {tuple(input.shape)} (one distribution per row, over the same "
            f"vocabulary), got {tuple(target.shape)}"
        )
    check_same_dtype(input=input, target=target)


def _check_labels(labels: torch.Tensor | None, input: torch.Tensor, ignore_index: int) -> None:
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if labels is not None:
        check_tensor("labels", labels, dtypes=INDEX_DTYPES, min_dim=0)
        check_shape("labels", labels, tuple(input.shape[:-1]), "the leading dimensions of input")


def _check_beta(beta: float) -> None:
    check_numbers(beta=beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")


def kl_div(
    input: torch.Tensor, target: torch.Tensor, *, reduction: DivergenceReduction = "mean", log_target: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.kl_div``: pointwise ``target·(log target − input)``.

    Args:
        input: ``[..., V]`` log-probabilities (fp32/bf16/fp16).
        target: ``input``'s shape and dtype: probabilities, or log-probabilities with
            ``log_target`` (pointwise ``exp(target)·(target − input)``). A zero probability
            contributes 0.
        reduction: ``"mean"`` (over all elements, PyTorch's default), ``"batchmean"`` (the sum
            divided by ``input.shape[0]``: the KL per row of a 2-D input), ``"sum"`` or ``"none"``.
            ``"mean"`` and ``"batchmean"`` of an empty input are NaN, as PyTorch's.
    Returns: the fp32 scalar, or for ``"none"`` the pointwise losses in ``input``'s shape and
    dtype. Gradients flow to ``input`` and to ``target`` when it requires grad (with a
    probability target, ``−inf`` where it is 0: the derivative of ``y·log y`` there).
    """
    _check_distributions(input, target)
    check_same_device(input=input, target=target)
    check_choice("reduction", reduction, KL_REDUCTIONS)
    return _divergence.kl_div(input, target, reduction, bool(log_target))


def jsd(
    input: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None = None, *, beta: float = 0.5,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence (TRL's GKD convention), averaged over rows.

    Per row, with student log-probs ``s = input`` and teacher log-probs ``t = target``: ``beta = 0``
    is ``KL(teacher ‖ student) = Σ e^t·(t − s)``, ``beta = 1`` is ``KL(student ‖ teacher)``, and
    in between, with the mixture ``m = log((1 − β)·e^s + β·e^t)``,
    ``β·KL(teacher ‖ m) + (1 − β)·KL(student ‖ m)``.

    Args:
        input, target: ``[..., V]`` log-probabilities of one shape and dtype.
        labels: ``[...]`` int64/int32 or ``None``; rows whose label is ``ignore_index`` are left out.
        beta: in ``[0, 1]``.
    Returns: the fp32 scalar: the sum over rows not ignored divided by their number (0, with
    zero gradients, when every row is ignored). Gradients flow to ``input`` and to ``target``
    when it requires grad.
    """
    _check_distributions(input, target)
    _check_labels(labels, input, ignore_index)
    check_same_device(input=input, target=target, labels=labels)
    _check_beta(beta)
    return _divergence.jsd(input, target, labels, float(beta), ignore_index)


def tvd(
    input: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None = None, *,
    reduction: DivergenceReduction = "batchmean", ignore_index: int = -100,
) -> torch.Tensor:
    """Total variation distance ``½·Σ_j |input_j − target_j|`` per row of probabilities.

    Args:
        input, target: ``[..., V]`` probabilities of one shape and dtype.
        labels: ``[...]`` int64/int32 or ``None``; rows whose label is ``ignore_index`` are left out.
        reduction: ``"batchmean"`` (the sum over rows not ignored divided by their number),
            ``"mean"`` (divided by their number of elements, rows · V), ``"sum"``, or ``"none"``
            (pointwise ``½·|input − target|`` in ``input``'s shape and dtype, 0 on ignored rows).
    Returns: the fp32 scalar (0 when every row is ignored), or the pointwise losses. The gradient
    is ``±½`` (``½·sign(input − target)``, 0 where the two are equal, as ``torch.sign``); it flows
    to ``input`` and to ``target`` when it requires grad.
    """
    _check_distributions(input, target)
    _check_labels(labels, input, ignore_index)
    check_same_device(input=input, target=target, labels=labels)
    check_choice("reduction", reduction, TVD_REDUCTIONS)
    return _divergence.tvd(input, target, labels, reduction, ignore_index)


def fused_linear_jsd(
    input: torch.Tensor,
    weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    chunk_memory_bytes: int | None = None,
) -> torch.Tensor:
    """:func:`jsd` of ``log_softmax(input @ weight.T / T)`` and ``log_softmax(teacher_input @
    teacher_weight.T / T)`` without holding either ``[N, V]`` logits.

    Tokens are processed in chunks whose student and teacher logits together fit in
    ``chunk_memory_bytes`` (default: see :data:`tigon.ops.fused_linear.DEFAULT_CHUNK_MEMORY_BYTES`).

    Args:
        input: ``[..., H]`` student hidden states; weight: ``[V, H]`` student head; one dtype.
        teacher_input: ``[..., H_t]`` with ``input``'s leading dimensions; teacher_weight:
            ``[V, H_t]`` over the same vocabulary; one dtype (not necessarily the student's).
        labels, beta, ignore_index: as :func:`jsd`.
        temperature: ``T > 0``, dividing both models' logits.
    Returns: the fp32 scalar loss. Gradients flow to ``input`` and ``weight`` (when they require
    it); the teacher is a constant and gets none: a teacher tensor that requires grad is refused.
    """
    check_input_weight_order(input, weight, "labels", labels)
    check_head("", input, weight)
    check_head("teacher_", teacher_input, teacher_weight)
    for name, tensor in (("teacher_input", teacher_input), ("teacher_weight", teacher_weight)):
        check_constant(name, tensor, "distillation treats the teacher as fixed")
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"teacher_weight {tuple(teacher_weight.shape)} and weight {tuple(weight.shape)} must cover the same "
            f"vocabulary: got V = {teacher_weight.shape[0]} for the teacher and V = {weight.shape[0]} for the student"
        )
    if teacher_input.shape[:-1] != input.shape[:-1]:
        raise ValueError(
            f"teacher_input must have input's leading dimensions {tuple(input.shape[:-1])} (one teacher row per "
            f"token), got shape {tuple(teacher_input.shape)}"
        )
    _check_labels(labels, input, ignore_index)
    check_same_device(
        input=input, weight=weight, teacher_input=teacher_input, teacher_weight=teacher_weight, labels=labels,
    )
    _check_beta(beta)
    check_numbers(temperature=temperature)
    check_positive("temperature", temperature)
    if chunk_memory_bytes is not None and chunk_memory_bytes <= 0:
        raise ValueError(f"chunk_memory_bytes must be None or > 0, got {chunk_memory_bytes!r}")
    return _fused_linear_jsd.fused_linear_jsd(
        input, weight, teacher_input, teacher_weight, labels, float(beta), ignore_index, float(temperature),
        chunk_memory_bytes,
    )


class KLDivLoss(nn.Module):
    """``torch.nn.KLDivLoss``: ``forward(input, target)`` as :func:`kl_div`."""

    def __init__(self, *, reduction: DivergenceReduction = "mean", log_target: bool = False) -> None:
        super().__init__()
        self.reduction = reduction
        self.log_target = log_target

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_div(input, target, reduction=self.reduction, log_target=self.log_target)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, log_target={self.log_target}"


class JSDLoss(nn.Module):
    """Generalized JSD: ``forward(input, target, labels=None)`` as :func:`jsd`."""

    def __init__(self, *, beta: float = 0.5, ignore_index: int = -100) -> None:
        super().__init__()
        self.beta = beta
        self.ignore_index = ignore_index

    def forward(self, input: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return jsd(input, target, labels, beta=self.beta, ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}"


class TVDLoss(nn.Module):
    """Total variation distance: ``forward(input, target, labels=None)`` as :func:`tvd`."""

    def __init__(self, *, reduction: DivergenceReduction = "batchmean", ignore_index: int = -100) -> None:
        super().__init__()
        self.reduction = reduction
        self.ignore_index = ignore_index

    def forward(self, input: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return tvd(input, target, labels, reduction=self.reduction, ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, ignore_index={self.ignore_index}"


class FusedLinearJSDLoss(nn.Module):
    """Fused linear generalized JSD: ``forward(input, weight, teacher_input, teacher_weight,
    labels=None)`` as :func:`fused_linear_jsd`."""

    def __init__(
        self, *, beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
        chunk_memory_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.beta = beta
        self.ignore_index = ignore_index
        self.temperature = temperature
        self.chunk_memory_bytes = chunk_memory_bytes

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, teacher_input: torch.Tensor, teacher_weight: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return fused_linear_jsd(
            input, weight, teacher_input, teacher_weight, labels, beta=self.beta, ignore_index=self.ignore_index,
            temperature=self.temperature, chunk_memory_bytes=self.chunk_memory_bytes,
        )

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}, temperature={self.temperature}"
