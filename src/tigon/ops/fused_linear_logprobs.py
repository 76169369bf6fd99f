"""Per-token log-probabilities of ``x @ Wᵀ (+ b)``, and their entropy, without the ``[N, V]`` logits.

This is the contract of TRL's fused LM head, on which TRL's trainers (SFT, DPO, KTO, GRPO, RLOO)
compute every loss. Per row, from the logits ``y`` and the head's transform::

    z           = softcap · tanh(logit_scale · y / softcap) / temperature    (no tanh without softcap)
    lse         = log Σ_j exp(z_j),   p = softmax(z)
    log_prob    = z_t − lse
    entropy     = −Σ_j p_j log p_j = lse − Σ_j p_j z_j
    log_sum_sq  = log Σ_j p_j² = log Σ_j exp(2(z_j − m)) − 2 log Σ_j exp(z_j − m)   (any shift m)
    mean_logit  = Σ_j z_j / V
    is_top1     = t is the first index where z is largest (``argmax``'s rule for ties)

all in one online pass over each row; rows whose target is ``ignore_index`` give 0 (False) and no
gradient. So do rows whose target is outside ``[0, V)``, for which the host raises ``ValueError``
once the kernels are queued, except under CUDA-graph capture and torch.compile, where nothing waits
for the GPU (as in :mod:`tigon.ops.cross_entropy`). Only ``log_prob`` and ``entropy`` carry
gradients. With upstream gradients ``g`` (of ``log_prob``) and ``h`` (of ``entropy``), per row::

    dL/dz_j = g·([j = t] − p_j) − h·p_j·(log p_j + entropy)

The first term is d(z_t − lse)/dz_j (``p_j`` is d lse/dz_j). The second follows from
dp_k/dz_j = p_k([k = j] − p_j): d(−Σ_k p_k log p_k)/dz_j = −Σ_k (log p_k + 1)·p_k([k = j] − p_j)
= −p_j (log p_j + 1) + p_j Σ_k p_k (log p_k + 1) = −p_j (log p_j + entropy). The transform's chain
rule multiplies by dz/dy = logit_scale · (1 − tanh²) / temperature.

``g`` and ``h`` exist only after the caller's loss has read the forward's outputs, so backward
recomputes each chunk's logits (the chunk loop of :mod:`tigon.ops.fused_linear`): ``8·N·H·V``
matmul FLOPs in all, where the fused linear cross entropy, whose gradient is known in forward,
needs ``6·N·H·V``. The forward's logits buffer is kept for backward, which starts with the last
chunk, whose logits it still holds: ``C`` fewer rows to recompute, at no extra peak memory (the
buffer is the one backward would allocate), and no recomputation at all when ``N ≤ C``. ``grad_in_forward=True`` is for callers whose loss is a sum or mean of the
log-probs, as SFT's: the forward then computes the gradients for ``g = 1`` in its chunk loop
(``6·N·H·V``, what the fused linear cross entropy costs) and backward multiplies them by ``g``,
provided that ``g`` is the same on every non-ignored row and ``entropy`` has no gradient. If not,
backward recomputes as above: the result is exact either way, the guess only costs time. Checking
``g`` takes one host sync in backward. Where the host may not wait (CUDA-graph capture,
torch.compile) the promise is checked on the device instead, and a broken one makes the gradients
NaN rather than silently wrong: the graph then runs the kernels an eager uniform ``g`` runs, which
its warm-up has compiled. With a single chunk the option is ignored: the kept logits already make
backward recompute nothing.

:class:`FusedLinearLogprobLossFunction` serves losses whose per-token gradients are known once
the log-probs are (the GRPO family, :mod:`tigon.losses.grpo`): the loss is computed inside, chunk
by chunk, and so are its gradients, in ``6·N·H·V`` FLOPs. Chunks split a sequence where each
token's loss needs only its own log-prob; a loss that needs a whole sequence's log-probs takes
chunks of whole sequences, or two passes over the rows when one sequence exceeds the budget.

Shapes: ``input [N, H]`` (any row stride), ``weight [V, H]``, ``bias [V]`` or ``None``, one of
fp32/bf16/fp16; ``target [N]`` int64/int32. Outputs are fp32 ``[N]``, ``is_top1`` bool ``[N]``.
Extra memory: one chunk of logits (``chunk_memory_bytes``) and the gradients themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
import triton
import triton.language as tl

from tigon.ops._launch import as_rows, host_sync_allowed, tigon_op
from tigon.ops.cross_entropy import (
    LOG2E,
    check_target_bounds,
    cross_entropy_bwd,
    softcapped,
    store_zero_row,
    target_bounds,
    vocab_row_geometry,
)
from tigon.ops.fused_linear import (
    GradInputSum,
    chunk_rows_for,
    fused_linear_chunks,
    head_matmuls,
    new_grads,
    row_chunks,
)
from tigon.ops.fused_linear_preference import scaled_grads

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@triton.jit
def scaled_softcapped(y, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """``logit_scale · y``, softcapped: the log-probs head's ``z`` before the temperature."""
    capped = y * logit_scale
    if HAS_SOFTCAP:
        capped = softcapped(capped, softcap)
    return capped


