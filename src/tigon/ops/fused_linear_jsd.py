"""Generalized JSD between a student's and a teacher's ``softmax(x @ Wᵀ / T)`` without holding
either model's ``[N, V]`` logits.

Per row, with student logits ``z = x·Wᵀ``, teacher logits ``u = x_t·W_tᵀ`` and temperature ``T``::

    s = log_softmax(z / T),   t = log_softmax(u / T)
    loss_row = Σ_j ℓ(s_j, t_j)          ℓ: the JSD term of :mod:`tigon.ops.divergence` at β
    loss = Σ over rows not ignored of loss_row / their number (0 when every row is ignored)

The student's gradient goes through the log-softmax: with ``g_j = dℓ/ds_j`` (from
:func:`~tigon.ops.divergence.pointwise_divergence`) and ``q = softmax(z / T) = e^s``,
``ds_j/dz_k = ([j = k] − q_k) / T``, so::

    dloss/dz_k = (g_k − q_k·Σ_j g_j) / T

The sum ``Σ_j g_j`` is needed before the first ``dz`` can be written, hence three passes over each
row of both logits: an online max / sum-exp of ``z / T`` and ``u / T``; the loss and ``Σ g``;
``dz`` written over the student's logits. The teacher is a constant: it gets no gradient.

The rows are processed in chunks by :func:`tigon.ops.fused_linear.fused_linear_chunks`; its head
computes the chunk's teacher logits into a second reused buffer and runs the kernel. The mean's
``1 / n_valid`` (``n_valid`` counted on the device) is shared between the matmuls and the kernel's
``dz`` as in :mod:`tigon.ops.fused_linear_cross_entropy` (:func:`tigon.ops.fused_linear.mean_scales`),
so that the call can be captured in a CUDA graph. Without labels the whole ``1 / N`` is the
matmuls'. The gradients are computed during the forward pass; backward
multiplies them by ``grad_output`` in place (nothing to do when it is 1).

Shapes: ``input [..., H]``, ``weight [V, H]`` of one dtype; ``teacher_input [..., H_t]``,
``teacher_weight [V, H_t]`` of one dtype (fp32/bf16/fp16, not necessarily the student's);
``labels [...]`` int64/int32. Cost per chunk of ``C`` rows: ``2·C·V·(H + H_t)`` FLOPs for the
logits and ``4·C·V·H`` for the gradients; the kernel reads both ``[C, V]`` buffers three times
and writes one. Extra memory: the two chunk buffers plus the gradients themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.ops._launch import as_rows, tigon_op
from tigon.ops.cross_entropy import store_zero_row
from tigon.ops.divergence import (
    flat_labels,
    kernel_variant,
    launch_geometry,
    pointwise_divergence,
    scale_grads_in_place,
)
from tigon.ops.fused_linear import (
    chunk_rows_for,
    fused_linear_chunks,
    linear_logits,
    mean_scales,
    new_grads,
    row_chunks,
)


@triton.jit
def _online_logsumexp(running_max, sum_exp, z):
    """One block of an online log-sum-exp: ``sum_exp = Σ exp(z − shift)`` is rescaled whenever the
    running max grows; the shift is that max, or 0 while every ``z`` seen is −inf, so that no
    (−inf) − (−inf) appears."""
    new_max = tl.maximum(running_max, tl.max(z, axis=0))
    new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    sum_exp = sum_exp * tl.exp(running_max - new_shift) + tl.sum(tl.exp(z - new_shift), axis=0)
    return new_max, sum_exp


@triton.jit
def _log_probs(logits_row, offs, mask, inv_temperature, shift, log_sum):
    """One block of ``log_softmax(z / T)`` given the row's log-sum-exp as ``shift + log_sum``."""
    z = tl.load(logits_row + offs, mask=mask, other=0.0).to(tl.float32)
    return (z * inv_temperature - shift) - log_sum


