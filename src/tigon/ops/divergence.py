"""Divergences between two distributions given row by row: KL, generalized JSD, total variation.

Every divergence here is a sum over the vocabulary of a pointwise term ``ℓ(x_j, y_j)`` of the two
rows ``x = input`` and ``y = target`` ``[V]`` (fp32 math whatever the storage dtype)::

    kl                   x log-probs, y probs        ℓ = y·(log y − x)          (0 where y = 0)
    kl_log_target        x, y log-probs, p = e^y     ℓ = p·(y − x)              (0 where p = 0)
    jsd, β = 0           s = x, t = y log-probs      ℓ = e^t·(t − s)            KL(teacher ‖ student)
    jsd, β = 1                                       ℓ = e^s·(s − t)            KL(student ‖ teacher)
    jsd, 0 < β < 1       m = log((1 − β)·e^s + β·e^t)
                                                     ℓ = β·e^t·(t − m) + (1 − β)·e^s·(s − m)
    tvd                  x, y probs                  ℓ = ½·|x − y|

(TRL's generalized JSD: β weighs the teacher in the mixture ``m``; β = 0 and β = 1 are the two
KLs, not the limits of the mixture, which vanishes at both ends.) The gradients::

    kl              dℓ/dx = −y                     dℓ/dy = log y + 1 − x
    kl_log_target   dℓ/dx = −p                     dℓ/dy = p·(y − x + 1)      (d p/dy = p)
    jsd mixture     dℓ/ds = (1 − β)·e^s·(s − m)    dℓ/dt = β·e^t·(t − m)
    tvd             dℓ/dx = ½·sign(x − y)          dℓ/dy = −½·sign(x − y)     (0 where x = y)

For the mixture, differentiating ``m`` adds ``−(β·e^t + (1 − β)·e^s)·dm/ds`` to dℓ/ds, and
``e^m·dm/ds = (1 − β)·e^s`` exactly cancels the ``(1 − β)·e^s`` from the product rule on
``e^s·(s − m)``: each gradient is just its own term of the loss, weighted. For ``kl`` the target's
gradient at ``y = 0`` is ``−inf`` (the derivative of ``y·log y`` there; PyTorch gives NaN).

Rows whose label is ``ignore_index`` (when labels are given) are not read and have zero loss and
zero gradient. The gradient is computed during the forward pass, already multiplied by the
reduction's factor (``1 / n_valid`` and the like, kept on the device: no host sync), and
backward multiplies it by ``grad_output`` in place, skipping that pass when ``grad_output`` is
exactly 1 (16-bit gradients hold that factor: fp16 flushes entries below 6e-8 to zero, as
PyTorch's own fp16 backward does). ``reduction="none"`` (pointwise losses) stores the losses only,
and its backward runs the same kernel again with the pointwise ``grad_output`` as the factor.

Shapes: ``input``, ``target`` ``[N, V]`` (unit column stride, any row stride, ``N·V`` beyond
2³¹) fp32/bf16/fp16; ``labels [N]`` int64/int32. Bytes per call (the roofline): the reduced
losses read both rows and write one gradient per tensor that requires grad, ``(2 + g)·N·V``
elements for ``g`` gradients (plus ``2·g·N·V`` in backward when ``grad_output`` is not 1);
``"none"`` writes the ``N·V`` losses and its backward reads three and writes ``g`` ``[N, V]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.ops._launch import as_rows, num_programs_for, tigon_op
from tigon.ops.cross_entropy import cross_entropy_bwd

# A row is walked in blocks of at most this many bytes of one operand (8192 bf16 elements), with
# ELEMENTS_PER_THREAD elements of each operand per thread (16 warps for that block). Two operands
# and up to three results per element: compiled offline for sm_90a (ptxas -v, Triton 3.6), 16 per
# thread take 106-126 registers, 32 per thread 170-238. Not yet swept on a GPU.
MAX_BLOCK_BYTES = 16384
ELEMENTS_PER_THREAD = 16
# Programs per multiprocessor in the persistent grid (cross entropy's setting).
PROGRAMS_PER_SM = 2

# Each divergence's kernel variant, the constexpr DIVERGENCE.
KERNEL_VARIANTS = ("kl", "kl_log_target", "reverse_kl_log_target", "jsd", "tvd")


@triton.jit
def _kl_log_target(x, log_p):
    """``(ℓ, dℓ/dx, dℓ/dlog_p)`` of ``ℓ = p·(log_p − x)``, ``p = e^log_p``; 0 where ``p`` is 0."""
    p = tl.exp(log_p)
    loss = tl.where(p == 0.0, 0.0, p * (log_p - x))
    # d(p·(log_p − x))/dlog_p = p·(log_p − x) + p, since dp/dlog_p = p.
    return loss, -p, tl.where(p == 0.0, 0.0, loss + p)


@triton.jit
def pointwise_divergence(x, y, beta, DIVERGENCE: tl.constexpr):
    """``(ℓ, dℓ/dx, dℓ/dy)`` elementwise in fp32 for one of :data:`KERNEL_VARIANTS`."""
    if DIVERGENCE == "kl":
        log_y = tl.log(y)
        loss = tl.where(y == 0.0, 0.0, y * (log_y - x))
        grad_x = -y
        grad_y = log_y + 1.0 - x
    elif DIVERGENCE == "kl_log_target":
        loss, grad_x, grad_y = _kl_log_target(x, y)
    elif DIVERGENCE == "reverse_kl_log_target":
        # e^x·(x − y): the same term with the roles of the two rows swapped.
        loss, grad_y, grad_x = _kl_log_target(y, x)
    elif DIVERGENCE == "jsd":
        p_x = tl.exp(x)
        p_y = tl.exp(y)
        log_mixture = tl.log((1.0 - beta) * p_x + beta * p_y)
        # Each side's term is its own share of the gradient (the dm terms cancel). A zero
        # probability contributes nothing, even where log_mixture is −inf too.
        term_x = tl.where(p_x == 0.0, 0.0, p_x * (x - log_mixture))
        term_y = tl.where(p_y == 0.0, 0.0, p_y * (y - log_mixture))
        grad_x = (1.0 - beta) * term_x
        grad_y = beta * term_y
        loss = grad_x + grad_y
    else:
        diff = x - y
        loss = 0.5 * tl.abs(diff)
        grad_x = tl.where(diff > 0.0, 0.5, tl.where(diff < 0.0, -0.5, 0.0))
        grad_y = -grad_x
    return loss, grad_x, grad_y


@triton.jit
def divergence_fwd_kernel(
    INPUT, TARGET, LABELS, GRAD_SCALE, LOSS, GRAD_INPUT, GRAD_TARGET,
    n_rows, n_cols,
    stride_input, stride_target, stride_scale_row, stride_scale_col, stride_loss,
    stride_grad_input, stride_grad_target,
    ignore_index, beta,
    DIVERGENCE: tl.constexpr, HAS_LABELS: tl.constexpr,
    STORE_ROW_LOSS: tl.constexpr, STORE_POINTWISE_LOSS: tl.constexpr, POINTWISE_GRAD_SCALE: tl.constexpr,
    COMPUTE_GRAD_INPUT: tl.constexpr, COMPUTE_GRAD_TARGET: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Persistent grid: program p handles rows p, p + P, ...; each row in one pass of BLOCK_V blocks.
    # The gradient is dℓ times GRAD_SCALE: the reduction's factor ([1]) in the forward pass, or
    # the pointwise grad_output ([N, V], any strides) when this runs as the backward of "none".
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_V)
    COMPUTE_GRAD: tl.constexpr = COMPUTE_GRAD_INPUT or COMPUTE_GRAD_TARGET
    if COMPUTE_GRAD and not POINTWISE_GRAD_SCALE:
        grad_scale = tl.load(GRAD_SCALE)

    for row in range(pid, n_rows, n_programs):
        row64 = tl.cast(row, tl.int64)
        valid = True
        if HAS_LABELS:
            valid = tl.load(LABELS + row64) != ignore_index
        row_loss = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            in_row = offs < n_cols
            # An ignored row is not read: its loads are masked off, its outputs written as 0.
            mask = in_row & valid
            x = tl.load(INPUT + row64 * stride_input + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(TARGET + row64 * stride_target + offs, mask=mask, other=0.0).to(tl.float32)
            loss, grad_x, grad_y = pointwise_divergence(x, y, beta, DIVERGENCE)
            loss = tl.where(mask, loss, 0.0)
            if STORE_ROW_LOSS:
                row_loss += tl.sum(loss, axis=0)
            if STORE_POINTWISE_LOSS:
                tl.store(LOSS + row64 * stride_loss + offs, loss.to(LOSS.dtype.element_ty), mask=in_row)
            if COMPUTE_GRAD:
                if POINTWISE_GRAD_SCALE:
                    scale_offs = row64 * stride_scale_row + offs * stride_scale_col
                    grad_scale = tl.load(GRAD_SCALE + scale_offs, mask=mask, other=0.0).to(tl.float32)
                if COMPUTE_GRAD_INPUT:
                    grad_x = tl.where(mask, grad_x * grad_scale, 0.0)
                    tl.store(
                        GRAD_INPUT + row64 * stride_grad_input + offs, grad_x.to(GRAD_INPUT.dtype.element_ty),
                        mask=in_row,
                    )
                if COMPUTE_GRAD_TARGET:
                    grad_y = tl.where(mask, grad_y * grad_scale, 0.0)
                    tl.store(
                        GRAD_TARGET + row64 * stride_grad_target + offs, grad_y.to(GRAD_TARGET.dtype.element_ty),
                        mask=in_row,
                    )
        if STORE_ROW_LOSS:
            tl.store(LOSS + row64, row_loss)


def launch_geometry(n_rows: int, n_cols: int, element_size: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_V, num_warps, n_programs)`` for the row-looping kernels of the distillation losses
    (:data:`MAX_BLOCK_BYTES` read at each call, so tests can force several blocks per row)."""
    block_v = triton.next_power_of_2(min(n_cols, max(1, MAX_BLOCK_BYTES // element_size)))
    num_warps = max(1, min(16, block_v // (32 * ELEMENTS_PER_THREAD)))
    n_programs = max(1, min(n_rows, num_programs_for(device, PROGRAMS_PER_SM)))
    return block_v, num_warps, n_programs


def kernel_variant(divergence: str, beta: float) -> str:
    """The kernel's ``DIVERGENCE`` for ``"kl"``, ``"kl_log_target"``, ``"jsd"`` (at ``beta``) or ``"tvd"``."""
    if divergence != "jsd":
        return divergence
    if beta == 0.0:
        return "kl_log_target"
    if beta == 1.0:
        return "reverse_kl_log_target"
    return "jsd"


def launch_divergence(
    input: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None, grad_scale: torch.Tensor | None,
    row_loss: torch.Tensor | None, pointwise_loss: torch.Tensor | None,
    grad_input: torch.Tensor | None, grad_target: torch.Tensor | None,
    variant: str, beta: float, ignore_index: int,
) -> None:
    """Write the losses and gradients that are given.

    Args:
        input, target: ``[N, V]`` with unit column stride. labels: ``[N]`` or ``None``.
        grad_scale: fp32 ``[1]``, or ``[N, V]`` of any strides (the pointwise ``grad_output``);
            ``None`` when no gradient is given.
        row_loss: fp32 ``[N]`` per-row sums. pointwise_loss: ``[N, V]``, unit column stride.
        grad_input, grad_target: ``[N, V]`` with unit column stride, or ``None``.
        variant: one of :data:`KERNEL_VARIANTS`.
    """
    n_rows, n_cols = input.shape
    block_v, num_warps, n_programs = launch_geometry(n_rows, n_cols, input.element_size(), input.device)
    pointwise_scale = grad_scale is not None and grad_scale.dim() == 2
    divergence_fwd_kernel[(n_programs,)](
        input, target, labels, grad_scale, row_loss if pointwise_loss is None else pointwise_loss,
        grad_input, grad_target,
        n_rows, n_cols,
        input.stride(0), target.stride(0),
        grad_scale.stride(0) if pointwise_scale else 0, grad_scale.stride(1) if pointwise_scale else 0,
        0 if pointwise_loss is None else pointwise_loss.stride(0),
        0 if grad_input is None else grad_input.stride(0), 0 if grad_target is None else grad_target.stride(0),
        ignore_index, beta,
        DIVERGENCE=variant, HAS_LABELS=labels is not None,
        STORE_ROW_LOSS=row_loss is not None, STORE_POINTWISE_LOSS=pointwise_loss is not None,
        POINTWISE_GRAD_SCALE=pointwise_scale,
        COMPUTE_GRAD_INPUT=grad_input is not None, COMPUTE_GRAD_TARGET=grad_target is not None,
        BLOCK_V=block_v, num_warps=num_warps,
    )


def flat_labels(labels: torch.Tensor | None) -> torch.Tensor | None:
    """``labels [...]`` as the contiguous ``[N]`` the kernels index by row (a strided view such as
    ``labels[:, ::2]`` would otherwise be read at the wrong rows)."""
    return None if labels is None else labels.reshape(-1).contiguous()


def _reduction_scale(n_rows, labels, ignore_index, divisor, per_valid_row, device) -> torch.Tensor:
    """fp32 ``[1]``: ``1 / (divisor · n_valid)`` when ``per_valid_row`` (``n_valid`` the rows not
    ignored, at least 1, counted on the device: the JSD's and TVD's mean over no row is 0, as TRL's
    GKD loss), else ``1 / divisor``: NaN for a divisor of 0, ``kl_div``'s mean over no element,
    as PyTorch's (the input then has no element to receive that factor as a gradient)."""
    if per_valid_row and labels is not None:
        n_valid = (labels != ignore_index).sum().clamp_(min=1)
        return (1.0 / (n_valid * divisor)).to(torch.float32).reshape(1)
    if not per_valid_row:
        return torch.full((1,), 1.0 / divisor if divisor else float("nan"), dtype=torch.float32, device=device)
    count = divisor * max(n_rows, 1)
    return torch.full((1,), 1.0 / max(count, 1), dtype=torch.float32, device=device)


def _grad_buffers(input2d, target2d, grad_input_needed, grad_target_needed):
    return (
        torch.empty(input2d.shape, dtype=input2d.dtype, device=input2d.device) if grad_input_needed else None,
        torch.empty(target2d.shape, dtype=target2d.dtype, device=target2d.device) if grad_target_needed else None,
    )


def _grads_out(input2d, target2d, grad_input, grad_target):
    """The gradients as op outputs: a distinct empty tensor where one was not computed."""
    return (
        input2d.new_empty(0) if grad_input is None else grad_input,
        target2d.new_empty(0) if grad_target is None else grad_target,
    )


def _fwd_fake(input, target, labels, divergence, beta, ignore_index, divisor, per_valid_row, pointwise,
              grad_input_needed, grad_target_needed):
    n_rows = input.numel() // input.shape[-1]
    rows = (n_rows, input.shape[-1])
    in_forward = not pointwise
    return (
        input.new_empty(rows) if pointwise else input.new_empty((), dtype=torch.float32),
        input.new_empty(rows if grad_input_needed and in_forward else (0,)),
        target.new_empty(rows if grad_target_needed and in_forward else (0,)),
    )


@tigon_op("divergence_fwd", fake=_fwd_fake)
def divergence_fwd(
    input: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None, divergence: str, beta: float,
    ignore_index: int, divisor: int, per_valid_row: bool, pointwise: bool,
    grad_input_needed: bool, grad_target_needed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input``, ``target`` ``[..., V]``, ``labels [...]`` or ``None`` → ``loss`` and, unless
    ``pointwise``, the needed gradients ``[N, V]`` for ``grad_output = 1`` (empty otherwise).

    ``loss`` is the fp32 scalar ``Σ ℓ / (divisor · n_valid)`` (``n_valid`` only when
    ``per_valid_row``), or with ``pointwise`` the ``[N, V]`` pointwise losses in ``input``'s dtype.
    """
    input2d, target2d = as_rows(input), as_rows(target)
    labels = flat_labels(labels)
    variant = kernel_variant(divergence, beta)
    if pointwise:
        loss = torch.empty(input2d.shape, dtype=input.dtype, device=input.device)
        launch_divergence(input2d, target2d, labels, None, None, loss, None, None, variant, beta, ignore_index)
        return loss, *_grads_out(input2d, target2d, None, None)
    grad_input, grad_target = _grad_buffers(input2d, target2d, grad_input_needed, grad_target_needed)
    scale = _reduction_scale(input2d.shape[0], labels, ignore_index, divisor, per_valid_row, input.device)
    row_loss = input2d.new_empty(input2d.shape[0], dtype=torch.float32)
    launch_divergence(
        input2d, target2d, labels, scale, row_loss, None, grad_input, grad_target, variant, beta, ignore_index,
    )
    return (row_loss.sum() * scale).reshape(()), *_grads_out(input2d, target2d, grad_input, grad_target)


def _bwd_fake(grad_output, input, target, labels, divergence, beta, ignore_index, grad_input_needed,
              grad_target_needed):
    return _fwd_fake(input, target, labels, divergence, beta, ignore_index, 1, False, False,
                     grad_input_needed, grad_target_needed)[1:]


@tigon_op("divergence_bwd", fake=_bwd_fake)
def divergence_bwd(
    grad_output: torch.Tensor, input: torch.Tensor, target: torch.Tensor, labels: torch.Tensor | None,
    divergence: str, beta: float, ignore_index: int, grad_input_needed: bool, grad_target_needed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of the pointwise losses: ``grad_output [N, V]`` (any strides) times dℓ, recomputed
    from ``input`` and ``target``. Returns the gradients as :func:`divergence_fwd` does."""
    input2d, target2d = as_rows(input), as_rows(target)
    labels = flat_labels(labels)
    grad_input, grad_target = _grad_buffers(input2d, target2d, grad_input_needed, grad_target_needed)
    launch_divergence(
        input2d, target2d, labels, grad_output, None, None, grad_input, grad_target,
        kernel_variant(divergence, beta), beta, ignore_index,
    )
    return _grads_out(input2d, target2d, grad_input, grad_target)


def scale_grads_in_place(grads, needs, grad_output: torch.Tensor) -> None:
    """Multiply each needed gradient ``[R, C]`` (computed for ``grad_output = 1`` by a forward
    pass) by the scalar fp32 ``grad_output``, in place; nothing is touched when it is exactly 1."""
    for grad, needed in zip(grads, needs):
        if needed:
            cross_entropy_bwd(grad, grad_output.reshape(1))


class DivergenceFunction(torch.autograd.Function):
    """Reduced losses save only the gradients computed by the forward pass (scaled in place by
    ``grad_output`` in backward, so backward runs once per forward); pointwise losses save the
    inputs and recompute."""

    @staticmethod
    def forward(ctx, input, target, labels, divergence, beta, ignore_index, divisor, per_valid_row, pointwise,
                needs):
        loss, grad_input, grad_target = divergence_fwd(
            input, target, labels, divergence, beta, ignore_index, divisor, per_valid_row, pointwise, *needs,
        )
        if pointwise:
            ctx.save_for_backward(input, target, labels)
        else:
            ctx.save_for_backward(grad_input, grad_target)
        ctx.options = (divergence, beta, ignore_index)
        ctx.pointwise, ctx.needs, ctx.shape = pointwise, needs, input.shape
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.pointwise:
            input, target, labels = ctx.saved_tensors
            grad_input, grad_target = divergence_bwd(grad_loss, input, target, labels, *ctx.options, *ctx.needs)
        else:
            grad_input, grad_target = ctx.saved_tensors
            scale_grads_in_place((grad_input, grad_target), ctx.needs, grad_loss)
        input_needed, target_needed = ctx.needs
        return (
            grad_input.view(ctx.shape) if input_needed else None,
            grad_target.view(ctx.shape) if target_needed else None,
            None, None, None, None, None, None, None, None,
        )


def divergence(input, target, labels, divergence, beta, ignore_index, divisor, per_valid_row, pointwise):
    """The loss of :func:`divergence_fwd` with autograd: ``pointwise`` losses come back in
    ``input``'s shape. Inputs validated by :mod:`tigon.losses.distillation`."""
    # Known here, not inside forward (which always runs without grad mode), so that a loss
    # computed under torch.no_grad() neither pays for nor writes a gradient.
    grad_enabled = torch.is_grad_enabled()
    needs = (input.requires_grad and grad_enabled, target.requires_grad and grad_enabled)
    loss = DivergenceFunction.apply(
        input, target, labels, divergence, beta, ignore_index, divisor, per_valid_row, pointwise, needs,
    )
    # Reshaped outside the autograd function (see cross_entropy.shaped_losses).
    return loss.view(input.shape) if pointwise else loss


def kl_div(input, target, reduction, log_target):
    """As ``torch.nn.functional.kl_div``: ``"mean"`` over elements, ``"batchmean"`` over
    ``input.shape[0]``, ``"none"`` pointwise in ``input``'s dtype."""
    divisor = {"sum": 1, "none": 1, "mean": input.numel(), "batchmean": input.shape[0]}[reduction]
    return divergence(
        input, target, None, "kl_log_target" if log_target else "kl", 0.0, -100, divisor, False, reduction == "none",
    )


def jsd(input, target, labels, beta, ignore_index):
    """Σ over the rows not ignored of the generalized JSD, divided by their number."""
    return divergence(input, target, labels, "jsd", beta, ignore_index, 1, True, False)


def tvd(input, target, labels, reduction, ignore_index):
    """``"batchmean"``: Σ / rows not ignored; ``"mean"``: Σ / (their elements); ``"sum"``;
    ``"none"``: pointwise, 0 on ignored rows."""
    divisor = input.shape[-1] if reduction == "mean" else 1
    per_valid_row = reduction in ("mean", "batchmean")
    return divergence(input, target, labels, "tvd", 0.0, ignore_index, divisor, per_valid_row, reduction == "none")