@triton.jit
def online_row_stats(
    logits_row, n_cols, first_col, target, logit_scale, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, SUM_EXP_DZ: tl.constexpr, SUM_EXP_SQ: tl.constexpr, SUM_Z: tl.constexpr,
    MAX_BEFORE_TARGET: tl.constexpr, EVICTION: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One pass over a row of logits ``y`` (``n_cols`` of them, the first at the vocabulary's
    index ``first_col``) → ``(running_max, shift, sum_exp, sum_exp_dz, sum_exp_sq, sum_z,
    max_before_target)`` of ``z = scaled_softcapped(y) · inv_temperature``; the sums not asked
    for stay 0 (``max_before_target`` −inf).

    The statistics are relative to a shift: the running max, or 0 while every z seen is −inf.
    sum_exp = Σ e, e = exp(z − shift); sum_exp_dz = Σ e·(z − shift), kept relative to the shift
    (not Σ e·z) so that the entropy, log Σe − sum_exp_dz / sum_exp, does not subtract two large
    numbers; sum_exp_sq = Σ e²; sum_z = Σ z; max_before_target: the largest z at an index below
    ``target`` (argmax's first-index rule for ties)."""
    cols = tl.arange(0, BLOCK_V)
    running_max = tl.full((), float("-inf"), tl.float32)
    shift = tl.zeros((), tl.float32)
    sum_exp = tl.zeros((), tl.float32)
    sum_exp_dz = tl.zeros((), tl.float32)
    sum_exp_sq = tl.zeros((), tl.float32)
    sum_z = tl.zeros((), tl.float32)
    max_before_target = tl.full((), float("-inf"), tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        mask = offs < n_cols
        y = tl.load(logits_row + offs, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
        z = scaled_softcapped(y, logit_scale, softcap, HAS_SOFTCAP) * inv_temperature
        z = tl.where(mask, z, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2((running_max - new_shift) * LOG2E)
        e = tl.exp2((z - new_shift) * LOG2E)
        if SUM_EXP_DZ:
            # Each earlier term's (z − shift) becomes (z − new_shift) = (z − shift) + (shift − new_shift).
            sum_exp_dz = (sum_exp_dz + (shift - new_shift) * sum_exp) * rescale
            sum_exp_dz += tl.sum(e * tl.where(e > 0.0, z - new_shift, 0.0), axis=0)
        if SUM_EXP_SQ:
            sum_exp_sq = sum_exp_sq * rescale * rescale + tl.sum(e * e, axis=0)
        if SUM_Z:
            sum_z += tl.sum(tl.where(mask, z, 0.0), axis=0)
        if MAX_BEFORE_TARGET:
            max_before_target = tl.maximum(
                max_before_target, tl.max(tl.where(first_col + offs < target, z, float("-inf")), axis=0)
            )
        sum_exp = sum_exp * rescale + tl.sum(e, axis=0)
        running_max = new_max
        shift = new_shift
    return running_max, shift, sum_exp, sum_exp_dz, sum_exp_sq, sum_z, max_before_target


@triton.jit
def softmax_grad_row(
    logits_row, grad_row, n_cols, target, lse, entropy, prob_coef, target_coef, uniform, grad_entropy,
    logit_scale, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_UNIFORM: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Write ``dL/dy`` of one row whose gradient is, with ``p = exp(z − lse)``::

        dL/dz_j = p_j·a − [j = t]·c − u − h·p_j·(log p_j + H)

    (``a = prob_coef``, ``c = target_coef``, ``u = uniform``, ``h = grad_entropy``, ``H =
    entropy``), times ``dz/dy``. The log-probs' gradient for an upstream ``g`` (see the module
    docstring) is ``a = c = −g``, ``u = 0``; the cross entropy's (label smoothing ε, z-loss s) is
    ``a = 1 + 2·s·lse``, ``c = 1 − ε``, ``u = ε/V``, ``h = 0``. ``target`` outside ``[0, n_cols)``
    meets no column (a vocabulary shard without it); ``grad_row`` may be ``logits_row``. The row
    is walked backwards: the blocks read last by the pass before are the likeliest to be in L2."""
    cols = tl.arange(0, BLOCK_V)
    n_blocks = tl.cdiv(n_cols, BLOCK_V)
    for block in range(0, n_blocks):
        offs = (n_blocks - 1 - block) * BLOCK_V + cols
        mask = offs < n_cols
        y = tl.load(logits_row + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        capped = scaled_softcapped(y, logit_scale, softcap, HAS_SOFTCAP)
        log_p = capped * inv_temperature - lse
        p = tl.exp2(log_p * LOG2E)
        grad = p * prob_coef - tl.where(offs == target, target_coef, 0.0)
        if HAS_UNIFORM:
            grad -= uniform
        if HAS_ENTROPY_GRAD:
            # p·log p → 0 as p → 0 (a logit of −inf): no 0·(−inf).
            grad -= grad_entropy * p * tl.where(p > 0.0, log_p + entropy, 0.0)
        grad = grad * (logit_scale * inv_temperature)
        if HAS_SOFTCAP:
            tanh = capped / softcap
            grad = grad * (1.0 - tanh * tanh)
        tl.store(grad_row + offs, grad.to(grad_row.dtype.element_ty), mask=mask)


@triton.jit
def logprobs_fwd_kernel(
    LOGITS, TARGET, LOG_PROB, LSE, ENTROPY, LOG_SUM_SQ, MEAN_LOGIT, IS_TOP1, GRAD,
    n_rows, n_cols,
    stride_logits, stride_target, stride_grad,
    ignore_index, logit_scale, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, STORE_ENTROPY: tl.constexpr, STORE_LOG_SUM_SQ: tl.constexpr,
    STORE_MEAN_LOGIT: tl.constexpr, STORE_IS_TOP1: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Persistent grid: program p handles rows p, p + P, ...; GRAD may be LOGITS itself.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    for row in range(pid, n_rows, n_programs):
        logits_row = LOGITS + tl.cast(row, tl.int64) * stride_logits
        target = tl.load(TARGET + row * stride_target)
        # A target outside [0, V) is ignored: the host raises for it, after this kernel is queued.
        if (target == ignore_index) | (target < 0) | (target >= n_cols):
            tl.store(LOG_PROB + row, 0.0)
            tl.store(LSE + row, 0.0)
            if STORE_ENTROPY:
                tl.store(ENTROPY + row, 0.0)
            if STORE_LOG_SUM_SQ:
                tl.store(LOG_SUM_SQ + row, 0.0)
            if STORE_MEAN_LOGIT:
                tl.store(MEAN_LOGIT + row, 0.0)
            if STORE_IS_TOP1:
                tl.store(IS_TOP1 + row, 0)
            if COMPUTE_GRAD:
                store_zero_row(GRAD + tl.cast(row, tl.int64) * stride_grad, n_cols, BLOCK_V)
        else:
            y_target = tl.load(logits_row + target).to(tl.float32)
            z_target = scaled_softcapped(y_target, logit_scale, softcap, HAS_SOFTCAP) * inv_temperature
            # The row's logits stay in L2 for the gradient pass (evict_last).
            running_max, shift, sum_exp, sum_exp_dz, sum_exp_sq, sum_z, max_before_target = online_row_stats(
                logits_row, n_cols, 0, target, logit_scale, softcap, inv_temperature, HAS_SOFTCAP, STORE_ENTROPY,
                STORE_LOG_SUM_SQ, STORE_MEAN_LOGIT, STORE_IS_TOP1, "evict_last", BLOCK_V,
            )
            log_sum_exp = tl.log(sum_exp)
            lse = shift + log_sum_exp
            tl.store(LOG_PROB + row, (z_target - shift) - log_sum_exp)
            tl.store(LSE + row, lse)
            if STORE_ENTROPY:
                tl.store(ENTROPY + row, log_sum_exp - sum_exp_dz / sum_exp)
            if STORE_LOG_SUM_SQ:
                tl.store(LOG_SUM_SQ + row, tl.log(sum_exp_sq) - 2.0 * log_sum_exp)
            if STORE_MEAN_LOGIT:
                tl.store(MEAN_LOGIT + row, sum_z / n_cols)
            if STORE_IS_TOP1:
                is_top1 = (z_target >= running_max) & (z_target > max_before_target)
                tl.store(IS_TOP1 + row, is_top1.to(tl.int8))
            if COMPUTE_GRAD:
                # The gradient of Σ log_prob: g = 1.
                softmax_grad_row(
                    logits_row, GRAD + tl.cast(row, tl.int64) * stride_grad, n_cols, target, lse, 0.0, -1.0, -1.0,
                    0.0, 0.0, logit_scale, softcap, inv_temperature, HAS_SOFTCAP, False, False, BLOCK_V,
                )


@triton.jit
def logprobs_bwd_kernel(
    LOGITS, TARGET, LSE, ENTROPY, GRAD_LOG_PROB, GRAD_ENTROPY,
    n_rows, n_cols,
    stride_logits, stride_target,
    ignore_index, logit_scale, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # dL/dy written over the recomputed logits, row by row (persistent grid).
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    for row in range(pid, n_rows, n_programs):
        logits_row = LOGITS + tl.cast(row, tl.int64) * stride_logits
        target = tl.load(TARGET + row * stride_target)
        if (target == ignore_index) | (target < 0) | (target >= n_cols):
            store_zero_row(logits_row, n_cols, BLOCK_V)
        else:
            grad_entropy = 0.0
            entropy = 0.0
            if HAS_ENTROPY_GRAD:
                grad_entropy = tl.load(GRAD_ENTROPY + row)
                entropy = tl.load(ENTROPY + row)
            minus_grad_log_prob = -tl.load(GRAD_LOG_PROB + row)
            softmax_grad_row(
                logits_row, logits_row, n_cols, target, tl.load(LSE + row), entropy, minus_grad_log_prob,
                minus_grad_log_prob, 0.0, grad_entropy, logit_scale, softcap, inv_temperature, HAS_SOFTCAP, False,
                HAS_ENTROPY_GRAD, BLOCK_V,
            )


def transform_args(temperature: float, softcap: float | None, logit_scale: float) -> dict:
    """The kernel arguments of the logits' transform ``z = softcap·tanh(logit_scale·y / softcap) /
    temperature`` (the log-probs head's; the cross entropy's is ``logit_scale = temperature = 1``)."""
    return {
        "logit_scale": logit_scale, "softcap": 1.0 if softcap is None else softcap,
        "inv_temperature": 1.0 / temperature, "HAS_SOFTCAP": softcap is not None,
    }


def launch_logprobs_fwd(logits, target, outputs, grad, ignore_index, temperature, softcap, logit_scale):
    """Write the per-row fields ``outputs`` (``log_prob, lse, entropy, log_sum_sq, mean_logit,
    is_top1``: ``[C]`` tensors, ``None`` where not wanted) of ``logits [C, V]`` (unit column
    stride) and, when ``grad`` is given, ``dlog_prob/dy`` into it (it may be ``logits``)."""
    n_rows, n_cols = logits.shape
    block_v, num_warps, n_programs = vocab_row_geometry(n_rows, n_cols, logits.element_size(), logits.device)
    log_prob, lse, entropy, log_sum_sq, mean_logit, is_top1 = outputs
    logprobs_fwd_kernel[(n_programs,)](
        logits, target, log_prob, lse, entropy, log_sum_sq, mean_logit, is_top1, grad,
        n_rows, n_cols,
        logits.stride(0), target.stride(0), 0 if grad is None else grad.stride(0),
        ignore_index, **transform_args(temperature, softcap, logit_scale),
        STORE_ENTROPY=entropy is not None, STORE_LOG_SUM_SQ=log_sum_sq is not None,
        STORE_MEAN_LOGIT=mean_logit is not None, STORE_IS_TOP1=is_top1 is not None, COMPUTE_GRAD=grad is not None,
        BLOCK_V=block_v, num_warps=num_warps,
    )


def launch_logprobs_bwd(logits, target, lse, entropy, grad_log_prob, grad_entropy, ignore_index, temperature,
                        softcap, logit_scale):
    """``logits [C, V]`` ← ``dL/dy`` for the upstream ``grad_log_prob [C]`` and ``grad_entropy [C]``
    (or ``None``), fp32."""
    n_rows, n_cols = logits.shape
    block_v, num_warps, n_programs = vocab_row_geometry(n_rows, n_cols, logits.element_size(), logits.device)
    logprobs_bwd_kernel[(n_programs,)](
        logits, target, lse, entropy, grad_log_prob, grad_entropy,
        n_rows, n_cols,
        logits.stride(0), target.stride(0),
        ignore_index, **transform_args(temperature, softcap, logit_scale),
        HAS_ENTROPY_GRAD=grad_entropy is not None, BLOCK_V=block_v, num_warps=num_warps,
    )


def _grads_out(x2d, bias, grad_input, grad_weight, grad_bias):
    """The gradients as op outputs, a distinct empty tensor where one was not computed."""
    return (
        x2d.new_empty(0) if grad_input is None else grad_input,
        x2d.new_empty(0) if grad_weight is None else grad_weight,
        x2d.new_empty(0) if grad_bias is None else grad_bias.to(bias.dtype),
    )


def _grads_fake(input, weight, grad_input_needed, grad_weight_needed, grad_bias_needed):
    return (
        input.new_empty(tuple(input.shape) if grad_input_needed else (0,)),
        weight.new_empty(tuple(weight.shape) if grad_weight_needed else (0,)),
        input.new_empty((weight.shape[0],) if grad_bias_needed else (0,)),
    )


def _fwd_fake(input, weight, target, bias, ignore_index, temperature, softcap, logit_scale, store_entropy,
              store_log_sum_sq, store_mean_logit, store_is_top1, chunk_rows, grad_input_needed, grad_weight_needed,
              grad_bias_needed, keep_logits, fp8=None):
    n_rows = input.shape[0]

    def field(stored, dtype=torch.float32):
        return input.new_empty(n_rows if stored else 0, dtype=dtype)

    kept_rows = min(chunk_rows, n_rows) if keep_logits else 0
    return (
        field(True), field(True), field(store_entropy), field(store_log_sum_sq), field(store_mean_logit),
        field(store_is_top1, torch.bool),
        *_grads_fake(input, weight, grad_input_needed, grad_weight_needed, grad_bias_needed),
        input.new_empty((kept_rows, weight.shape[0]) if keep_logits else (0,)),
    )


@tigon_op("fused_linear_logprobs_fwd", fake=_fwd_fake)
def fused_linear_logprobs_fwd(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ignore_index: int, temperature: float, softcap: float | None, logit_scale: float,
    store_entropy: bool, store_log_sum_sq: bool, store_mean_logit: bool, store_is_top1: bool,
    chunk_rows: int, grad_input_needed: bool, grad_weight_needed: bool, grad_bias_needed: bool, keep_logits: bool,
    fp8: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input [N, H]`` (unit column stride), ``weight [V, H]``, ``target [N]`` → ``log_prob``,
    ``lse``, ``entropy``, ``log_sum_sq``, ``mean_logit`` (fp32 ``[N]``), ``is_top1`` (bool ``[N]``),
    each empty unless stored, the gradients ``grad_input [N, H]``, ``grad_weight [V, H]``,
    ``grad_bias [V]`` of ``Σ log_prob`` (empty unless needed) and, with ``keep_logits``, the logits
    buffer ``[min(C, N), V]``, which holds the last chunk's logits in its first rows; the matmuls
    in FP8 by the recipe ``fp8`` unless ``None`` (:mod:`tigon.ops.fp8`)."""
    n_rows = input.shape[0]
    grad_input, grad_weight, grad_bias = new_grads(
        input, weight, grad_input_needed, grad_weight_needed, grad_bias_needed,
    )
    compute_grad = grad_input_needed or grad_weight_needed or grad_bias_needed
    stored = (True, True, store_entropy, store_log_sum_sq, store_mean_logit)
    fields = [input.new_empty(n_rows if store else 0, dtype=torch.float32) for store in stored]
    fields.append(torch.empty(n_rows if store_is_top1 else 0, dtype=torch.bool, device=input.device))
    wanted = [field if field.numel() == n_rows else None for field in fields]
    # Triton has no bool pointers: is_top1 is written through an int8 view of the same bytes.
    if wanted[5] is not None:
        wanted[5] = wanted[5].view(torch.int8)

    def logprobs_head(ranges, logits):
        ((start, end),) = ranges
        launch_logprobs_fwd(
            logits, target[start:end], [None if f is None else f[start:end] for f in wanted],
            logits if compute_grad else None, ignore_index, temperature, softcap, logit_scale,
        )

    logits_buffer = input.new_empty((min(chunk_rows, n_rows), weight.shape[0]))
    fused_linear_chunks(
        input, weight, bias, row_chunks(n_rows, chunk_rows), logprobs_head, grad_input, grad_weight, grad_bias,
        logits_buffer=logits_buffer, matmuls=head_matmuls(weight, fp8, grad_input_needed, grad_weight_needed),
    )
    kept = logits_buffer if keep_logits else input.new_empty(0)
    return (*fields, *_grads_out(input, bias, grad_input, grad_weight, grad_bias), kept)


def _bwd_fake(grad_log_prob, grad_entropy, input, weight, target, bias, lse, entropy, logits_buffer, ignore_index,
              temperature, softcap, logit_scale, chunk_rows, grad_input_needed, grad_weight_needed, grad_bias_needed,
              fp8=None):
    return _grads_fake(input, weight, grad_input_needed, grad_weight_needed, grad_bias_needed)


@tigon_op("fused_linear_logprobs_bwd", mutates_args=("logits_buffer",), fake=_bwd_fake)
def fused_linear_logprobs_bwd(
    grad_log_prob: torch.Tensor, grad_entropy: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
    target: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor, entropy: torch.Tensor,
    logits_buffer: torch.Tensor, ignore_index: int, temperature: float, softcap: float | None, logit_scale: float,
    chunk_rows: int, grad_input_needed: bool, grad_weight_needed: bool, grad_bias_needed: bool,
    fp8: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turns each chunk's logits into ``dL/dy`` for the upstream fp32 ``grad_log_prob [N]`` and
    ``grad_entropy [N]`` (empty: no entropy gradient), in the forward's ``logits_buffer``: the last
    chunk's logits, still there, first, then the others recomputed. An empty ``logits_buffer``
    (the forward's held gradients) means every chunk is recomputed. Returns the gradients as the
    forward op does."""
    grad_input, grad_weight, grad_bias = new_grads(
        input, weight, grad_input_needed, grad_weight_needed, grad_bias_needed,
    )
    has_entropy_grad = grad_entropy.numel() > 0

    def logprobs_grad_head(ranges, logits):
        ((start, end),) = ranges
        launch_logprobs_bwd(
            logits, target[start:end], lse[start:end], entropy[start:end] if has_entropy_grad else None,
            grad_log_prob[start:end], grad_entropy[start:end] if has_entropy_grad else None,
            ignore_index, temperature, softcap, logit_scale,
        )

    chunks = row_chunks(input.shape[0], chunk_rows)
    kept = logits_buffer.numel() > 0
    fused_linear_chunks(
        input, weight, bias, chunks[-1:] + chunks[:-1], logprobs_grad_head, grad_input, grad_weight, grad_bias,
        logits_buffer=logits_buffer if kept else None, first_chunk_computed=kept,
        matmuls=head_matmuls(weight, fp8, grad_input_needed, grad_weight_needed),
    )
    return _grads_out(input, bias, grad_input, grad_weight, grad_bias)


def _valid_grad_bounds(grad_log_prob, target, ignore_index):
    """``[1]`` lowest and highest ``grad_log_prob`` over the non-ignored rows (``inf``, ``-inf`` when
    there are none)."""
    valid = target != ignore_index
    lowest = torch.where(valid, grad_log_prob, float("inf")).amin().reshape(1)
    highest = torch.where(valid, grad_log_prob, float("-inf")).amax().reshape(1)
    return lowest, highest


def uniform_grad(grad_log_prob: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """The ``[1]`` fp32 value of ``grad_log_prob`` if it is the same on every non-ignored row, else
    ``None``. The answer decides on the host what runs next: one host sync, so never call it
    where :func:`~tigon.ops._launch.host_sync_allowed` is false."""
    lowest, highest = _valid_grad_bounds(grad_log_prob, target, ignore_index)
    low, high = torch.cat((lowest, highest)).tolist()
    return lowest if low == high else None


def uniform_grad_or_nan(grad_log_prob: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """:func:`uniform_grad` decided on the device: the ``[1]`` fp32 value of ``grad_log_prob`` if
    it is the same on every non-ignored row (0 when there are none), else NaN, which turns every
    gradient it scales into NaN."""
    lowest, highest = _valid_grad_bounds(grad_log_prob, target, ignore_index)
    # lowest > highest only without valid rows; a NaN among them compares false and propagates.
    scale = torch.where(lowest > highest, 0.0, lowest)
    return torch.where(lowest < highest, float("nan"), scale)


class FusedLinearLogprobsFunction(torch.autograd.Function):
    """Saves the inputs and ``lse`` (and the entropy) for a recomputing backward, and with
    ``grad_in_forward`` the gradients of ``Σ log_prob`` computed by the forward pass (scaled in
    place by backward, so backward runs once per forward). A recomputing backward runs inside
    ``backward_context()`` when one is given."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, ignore_index, temperature, softcap, logit_scale, stored,
                chunk_memory_bytes, needs, grad_in_forward, backward_context, fp8):
        x2d = as_rows(input)
        target = target.reshape(-1)
        chunk_rows = chunk_rows_for(x2d.shape[0], weight.shape[0], x2d.element_size(), chunk_memory_bytes)
        options = (ignore_index, temperature, softcap, logit_scale)
        # One chunk needs no recomputation: its kept logits serve any upstream gradient at the
        # same cost as gradients in forward, without backward's check and scaling.
        grad_in_forward = grad_in_forward and x2d.shape[0] > chunk_rows
        # Without gradients in forward, the logits buffer is kept for a backward that starts with
        # the last chunk's logits; with them it holds a gradient, and a backward that must recompute
        # after all allocates a new one.
        keep_logits = any(needs) and not grad_in_forward
        log_prob, lse, entropy, log_sum_sq, mean_logit, is_top1, *grads, logits_buffer = fused_linear_logprobs_fwd(
            x2d, weight, target, bias, *options, *stored, chunk_rows, *(n and grad_in_forward for n in needs),
            keep_logits, fp8,
        )
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x2d, weight, target, bias, lse, entropy, logits_buffer, *grads)
        ctx.options, ctx.chunk_rows, ctx.needs, ctx.fp8 = options, chunk_rows, needs, fp8
        ctx.grad_in_forward, ctx.backward_context, ctx.input_shape = grad_in_forward, backward_context, input.shape
        ctx.mark_non_differentiable(log_sum_sq, mean_logit, is_top1)
        return log_prob, entropy, log_sum_sq, mean_logit, is_top1

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy, *_):
        x2d, weight, target, bias, lse, entropy, logits_buffer, *grads = ctx.saved_tensors
        if grad_log_prob is None and grad_entropy is None:
            return (None,) * 14
        ignore_index = ctx.options[0]
        grad_log_prob = torch.zeros_like(lse) if grad_log_prob is None else grad_log_prob.float().contiguous()
        scale = None
        if ctx.grad_in_forward and grad_entropy is None:
            if host_sync_allowed(grad_log_prob):
                scale = uniform_grad(grad_log_prob, target, ignore_index)
            else:
                scale = uniform_grad_or_nan(grad_log_prob, target, ignore_index)
        if scale is not None:
            for grad, needed in zip((grads[0], grads[1], grads[2].view(1, -1)), ctx.needs):
                if needed:
                    cross_entropy_bwd(grad, scale)
        else:
            grad_entropy = lse.new_empty(0) if grad_entropy is None else grad_entropy.float().contiguous()
            with contextlib.nullcontext() if ctx.backward_context is None else ctx.backward_context():
                grads = fused_linear_logprobs_bwd(
                    grad_log_prob, grad_entropy, x2d, weight, target, bias, lse, entropy, logits_buffer,
                    *ctx.options, ctx.chunk_rows, *ctx.needs, ctx.fp8,
                )
        grad_input_needed, grad_weight_needed, grad_bias_needed = ctx.needs
        return (
            grads[0].view(ctx.input_shape) if grad_input_needed else None,
            grads[1] if grad_weight_needed else None,
            None,
            grads[2] if grad_bias_needed else None,
            None, None, None, None, None, None, None, None, None, None,
        )


def fused_linear_logprobs(input, weight, target, bias, ignore_index, temperature, softcap, logit_scale, outputs,
                          chunk_memory_bytes, grad_in_forward, backward_context, fp8=None):
    """``input [..., H]``, ``weight [V, H]``, ``target [...]`` → the five fields of :data:`FIELDS`,
    each ``target``-shaped (``None`` unless in ``outputs``); inputs validated by
    :mod:`tigon.functional`, the targets' range here, once the kernels are queued."""
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(t is not None and t.requires_grad and grad_enabled for t in (input, weight, bias))
    stored = tuple(name in outputs for name in FIELDS[1:])
    bounds = target_bounds(target, ignore_index)
    fields = FusedLinearLogprobsFunction.apply(
        input, weight, target, bias, ignore_index, temperature, softcap, logit_scale, stored, chunk_memory_bytes,
        needs, grad_in_forward, backward_context, fp8,
    )
    check_target_bounds(bounds, weight.shape[0], ignore_index)
    return tuple(
        field.view(target.shape) if name in outputs else None for name, field in zip(FIELDS, fields)
    )



# loss_share(rows, logps) → the share of the loss of the chunk's tokens ``rows`` (a slice of the
# flattened [S·T] tokens; whole sequences unless the caller lets chunks split them) from their
# log-probs ``logps [C]`` (fp64, requires grad): an fp64 scalar, differentiable in logps. The loss
# is the sum of the shares.
LogprobLoss = Callable[[slice, torch.Tensor], torch.Tensor]


class VocabSlice(Protocol):
    """What :class:`FusedLinearLogprobLossFunction` calls on a head sharded along the vocabulary.
    :class:`~tigon.ops.vocab_parallel.VocabShard` is the one implementation; it builds on this
    module's kernels, so this module describes it rather than import it."""

    @property
    def vocab_size(self) -> int: ...

    def chunk_rows(self, n_rows: int, element_size: int, chunk_memory_bytes: int | None) -> int: ...

    def logprob_fields(self, logits, target, ignore_index, transform, fields) -> None: ...

    def logprob_grad(self, logits, target, ignore_index, transform, lse, grad_log_prob=None, grad_entropy=None,
                     entropy=None) -> None: ...

    def grad_input_sum(self, grad_input: torch.Tensor | None) -> GradInputSum: ...


class FusedLinearLogprobLossFunction(torch.autograd.Function):
    """A loss of the per-token log-probs, with gradients computed in forward. Per chunk of at most
    ``chunk_memory_bytes`` of logits: the log-probs, then ``dL/dlogp`` by autograd through the
    loss's formula, then ``onehot − p`` over the chunk's logits by the recomputing kernel, each row
    scaled by its ``dL/dlogp`` in the chunk loop's matmuls (``6·N·H·V`` FLOPs in all). The chunks
    are:

    - rows of the flattened tokens, splitting sequences, with ``split_sequences`` (the loss's
      share of a token depends on no other token's log-prob);
    - else whole sequences, as many as fit;
    - else, for sequences longer than the budget, two passes over rows: the log-probs of every
      token, then the loss of all sequences at once and its ``dL/dlogp``, then the chunks' logits
      again for the gradients, the last chunk's still held from the first pass
      (``6·N·H·V + 2·(N − C)·H·V`` FLOPs).

    Backward scales the saved gradients by ``grad_output`` in place (so it runs once per forward).
    Also returns the per-token log-probs and entropies (fp32 ``[S, T]``, not differentiable) for
    metrics.

    With ``shard`` (:class:`~tigon.ops.vocab_parallel.VocabShard`), ``weight`` and ``bias`` are
    this rank's slice of a head sharded along the vocabulary: each chunk's log-probs come from the
    ranks' statistics (one all-gather per chunk), so every rank computes the same loss and
    ``dL/dlogp``, and its own slice's ``dlogits``; the input's gradient is all-reduced."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, loss_share, split_sequences, ignore_index, temperature,
                chunk_memory_bytes, needs, shard: VocabSlice | None = None, fp8: str | None = None):
        n_sequences, seq_len = target.shape
        x2d, target_rows = as_rows(input), target.reshape(-1)
        n_rows = target_rows.numel()
        if shard is None:
            chunk_rows = chunk_rows_for(n_rows, weight.shape[0], x2d.element_size(), chunk_memory_bytes)
        else:
            chunk_rows = shard.chunk_rows(n_rows, x2d.element_size(), chunk_memory_bytes)
        two_pass = not split_sequences and seq_len > chunk_rows
        if not (split_sequences or two_pass):
            chunk_rows -= chunk_rows % max(seq_len, 1)
        chunks = row_chunks(n_rows, chunk_rows)
        compute_grad = any(needs)
        grad_input, grad_weight, grad_bias = new_grads(x2d, weight, *needs)
        log_prob, lse, entropy = (x2d.new_empty(n_rows, dtype=torch.float32) for _ in range(3))
        loss = torch.zeros((), dtype=torch.float64, device=input.device)
        transform = (ignore_index, temperature, None, 1.0)
        ones = torch.ones(min(chunk_rows, n_rows), dtype=torch.float32, device=input.device)
        logits_buffer = x2d.new_empty((min(chunk_rows, n_rows), weight.shape[0]))
        sharded_transform = transform_args(temperature, None, 1.0)
        matmuls = head_matmuls(weight, fp8, needs[0], needs[1])

        def logprobs_head(ranges, logits):
            rows = slice(*ranges[0])
            fields = [log_prob[rows], lse[rows], entropy[rows], None, None, None]
            if shard is None:
                launch_logprobs_fwd(logits, target_rows[rows], fields, None, *transform)
            else:
                shard.logprob_fields(logits, target_rows[rows], ignore_index, sharded_transform, fields)

        def add_share(rows):
            """Adds the loss of the tokens ``rows`` to ``loss``; → their fp32 ``dL/dlogp``, or ``None``."""
            with torch.enable_grad():
                logps = log_prob[rows].double().requires_grad_(compute_grad)
                share = loss_share(rows, logps)
            loss.add_(share.detach())
            if not compute_grad:
                return None
            grad_logps = torch.autograd.grad(share, logps, allow_unused=True)[0]
            return torch.zeros_like(log_prob[rows]) if grad_logps is None else grad_logps.float()

        def logprobs_grad(rows, logits):
            # dlogits of the log-probs themselves (onehot − p), each row's dL/dlogp applied by the
            # chunk loop in fp32 as row_scale: dL/dlogp is ~1/tokens, and folded into 16-bit
            # dlogits it would flush p·dL/dlogp (~1e-8 for a flat softmax) to zero in fp16.
            chunk_ones = ones[: logits.shape[0]]
            if shard is None:
                launch_logprobs_bwd(logits, target_rows[rows], lse[rows], None, chunk_ones, None, *transform)
            else:
                shard.logprob_grad(logits, target_rows[rows], ignore_index, sharded_transform, lse[rows], chunk_ones)

        def loss_head(ranges, logits):
            rows = slice(*ranges[0])
            logprobs_head(ranges, logits)
            grad_logps = add_share(rows)
            if grad_logps is not None:
                logprobs_grad(rows, logits)
            return grad_logps

        grad_input_sum = None if shard is None else shard.grad_input_sum(grad_input)
        grad_input_written = None if grad_input_sum is None else grad_input_sum.rows_written
        if not two_pass:
            fused_linear_chunks(x2d, weight, bias, chunks, loss_head, grad_input, grad_weight, grad_bias,
                                logits_buffer=logits_buffer, matmuls=matmuls, grad_input_written=grad_input_written)
        else:
            fused_linear_chunks(x2d, weight, bias, chunks, logprobs_head, logits_buffer=logits_buffer,
                                matmuls=matmuls)
            all_grad_logps = add_share(slice(0, n_rows))
            if all_grad_logps is not None:

                def recomputed_grad_head(ranges, logits):
                    rows = slice(*ranges[0])
                    logprobs_grad(rows, logits)
                    return all_grad_logps[rows]

                fused_linear_chunks(
                    x2d, weight, bias, chunks[-1:] + chunks[:-1], recomputed_grad_head, grad_input, grad_weight,
                    grad_bias, logits_buffer=logits_buffer, first_chunk_computed=True, matmuls=matmuls,
                    grad_input_written=grad_input_written,
                )
        if grad_input_sum is not None:
            grad_input_sum.wait()
        ctx.save_for_backward(grad_input, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype))
        ctx.needs, ctx.input_shape = needs, input.shape
        log_prob, entropy = log_prob.view(n_sequences, seq_len), entropy.view(n_sequences, seq_len)
        ctx.mark_non_differentiable(log_prob, entropy)
        return loss.float(), log_prob, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_log_prob, grad_entropy):
        grad_input, grad_weight, grad_bias = scaled_grads(ctx.saved_tensors, ctx.needs, grad_loss, ctx.input_shape)
        return grad_input, grad_weight, None, grad_bias, None, None, None, None, None, None, None, None


def fused_linear_logprob_loss(input, weight, target, bias, loss_share: LogprobLoss, split_sequences: bool,
                              ignore_index: int, temperature: float, chunk_memory_bytes: int | None,
                              ids: tuple[str, torch.Tensor] | None = None, shard: VocabSlice | None = None,
                              fp8: str | None = None):
    """``input [S, T, H]``, ``weight [V, H]``, ``target [S, T]`` → ``(loss, log_probs [S, T],
    entropy [S, T])``, fp32, the loss being the sum of ``loss_share`` over the chunks of
    :class:`FusedLinearLogprobLossFunction` (``split_sequences``: chunks may split a sequence);
    inputs validated by :mod:`tigon.losses`, the targets' range here, once the kernels are queued:
    of ``target`` less ``ignore_index``, or, with ``ids = (name, tensor)``, of every entry of the
    caller's ``tensor`` (the ids ``target`` was made from), reported as ``name``. With ``shard``,
    ``weight`` and ``bias`` are this rank's slice of a vocabulary-parallel head; with ``fp8`` (a
    recipe of :mod:`tigon.ops.fp8`; not with ``shard``) the head's matmuls are FP8."""
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(t is not None and t.requires_grad and grad_enabled for t in (input, weight, bias))
    name, checked, checked_ignore = ("target", target, ignore_index) if ids is None else (*ids, None)
    bounds = target_bounds(checked, checked_ignore)
    result = FusedLinearLogprobLossFunction.apply(
        input, weight, target, bias, loss_share, split_sequences, ignore_index, temperature, chunk_memory_bytes,
        needs, shard, fp8,
    )
    check_target_bounds(bounds, weight.shape[0] if shard is None else shard.vocab_size, checked_ignore, name)
    return result