@triton.jit
def jsd_from_logits_fwd_kernel(
    STUDENT, TEACHER, LABELS, GRAD_SCALE, LOSS,
    n_rows, n_cols,
    stride_student, stride_teacher,
    ignore_index, beta, inv_temperature,
    DIVERGENCE: tl.constexpr, HAS_LABELS: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Persistent grid: program p handles rows p, p + P, ...; each row is read in blocks of BLOCK_V.
    # dloss/dz overwrites STUDENT: every block is read before the same block is written.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_V)
    n_blocks = tl.cdiv(n_cols, BLOCK_V)
    # dz's factor: 1 / T through the temperature, times the mean's device part (m / n_valid).
    grad_factor = inv_temperature
    if COMPUTE_GRAD and HAS_GRAD_SCALE:
        grad_factor = inv_temperature * tl.load(GRAD_SCALE)

    for row in range(pid, n_rows, n_programs):
        row64 = tl.cast(row, tl.int64)
        student_row = STUDENT + row64 * stride_student
        teacher_row = TEACHER + row64 * stride_teacher
        ignored = False
        if HAS_LABELS:
            ignored = tl.load(LABELS + row64) == ignore_index

        if ignored:
            tl.store(LOSS + row64, 0.0)
            if COMPUTE_GRAD:
                store_zero_row(student_row, n_cols, BLOCK_V)
        else:
            # Pass 1: log-sum-exp of both tempered rows, kept as shift + log(sum_exp): with large
            # logits z/T − shift is exact where z/T − lse would round.
            student_max = tl.full((), float("-inf"), tl.float32)
            teacher_max = tl.full((), float("-inf"), tl.float32)
            student_sum = tl.zeros((), tl.float32)
            teacher_sum = tl.zeros((), tl.float32)
            for start in range(0, n_cols, BLOCK_V):
                offs = start + cols
                mask = offs < n_cols
                z = tl.load(student_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
                u = tl.load(teacher_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
                student_max, student_sum = _online_logsumexp(student_max, student_sum, z)
                teacher_max, teacher_sum = _online_logsumexp(teacher_max, teacher_sum, u)
            student_shift = tl.where(student_max == float("-inf"), 0.0, student_max)
            teacher_shift = tl.where(teacher_max == float("-inf"), 0.0, teacher_max)
            student_log_sum = tl.log(student_sum)
            teacher_log_sum = tl.log(teacher_sum)

            # Pass 2: the row's loss and Σ_j g_j, g = dloss/ds.
            row_loss = tl.zeros((), tl.float32)
            grad_sum = tl.zeros((), tl.float32)
            for start in range(0, n_cols, BLOCK_V):
                offs = start + cols
                mask = offs < n_cols
                s = _log_probs(student_row, offs, mask, inv_temperature, student_shift, student_log_sum)
                t = _log_probs(teacher_row, offs, mask, inv_temperature, teacher_shift, teacher_log_sum)
                loss, grad_s, _ = pointwise_divergence(s, t, beta, DIVERGENCE)
                row_loss += tl.sum(tl.where(mask, loss, 0.0), axis=0)
                grad_sum += tl.sum(tl.where(mask, grad_s, 0.0), axis=0)
            tl.store(LOSS + row64, row_loss)

            if COMPUTE_GRAD:
                # Pass 3: dloss/dz = (g − q·Σg) / T with q = e^s, through the log-softmax and the
                # temperature (times GRAD_SCALE). Walked backwards: the blocks pass 2 read last are
                # likeliest in L2.
                for block in range(0, n_blocks):
                    offs = (n_blocks - 1 - block) * BLOCK_V + cols
                    mask = offs < n_cols
                    s = _log_probs(student_row, offs, mask, inv_temperature, student_shift, student_log_sum)
                    t = _log_probs(teacher_row, offs, mask, inv_temperature, teacher_shift, teacher_log_sum)
                    _, grad_s, _ = pointwise_divergence(s, t, beta, DIVERGENCE)
                    grad_z = (grad_s - tl.exp(s) * grad_sum) * grad_factor
                    tl.store(student_row + offs, grad_z.to(STUDENT.dtype.element_ty), mask=mask)


def launch_jsd_from_logits(
    student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor | None, loss: torch.Tensor,
    beta: float, ignore_index: int, temperature: float, compute_grad: bool,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """Write the per-row losses ``loss [N]`` (fp32) and, with ``compute_grad``, dloss/dz over
    ``student``, times ``grad_scale``.

    Args:
        student, teacher: ``[N, V]`` logits with unit column stride, any row stride.
        labels: ``[N]`` or ``None`` (no row ignored).
        grad_scale: fp32 ``[1]`` device factor of every gradient row, or ``None`` for 1.
    """
    n_rows, n_cols = student.shape
    element_size = max(student.element_size(), teacher.element_size())
    block_v, num_warps, n_programs = launch_geometry(n_rows, n_cols, element_size, student.device)
    jsd_from_logits_fwd_kernel[(n_programs,)](
        student, teacher, labels, grad_scale, loss,
        n_rows, n_cols,
        student.stride(0), teacher.stride(0),
        ignore_index, beta, 1.0 / temperature,
        DIVERGENCE=kernel_variant("jsd", beta), HAS_LABELS=labels is not None, COMPUTE_GRAD=compute_grad,
        HAS_GRAD_SCALE=grad_scale is not None,
        BLOCK_V=block_v, num_warps=num_warps,
    )


def _fwd_fake(input, weight, teacher_input, teacher_weight, labels, beta, ignore_index, temperature, chunk_rows,
              grad_input_needed, grad_weight_needed):
    n_rows = input.numel() // input.shape[-1]
    return (
        input.new_empty((), dtype=torch.float32),
        input.new_empty((n_rows, input.shape[-1]) if grad_input_needed else (0,)),
        weight.new_empty(tuple(weight.shape) if grad_weight_needed else (0,)),
    )


@tigon_op("fused_linear_jsd_fwd", fake=_fwd_fake)
def fused_linear_jsd_fwd(
    input: torch.Tensor, weight: torch.Tensor, teacher_input: torch.Tensor, teacher_weight: torch.Tensor,
    labels: torch.Tensor | None, beta: float, ignore_index: int, temperature: float, chunk_rows: int,
    grad_input_needed: bool, grad_weight_needed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ the fp32 scalar loss and the needed gradients ``grad_input [N, H]``, ``grad_weight
    [V, H]`` for ``grad_output = 1`` (empty when not needed)."""
    x2d, teacher_x2d = as_rows(input), as_rows(teacher_input)
    n_rows = x2d.shape[0]
    labels = flat_labels(labels)
    grad_input, grad_weight, _ = new_grads(x2d, weight, grad_input_needed, grad_weight_needed, False)
    compute_grad = grad_input is not None or grad_weight is not None
    n_valid = None if labels is None else (labels != ignore_index).sum()
    grad_scale, matmul_scale = None, 1.0 / max(n_rows, 1)
    if n_valid is not None and compute_grad:
        grad_scale, matmul_scale = mean_scales(n_valid, n_rows)
    loss = x2d.new_empty(n_rows, dtype=torch.float32)
    teacher_buffer = teacher_x2d.new_empty((min(chunk_rows, n_rows), teacher_weight.shape[0]))

    def jsd_head(ranges, logits):
        ((start, end),) = ranges
        teacher_logits = linear_logits(teacher_x2d[start:end], teacher_weight, None, teacher_buffer[: end - start])
        launch_jsd_from_logits(
            logits, teacher_logits, None if labels is None else labels[start:end], loss[start:end],
            beta, ignore_index, temperature, compute_grad, grad_scale,
        )

    fused_linear_chunks(
        x2d, weight, None, row_chunks(n_rows, chunk_rows), jsd_head, grad_input, grad_weight,
        matmul_scale=matmul_scale,
    )
    return (
        # 0 rather than NaN over no rows, as TRL's GKD loss (clamped: tigon.losses.distillation).
        loss.sum() / max(n_rows, 1) if n_valid is None else loss.sum() / n_valid.clamp(min=1),
        x2d.new_empty(0) if grad_input is None else grad_input,
        weight.new_empty(0) if grad_weight is None else grad_weight,
    )


class FusedLinearJSDFunction(torch.autograd.Function):
    """Saves the gradients computed by the forward pass; backward scales them by ``grad_output``
    in place, so it runs once per forward."""

    @staticmethod
    def forward(ctx, input, weight, teacher_input, teacher_weight, labels, beta, ignore_index, temperature,
                chunk_memory_bytes, needs):
        n_rows = input.numel() // input.shape[-1]
        # The budget holds both chunk buffers: a row costs a student and a teacher row of logits.
        element_size = input.element_size() + teacher_input.element_size()
        chunk_rows = chunk_rows_for(n_rows, weight.shape[0], element_size, chunk_memory_bytes)
        loss, grad_input, grad_weight = fused_linear_jsd_fwd(
            input, weight, teacher_input, teacher_weight, labels, beta, ignore_index, temperature, chunk_rows, *needs,
        )
        ctx.save_for_backward(grad_input, grad_weight)
        ctx.needs, ctx.input_shape = needs, input.shape
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_input, grad_weight = ctx.saved_tensors
        scale_grads_in_place((grad_input, grad_weight), ctx.needs, grad_loss)
        input_needed, weight_needed = ctx.needs
        return (
            grad_input.view(ctx.input_shape) if input_needed else None,
            grad_weight if weight_needed else None,
            None, None, None, None, None, None, None, None,
        )


def fused_linear_jsd(input, weight, teacher_input, teacher_weight, labels, beta, ignore_index, temperature,
                     chunk_memory_bytes):
    """The fp32 scalar loss with autograd to ``input`` and ``weight``; inputs validated by
    :mod:`tigon.losses.distillation`."""
    # Known here rather than inside forward (which always runs without grad mode), so that nothing
    # is computed under torch.no_grad() and a frozen head costs no [V, H] gradient.
    grad_enabled = torch.is_grad_enabled()
    needs = (input.requires_grad and grad_enabled, weight.requires_grad and grad_enabled)
    return FusedLinearJSDFunction.apply(
        input, weight, teacher_input, teacher_weight, labels, beta, ignore_index, temperature, chunk_memory_bytes,
        needs,
    )
