"""Softmax cross entropy whose gradient is computed during the forward pass.

Per row of logits ``x [V]`` with target ``t`` (fp32 math whatever the storage dtype)::

    z     = softcap · tanh(x / softcap)      (z = x without a softcap)
    lse   = log Σ_j exp(z_j)
    loss  = (1 − ε)·(lse − z_t) + ε·(lse − mean_j z_j) + s·lse²

with ``ε = label_smoothing`` (PyTorch's smoothing: ε spread uniformly over the V classes) and
``s = lse_square_scale`` (the z-loss, which keeps ``lse`` near 0). Rows whose target is
``ignore_index`` have zero loss and a zero gradient row. ``"mean"`` divides by the number of the
other rows, ``n_valid``; with none (every target ignored, or no rows) it is 0 / 0 = NaN with a zero
gradient, as PyTorch's ``cross_entropy`` gives. The division happens on the device, so NaN comes
with no host sync, under CUDA-graph capture too.

Nothing waits for the GPU, so the loss can be captured in a CUDA graph: ``n_valid`` is counted on
the device and divides there. A target outside ``[0, V)`` is treated by the kernels as
``ignore_index`` (zero loss and gradient, not counted in ``n_valid``), so nothing is read out of
bounds; in eager mode the host then raises ``ValueError`` for it, from the targets' range copied
to the host without waiting and checked once the loss's kernels are queued (the GPU keeps working
while the host waits). Under CUDA-graph capture and torch.compile that check is skipped and such
targets stay ignored.

The gradient with respect to ``z``, with ``p = softmax(z)``::

    dloss/dz_j = p_j − (1 − ε)·[j = t] − ε/V + 2·s·lse·p_j

``p_j`` is d lse/dz_j, so the first term comes from every ``lse`` in the loss except the z-loss,
which contributes ``2·s·lse·p_j`` by the chain rule; ``−(1 − ε)·[j = t]`` and ``−ε/V`` are the
derivatives of ``−(1 − ε)·z_t`` and ``−ε·mean(z)``. With a softcap the chain rule through tanh
multiplies by ``dz/dx = 1 − tanh² = 1 − (z / softcap)²``.

One kernel computes the loss and that gradient, already multiplied by the reduction's factor
(``1 / n_valid`` for ``"mean"``), in two passes over each row: an online max / sum-exp pass, then
a pass that re-reads the row and writes the gradient, either into a fresh tensor or over the
logits themselves (``inplace_backward``). The backward pass only multiplies that stored gradient
by the incoming ``grad_output``, in place, and skips rows where ``grad_output`` is exactly 1
(``loss.backward()`` on a mean or sum), so the usual step touches the ``[N, V]`` logits three
times in all: read, read again (often from L2), write.

Shapes: ``logits [..., V]`` fp32/bf16/fp16 with any row stride (V up to 262144, ``N·V`` beyond
2³¹), ``target [...]`` int64/int32. The loss and z-loss are fp32. The gradient has the logits'
dtype, so with fp16 logits entries below fp16's smallest subnormal (about 6e-8, reachable as
``p / n_valid`` for large batches) flush to zero before ``grad_output`` scales them.
Bytes per call (the roofline): 3·N·V elements (two reads and one write) plus one more read and
write in backward only when ``grad_output`` is not 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.ops._launch import (
    as_rows,
    host_sync_allowed,
    num_programs_for,
    range_to_host,
    read_range,
    row_launch_config,
    tigon_op,
)

# A vocabulary row is processed in blocks of at most this many bytes (32768 bf16 logits, 16 warps:
# 32 elements and four 16-byte loads per thread). Swept on the H100 at [8192, 128256] bf16
# (benchmarks/tune_kernels.py): 64 KiB blocks run the three passes in 1.69 ms, 16 KiB in 2.22 ms.
MAX_BLOCK_BYTES = 65536
# Programs per multiprocessor in the persistent grid: 1 to 8 are within 2% of each other there.
PROGRAMS_PER_SM = 2

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def softcapped(x, softcap):
    # tanh(u) = 2·sigmoid(2u) − 1: portable (no libdevice), exact at ±inf, and its absolute error
    # (~1e-7) is far below what the rounding to bf16/fp16 or an fp32 tolerance notices.
    return softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)


@triton.jit
def logits_grad(x, cols, target, shift, prob_scale, smoothing_grad, target_grad, softcap,
                HAS_SOFTCAP: tl.constexpr):
    """dloss/dx of logits ``x`` at columns ``cols`` of rows with target ``target`` (any shapes
    that broadcast): ``p·(1 + 2·s·lse) − ε/V − (1 − ε)·[j = t]`` times the reduction's factor,
    ``p = exp(z − shift) / sum_exp``; the row's ``prob_scale = factor·(1 + 2·s·lse) / sum_exp``,
    ``smoothing_grad = factor·ε/V``, ``target_grad = factor·(1 − ε)``. A row with
    ``shift = +inf`` and zero factors has a zero gradient."""
    z = x.to(tl.float32)
    if HAS_SOFTCAP:
        z = softcapped(z, softcap)
    grad = tl.exp2((z - shift) * LOG2E) * prob_scale - smoothing_grad
    grad = tl.where(cols == target, grad - target_grad, grad)
    if HAS_SOFTCAP:
        tanh = z / softcap
        grad = grad * (1.0 - tanh * tanh)
    return grad


@triton.jit
def store_zero_row(row, n_cols, BLOCK_V: tl.constexpr):
    """Zero ``n_cols`` elements from ``row`` in blocks of ``BLOCK_V``: the gradient of an ignored row."""
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        tl.store(row + offs, tl.zeros((BLOCK_V,), row.dtype.element_ty), mask=offs < n_cols)


@triton.jit
def cross_entropy_fwd_kernel(
    LOGITS, TARGET, GRAD, GRAD_SCALE, LOSS, Z_LOSS, ROW_STATS, GRAD_BOUND,
    n_rows, n_cols,
    stride_logits, stride_target, stride_grad, stride_grad_scale, stride_row_stats,
    ignore_index, label_smoothing, lse_square_scale, softcap,
    HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, STORE_Z_LOSS: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, STORE_ROW_STATS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Persistent grid: program p handles rows p, p + P, ...; each row is read in blocks of BLOCK_V.
    # GRAD may be LOGITS itself: every block is read before the same block is written.
    # With STORE_ROW_STATS, ROW_STATS [4, N] (row stride stride_row_stats) gets what logits_grad
    # takes of each row (shift, prob_scale, smoothing_grad, target_grad), and GRAD_BOUND [1] the
    # largest of the rows' bounds on their |gradient| (by atomic maximum), for a kernel that writes
    # the gradient later, scaled by it.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_V)
    n_blocks = tl.cdiv(n_cols, BLOCK_V)

    for row in range(pid, n_rows, n_programs):
        logits_row = LOGITS + tl.cast(row, tl.int64) * stride_logits
        target = tl.load(TARGET + row * stride_target)

        # A target outside [0, V) is ignored: the host raises for it, after this kernel is queued.
        if (target == ignore_index) | (target < 0) | (target >= n_cols):
            tl.store(LOSS + row, 0.0)
            if STORE_Z_LOSS:
                tl.store(Z_LOSS + row, 0.0)
            if COMPUTE_GRAD:
                store_zero_row(GRAD + tl.cast(row, tl.int64) * stride_grad, n_cols, BLOCK_V)
            if STORE_ROW_STATS:
                tl.store(ROW_STATS + row, float("inf"))
                for stat in range(1, 4):
                    tl.store(ROW_STATS + stat * stride_row_stats + row, 0.0)
        else:
            # The scalars needed after pass 1 are loaded first: their latency hides behind it.
            z_target = tl.load(logits_row + target).to(tl.float32)
            if HAS_SOFTCAP:
                z_target = softcapped(z_target, softcap)
            if HAS_GRAD_SCALE:
                grad_scale = tl.load(GRAD_SCALE + row * stride_grad_scale)
            else:
                grad_scale = 1.0

            # Pass 1: online log-sum-exp. sum_exp = Σ exp(z − shift) is rescaled whenever the
            # running max grows; shift is the running max, or 0 while every z seen is −inf, so
            # that no (−inf) − (−inf) appears.
            running_max = tl.full((), float("-inf"), tl.float32)
            sum_exp = tl.zeros((), tl.float32)
            sum_z = tl.zeros((), tl.float32)
            for start in range(0, n_cols, BLOCK_V):
                offs = start + cols
                mask = offs < n_cols
                z = tl.load(logits_row + offs, mask=mask, other=float("-inf"), eviction_policy="evict_last")
                z = z.to(tl.float32)
                if HAS_SOFTCAP:
                    z = tl.where(mask, softcapped(z, softcap), float("-inf"))
                new_max = tl.maximum(running_max, tl.max(z, axis=0))
                new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
                sum_exp = sum_exp * tl.exp2((running_max - new_shift) * LOG2E) + tl.sum(
                    tl.exp2((z - new_shift) * LOG2E), axis=0
                )
                running_max = new_max
                if HAS_SMOOTHING:
                    sum_z += tl.sum(tl.where(mask, z, 0.0), axis=0)
            # lse = shift + log(sum_exp) is kept as its two parts where it meets z: with logits
            # of 1e4, lse rounded to fp32 is off by 5e-4, but z − shift is exact.
            shift = tl.where(running_max == float("-inf"), 0.0, running_max)
            log_sum_exp = tl.log(sum_exp)
            lse = shift + log_sum_exp

            z_loss = lse_square_scale * lse * lse
            loss = log_sum_exp + (1.0 - label_smoothing) * (shift - z_target) + z_loss
            if HAS_SMOOTHING:
                loss += label_smoothing * (shift - sum_z / n_cols)
            tl.store(LOSS + row, loss)
            if STORE_Z_LOSS:
                tl.store(Z_LOSS + row, z_loss)

            # The gradient's factors (logits_grad): dloss/dz = p·(1 + 2·s·lse) − ε/V − (1 − ε)·[j = t],
            # times the reduction's factor, with p = exp(z − shift) / sum_exp.
            prob_scale = grad_scale * (1.0 + 2.0 * lse_square_scale * lse) / sum_exp
            smoothing_grad = grad_scale * label_smoothing / n_cols
            target_grad = grad_scale * (1.0 - label_smoothing)
            if STORE_ROW_STATS:
                tl.store(ROW_STATS + row, shift)
                tl.store(ROW_STATS + stride_row_stats + row, prob_scale)
                tl.store(ROW_STATS + 2 * stride_row_stats + row, smoothing_grad)
                tl.store(ROW_STATS + 3 * stride_row_stats + row, target_grad)
                # The row's largest |gradient| (over the factor), exactly where the target's entry
                # is the largest, as it is unless the row is confident: the target's entry
                # p_t·c − ε/V − (1 − ε) with c = 1 + 2·s·lse, and at most the larger of the
                # others' extremes p·c − ε/V at p = 1 / sum_exp (the largest p) and p = 0 (a
                # softcap's 1 − tanh² only shrinks them).
                spread = 1.0 + 2.0 * lse_square_scale * lse
                p_target = tl.exp2((z_target - shift) * LOG2E) / sum_exp
                target_term = tl.abs(p_target * spread - label_smoothing / n_cols - (1.0 - label_smoothing))
                if HAS_SOFTCAP:
                    target_term *= 1.0 - (z_target / softcap) * (z_target / softcap)
                other_term = tl.maximum(tl.abs(spread / sum_exp - label_smoothing / n_cols), label_smoothing / n_cols)
                tl.atomic_max(GRAD_BOUND, tl.abs(grad_scale) * tl.maximum(target_term, other_term))

            if COMPUTE_GRAD:
                # Pass 2, walking the row backwards: the blocks pass 1 read last are the likeliest
                # to still be in L2.
                grad_row = GRAD + tl.cast(row, tl.int64) * stride_grad
                for block in range(0, n_blocks):
                    offs = (n_blocks - 1 - block) * BLOCK_V + cols
                    mask = offs < n_cols
                    z = tl.load(logits_row + offs, mask=mask, other=0.0, eviction_policy="evict_first")
                    grad = logits_grad(z, offs, target, shift, prob_scale, smoothing_grad, target_grad, softcap,
                                       HAS_SOFTCAP)
                    tl.store(grad_row + offs, grad.to(GRAD.dtype.element_ty), mask=mask)


@triton.jit
def cross_entropy_bwd_kernel(
    GRAD, GRAD_OUTPUT,
    n_rows, n_cols,
    stride_grad, stride_grad_output,
    KEEP_ZEROS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_programs):
        grad_output = tl.load(GRAD_OUTPUT + row * stride_grad_output).to(tl.float32)
        # loss.backward() sends exactly 1: the stored gradient is then already final, and the
        # common step skips a read and a write of the whole [N, V] gradient.
        if grad_output != 1.0:
            grad_row = GRAD + tl.cast(row, tl.int64) * stride_grad
            for start in range(0, n_cols, BLOCK_V):
                offs = start + cols
                mask = offs < n_cols
                grad = tl.load(grad_row + offs, mask=mask, other=0.0).to(tl.float32)
                scaled = grad * grad_output
                if KEEP_ZEROS:
                    # A zero stays zero, as autograd's gradient of an ignored row does whatever
                    # grad_output is: an infinite one (a sum divided by num_items_in_batch = 0, as
                    # transformers' loss does) would otherwise make 0 · inf = NaN.
                    scaled = tl.where(grad == 0.0, 0.0, scaled)
                tl.store(grad_row + offs, scaled.to(GRAD.dtype.element_ty), mask=mask)


def vocab_row_geometry(n_rows: int, n_cols: int, element_size: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_V, num_warps, n_programs)`` for the row-looping kernels of this family."""
    block_v, num_warps = row_launch_config(min(n_cols, MAX_BLOCK_BYTES // element_size), element_size)
    n_programs = max(1, min(n_rows, num_programs_for(device, PROGRAMS_PER_SM)))
    return block_v, num_warps, n_programs


def launch_cross_entropy_fwd(
    logits: torch.Tensor, target: torch.Tensor, grad: torch.Tensor | None, grad_scale: torch.Tensor | None,
    loss: torch.Tensor, z_loss: torch.Tensor | None,
    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float | None,
    row_stats: torch.Tensor | None = None, grad_bound: torch.Tensor | None = None,
) -> None:
    """Write the per-row loss and, when ``grad`` is given, the gradient of the loss.

    Args:
        logits: ``[N, V]`` with unit column stride, any row stride.
        target: ``[N]`` int64/int32, any stride; rows whose target is ``ignore_index`` or outside
            ``[0, V)`` get zero loss and gradient.
        grad: ``[N, V]`` in the logits' dtype with unit column stride (it may be ``logits``
            itself), or ``None`` for the loss only.
        grad_scale: fp32 factor of the gradient, ``[1]`` for every row or ``[N]`` per row, or
            ``None`` for 1.
        loss, z_loss: ``[N]`` fp32 outputs; ``z_loss`` (``s·lse²``, included in ``loss``) may be
            ``None``.
        row_stats, grad_bound: with the loss only, fp32 ``[4, N]`` (unit column stride) and the
            zero-initialised ``[1]``: what :func:`logits_grad` takes of each row, and a bound on
            the gradient's largest magnitude, for a later kernel that writes the gradient.
    """
    n_rows, n_cols = logits.shape
    block_v, num_warps, n_programs = vocab_row_geometry(n_rows, n_cols, logits.element_size(), logits.device)
    cross_entropy_fwd_kernel[(n_programs,)](
        logits, target, grad, grad_scale, loss, z_loss, row_stats, grad_bound,
        n_rows, n_cols,
        logits.stride(0), target.stride(0), 0 if grad is None else grad.stride(0),
        0 if grad_scale is None or grad_scale.numel() == 1 else grad_scale.stride(0),
        0 if row_stats is None else row_stats.stride(0),
        ignore_index, label_smoothing, lse_square_scale, 1.0 if softcap is None else softcap,
        HAS_SMOOTHING=label_smoothing > 0.0, HAS_SOFTCAP=softcap is not None, STORE_Z_LOSS=z_loss is not None,
        COMPUTE_GRAD=grad is not None, HAS_GRAD_SCALE=grad_scale is not None, STORE_ROW_STATS=row_stats is not None,
        BLOCK_V=block_v, num_warps=num_warps,
    )


def target_bounds(target: torch.Tensor, ignore_index: int | None):
    """The range of the targets other than ``ignore_index`` (of every target for ``None``) on its
    way to the host (:func:`~tigon.ops._launch.range_to_host`); ``None`` where no host sync is
    allowed (:func:`~tigon.ops._launch.host_sync_allowed`) or there are no targets. Queue the loss's
    kernels before :func:`check_target_bounds` waits for it: the GPU then runs them while the host
    waits (they treat an out-of-range target as ignored, so they read only valid memory)."""
    if target.numel() == 0 or not host_sync_allowed(target):
        return None
    return range_to_host(target if ignore_index is None else torch.where(target != ignore_index, target, 0))


def check_target_bounds(bounds, n_classes: int, ignore_index: int | None, name: str = "target") -> None:
    """Raise ``ValueError`` when the bounds from :func:`target_bounds` leave ``[0, n_classes)``,
    naming the caller's argument ``name``."""
    if bounds is None:
        return
    lowest, highest = read_range(bounds)
    bad = lowest if lowest < 0 else highest if highest >= n_classes else None
    if bad is not None:
        unless = "" if ignore_index is None else f", and is not ignore_index ({ignore_index})"
        raise ValueError(
            f"{name} contains {bad}, outside [0, V) for the vocabulary size V = {n_classes}{unless}"
        )


def check_targets(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """:func:`target_bounds` then :func:`check_target_bounds` at once, for callers with no kernels
    to queue in between: a host sync where one is allowed, nothing otherwise."""
    check_target_bounds(target_bounds(target, ignore_index), n_classes, ignore_index)


def count_valid(target: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor:
    """``n_valid``: how many targets lie in ``[0, n_classes)`` and are not ``ignore_index``, as an
    int64 scalar on the targets' device (the rows the kernels do not ignore)."""
    valid = (target >= 0) & (target < n_classes)
    if 0 <= ignore_index < n_classes:
        valid &= target != ignore_index
    return valid.sum()


def mean_grad_scale(n_valid: torch.Tensor, numerator: float = 1.0) -> torch.Tensor:
    """``[1]`` fp32 device tensor ``numerator / max(n_valid, 1)``: the gradient factor of ``"mean"``.
    With no valid row every gradient row is zero whatever the factor; the clamp keeps it finite, so
    those rows stay 0 (PyTorch's gradient there) rather than 0 · inf = NaN."""
    return (numerator / n_valid.clamp(min=1).to(torch.float32)).reshape(1)


def reduce_rows(per_row: torch.Tensor, reduction: str, n_valid: torch.Tensor | None) -> torch.Tensor:
    """``[N]`` fp32 per-row values → the reduced scalar (or ``[N]`` for ``"none"``); ``"mean"``
    divides on the device by ``n_valid``: NaN (0 / 0) when no row is valid, as PyTorch's mean."""
    if reduction == "none":
        return per_row
    total = per_row.sum()
    return total / n_valid if reduction == "mean" else total


def _loss_outputs_fake(n_rows: int, reduction: str, return_z_loss: bool, like: torch.Tensor):
    shape = (n_rows,) if reduction == "none" else ()
    loss = like.new_empty(shape, dtype=torch.float32)
    return loss, like.new_empty(shape if return_z_loss else (0,), dtype=torch.float32)


def _cross_entropy_into(
    logits2d, target, grad, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss,
):
    """Count the valid targets (for ``"mean"``), launch the kernel (gradient into ``grad`` unless
    ``None``), reduce."""
    target = target.reshape(-1)
    n_rows = target.numel()
    n_valid = count_valid(target, logits2d.shape[1], ignore_index) if reduction == "mean" else None
    grad_scale = mean_grad_scale(n_valid) if n_valid is not None and grad is not None else None
    loss = logits2d.new_empty(n_rows, dtype=torch.float32)
    z_loss = torch.empty_like(loss) if return_z_loss else None
    launch_cross_entropy_fwd(
        logits2d, target, grad, grad_scale, loss, z_loss, ignore_index, label_smoothing, lse_square_scale, softcap,
    )
    loss = reduce_rows(loss, reduction, n_valid)
    return loss, reduce_rows(z_loss, reduction, n_valid) if return_z_loss else loss.new_empty(0)


def _fwd_fake(logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss,
              compute_grad):
    n_rows = target.numel()
    grad = logits.new_empty((n_rows, logits.shape[-1]) if compute_grad else (0,))
    return *_loss_outputs_fake(n_rows, reduction, return_z_loss, logits), grad


@tigon_op("cross_entropy_fwd", fake=_fwd_fake)
def cross_entropy_fwd(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
    lse_square_scale: float, softcap: float | None, return_z_loss: bool, compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [..., V]``, ``target [...]`` → ``loss`` (fp32 scalar, or ``[N]`` for ``"none"``),
    ``z_loss`` (same shape; empty unless ``return_z_loss``) and the gradient ``[N, V]`` in a fresh
    contiguous tensor (empty unless ``compute_grad``)."""
    logits2d = as_rows(logits)
    grad = torch.empty(logits2d.shape, dtype=logits.dtype, device=logits.device) if compute_grad else None
    loss, z_loss = _cross_entropy_into(
        logits2d, target, grad, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss,
    )
    return loss, z_loss, grad if compute_grad else logits.new_empty(0)


def _fwd_inplace_fake(logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                      return_z_loss):
    return _loss_outputs_fake(target.numel(), reduction, return_z_loss, logits)


@tigon_op("cross_entropy_fwd_inplace", mutates_args=("logits",), fake=_fwd_inplace_fake)
def cross_entropy_fwd_inplace(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
    lse_square_scale: float, softcap: float | None, return_z_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`cross_entropy_fwd`, but the gradient overwrites ``logits [N, V]`` (unit column
    stride, any row stride), which therefore costs no extra memory."""
    return _cross_entropy_into(
        logits, target, logits, ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss,
    )


@tigon_op("cross_entropy_bwd", mutates_args=("grad",))
def cross_entropy_bwd(grad: torch.Tensor, grad_output: torch.Tensor, keep_zeros: bool = False) -> None:
    """``grad [R, C] *= grad_output`` in place, with ``grad_output`` fp32 ``[1]`` (every row) or
    ``[R]`` (per row); rows whose factor is exactly 1 are not touched. With ``keep_zeros`` zero
    entries stay zero even for an infinite or NaN factor (the cross entropy's ignored rows);
    without, a NaN factor reaches every entry (the log-probs head's broken-promise signal)."""
    n_rows, n_cols = grad.shape
    block_v, num_warps, n_programs = vocab_row_geometry(n_rows, n_cols, grad.element_size(), grad.device)
    cross_entropy_bwd_kernel[(n_programs,)](
        grad, grad_output,
        n_rows, n_cols,
        grad.stride(0), 0 if grad_output.numel() == 1 else grad_output.stride(0),
        KEEP_ZEROS=keep_zeros, BLOCK_V=block_v, num_warps=num_warps,
    )


class CrossEntropyFunction(torch.autograd.Function):
    """Saves only the gradient computed by the forward pass (or nothing when no gradient is
    needed); backward scales it by ``grad_output`` in place, so it runs once per forward."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                return_z_loss, inplace_backward, compute_grad):
        options = (ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss)
        if compute_grad and inplace_backward:
            # A view of the caller's logits when one exists; otherwise the contiguous copy is
            # the buffer that receives the gradient. Viewed through detach(): a saved view of a
            # tensor that requires grad could not be unpacked once the op has written into it.
            grad = as_rows(logits.detach())
            loss, z_loss = cross_entropy_fwd_inplace(grad, target, *options)
        else:
            loss, z_loss, grad = cross_entropy_fwd(logits, target, *options, compute_grad)
        ctx.save_for_backward(grad)
        ctx.logits_shape = logits.shape
        ctx.mark_non_differentiable(z_loss)
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss):
        (grad,) = ctx.saved_tensors
        cross_entropy_bwd(grad, grad_loss.reshape(-1), keep_zeros=True)
        return grad.view(ctx.logits_shape), None, None, None, None, None, None, None, None, None


def cross_entropy(logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                  return_z_loss, inplace_backward):
    """``logits [..., V]``, ``target [...]`` → the fp32 loss (and z-loss); inputs validated by
    :mod:`tigon.functional`, the targets' range here, once the kernels are queued."""
    # Known here, not inside forward (which always runs without grad mode), so that a loss
    # computed under torch.no_grad() neither pays for nor writes a gradient.
    compute_grad = logits.requires_grad and torch.is_grad_enabled()
    bounds = target_bounds(target, ignore_index)
    loss, z_loss = CrossEntropyFunction.apply(
        logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
        return_z_loss, inplace_backward, compute_grad,
    )
    check_target_bounds(bounds, logits.shape[-1], ignore_index)
    return shaped_losses(loss, z_loss, target, reduction, return_z_loss)


def shaped_losses(loss, z_loss, target, reduction, return_z_loss):
    """The per-token ``[N]`` losses of ``"none"`` viewed as ``target``'s shape. Done outside the
    autograd functions: torch 2.11's AOTAutograd fails to trace a function that returns a view
    next to an output marked non-differentiable."""
    if reduction == "none":
        loss = loss.view(target.shape)
        z_loss = z_loss.view(target.shape) if return_z_loss else z_loss
    return (loss, z_loss) if return_z_loss else loss
