"""Losses of ``x @ Wᵀ (+ b)`` with ``W`` sharded along the vocabulary over a process group.

Rank ``r`` of ``tp`` holds the rows ``[v_r, v_r + V_r)`` of ``weight`` (and of ``bias``); ``x`` and
the targets are the same on every rank. Per chunk of ``C`` rows, by the chunk loop of
:mod:`tigon.ops.fused_linear` over the local shard::

    y_r       = x_c @ W_rᵀ (+ b_r)                   [C, V_r]: the only logits a rank holds
    stats_r   = per row of z_r = transform(y_r): m_r = max z, s_r = Σ exp(z − m_r), the target's z
                when it falls in the slice (0 elsewhere), and what the fields ask: Σ z,
                Σ exp(z − m_r)·(z − m_r), Σ exp(2(z − m_r)), the max before the target
    stats     = all_gather(stats_r)                   [tp, C, K] fp32: the one collective per chunk
    M = max_r m_r,  S = Σ_r exp(m_r − M)·s_r,  lse = M + log S                 (on every rank)
    dlogits_r = dL/dy over the rank's slice, from lse (and the entropy)   written over y_r
    dx_c     += dlogits_r @ W_r,  dW_r = Σ_c dlogits_rᵀ @ x_c,  db_r = Σ_rows dlogits_r

The combination is exact: every global statistic is a sum over the ranks' slices, each rescaled
from its own shift ``m_r`` to the common ``M``; the entropy's ``Σ p·(z − M)`` term moves with its
shift as ``Σ e·(z − m_r) + (m_r − M)·s_r``. Every rank then holds the same per-token losses and
log-probs, and its own slice's gradients. ``dx`` is a partial sum over the ranks: the op
all-reduces it (a replicated hidden state then gets exactly the one-process gradient), or leaves it
partial for a caller that reduces it itself (a DTensor input's gradient marked ``Partial``).

Per chunk the extra traffic is the gather of ``tp·C·K`` fp32 (K ≤ 7), and ``N·H`` once for the
all-reduce of ``dx``; the matmuls are ``1/tp`` of one process's. The gradient formulas are those of
:mod:`tigon.ops.cross_entropy` (cross entropy with label smoothing, z-loss and softcap) and of
:mod:`tigon.ops.fused_linear_logprobs` (log-probs and entropy), in the one form of its
``softmax_grad_row``::

    dL/dz_j = p_j·a − u − [j = t]·c − h·p_j·(log p_j + H)

(cross entropy: ``a = 1 + 2·s·lse``, ``u = ε/V``, ``c = 1 − ε``, ``h = 0``; log-probs with
upstream ``g`` and ``h``: ``a = c = −g``, ``u = 0``), times the transform's ``dz/dy``.

Shards may be uneven (``torch.chunk``'s split of V = 101 over 2 ranks is 51 and 50, DTensor's
``Shard(0)``); every rank runs the same chunks (sized by the largest shard), so the collectives
line up. The layout (each shard's size, and the row count, which must agree) is gathered once per
call, a host sync. Shapes and dtypes as the one-process ops; gradients for ``"none"`` and the
log-probs are recomputed in backward from the saved global ``lse`` without another gather (the
log-probs' ``grad_in_forward`` as in one process). :class:`VocabShard` carries the per-chunk
steps (statistics, gradient, the input gradient's reduction), which the GRPO family's chunk loop
(:class:`~tigon.ops.fused_linear_logprobs.FusedLinearLogprobLossFunction`) calls as well.
Not under torch.compile or CUDA-graph capture: the collectives and the layout check run eagerly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from tigon.ops._launch import as_rows, host_sync_allowed
from tigon.ops.cross_entropy import (
    check_target_bounds,
    count_valid,
    cross_entropy_bwd,
    reduce_rows,
    shaped_losses,
    store_zero_row,
    target_bounds,
    vocab_row_geometry,
)
from tigon.ops.fused_linear import GradInputSum, chunk_rows_for, fused_linear_chunks, mean_scales, new_grads, row_chunks
from tigon.ops.fused_linear_logprobs import (
    FIELDS,
    online_row_stats,
    scaled_softcapped,
    softmax_grad_row,
    transform_args,
    uniform_grad,
    uniform_grad_or_nan,
)

# Columns of the statistics a rank computes per row over its slice of z.
STAT_MAX = tl.constexpr(0)  # max z (−inf for an empty slice)
STAT_SUM_EXP = tl.constexpr(1)  # Σ exp(z − shift), shift = max z (0 while it is −inf)
STAT_Z_TARGET = tl.constexpr(2)  # z of the target if this slice holds it, else 0
STAT_SUM_Z = tl.constexpr(3)  # Σ z (label smoothing, mean logit)
STAT_SUM_EXP_DZ = tl.constexpr(4)  # Σ exp(z − shift)·(z − shift) (entropy)
STAT_SUM_EXP_SQ = tl.constexpr(5)  # Σ exp(2(z − shift)) (log Σ p²)
STAT_MAX_BEFORE_TARGET = tl.constexpr(6)  # max z over the global indices below the target (is_top1)
N_STATS = 7
# Columns of the per-row terms of the gradient (see the module docstring).
TERM_LSE = tl.constexpr(0)
TERM_PROB = tl.constexpr(1)  # a
TERM_TARGET = tl.constexpr(2)  # c
TERM_UNIFORM = tl.constexpr(3)  # u
TERM_ENTROPY_GRAD = tl.constexpr(4)  # h
TERM_ENTROPY = tl.constexpr(5)  # H
N_TERMS = 6


@triton.jit
def vocab_parallel_stats_kernel(
    LOGITS, TARGET, STATS,
    n_rows, n_cols, vocab_start, vocab_size,
    stride_logits, stride_target, stride_stats,
    ignore_index, logit_scale, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, STORE_SUM_Z: tl.constexpr, STORE_ENTROPY: tl.constexpr,
    STORE_SUM_SQ: tl.constexpr, STORE_TOP1: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Persistent grid over rows; each row's slice [vocab_start, vocab_start + n_cols) of the
    # vocabulary is read once, in blocks, for its online statistics (those of logprobs_fwd_kernel).
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    for row in range(pid, n_rows, n_programs):
        logits_row = LOGITS + tl.cast(row, tl.int64) * stride_logits
        stats_row = STATS + row * stride_stats
        target = tl.load(TARGET + row * stride_target)
        # The validity of a target is global: every rank skips the same rows. Their placeholders
        # (lse = 0) are never read.
        if (target == ignore_index) | (target < 0) | (target >= vocab_size):
            tl.store(stats_row + STAT_MAX, 0.0)
            tl.store(stats_row + STAT_SUM_EXP, 1.0)
            tl.store(stats_row + STAT_Z_TARGET, 0.0)
            tl.store(stats_row + STAT_SUM_Z, 0.0)
            tl.store(stats_row + STAT_SUM_EXP_DZ, 0.0)
            tl.store(stats_row + STAT_SUM_EXP_SQ, 0.0)
            tl.store(stats_row + STAT_MAX_BEFORE_TARGET, float("-inf"))
        else:
            local_target = target - vocab_start
            owns_target = (local_target >= 0) & (local_target < n_cols)
            y_target = tl.load(logits_row + local_target, mask=owns_target, other=0.0).to(tl.float32)
            z_target = scaled_softcapped(y_target, logit_scale, softcap, HAS_SOFTCAP) * inv_temperature
            running_max, _, sum_exp, sum_exp_dz, sum_exp_sq, sum_z, max_before_target = online_row_stats(
                logits_row, n_cols, vocab_start, target, logit_scale, softcap, inv_temperature, HAS_SOFTCAP,
                STORE_ENTROPY, STORE_SUM_SQ, STORE_SUM_Z, STORE_TOP1, "", BLOCK_V,
            )
            tl.store(stats_row + STAT_MAX, running_max)
            tl.store(stats_row + STAT_SUM_EXP, sum_exp)
            tl.store(stats_row + STAT_Z_TARGET, tl.where(owns_target, z_target, 0.0))
            if STORE_SUM_Z:
                tl.store(stats_row + STAT_SUM_Z, sum_z)
            if STORE_ENTROPY:
                tl.store(stats_row + STAT_SUM_EXP_DZ, sum_exp_dz)
            if STORE_SUM_SQ:
                tl.store(stats_row + STAT_SUM_EXP_SQ, sum_exp_sq)
            if STORE_TOP1:
                tl.store(stats_row + STAT_MAX_BEFORE_TARGET, max_before_target)


@triton.jit
def vocab_parallel_grad_kernel(
    LOGITS, TARGET, TERMS,
    n_rows, n_cols, vocab_start, vocab_size,
    stride_logits, stride_target, stride_terms,
    ignore_index, logit_scale, softcap, inv_temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_UNIFORM: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # dL/dy over the slice, written over the logits (softmax_grad_row), with p_j = exp(z_j − lse)
    # from the whole vocabulary's lse; the target's column is local only on the rank that holds it.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    for row in range(pid, n_rows, n_programs):
        logits_row = LOGITS + tl.cast(row, tl.int64) * stride_logits
        terms_row = TERMS + row * stride_terms
        target = tl.load(TARGET + row * stride_target)
        if (target == ignore_index) | (target < 0) | (target >= vocab_size):
            store_zero_row(logits_row, n_cols, BLOCK_V)
        else:
            uniform = 0.0
            if HAS_UNIFORM:
                uniform = tl.load(terms_row + TERM_UNIFORM)
            entropy_grad = 0.0
            entropy = 0.0
            if HAS_ENTROPY_GRAD:
                entropy_grad = tl.load(terms_row + TERM_ENTROPY_GRAD)
                entropy = tl.load(terms_row + TERM_ENTROPY)
            softmax_grad_row(
                logits_row, logits_row, n_cols, target - vocab_start, tl.load(terms_row + TERM_LSE), entropy,
                tl.load(terms_row + TERM_PROB), tl.load(terms_row + TERM_TARGET), uniform, entropy_grad,
                logit_scale, softcap, inv_temperature, HAS_SOFTCAP, HAS_UNIFORM, HAS_ENTROPY_GRAD, BLOCK_V,
            )


def _all_gather(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``local [n, ...]``, concatenated along the first dimension in rank order."""
    out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
    # all_gather_single from torch 2.13 on, where all_gather_into_tensor is deprecated.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local.contiguous(), group=group)
    return out


def launch_stats(logits, target, stats, vocab_start, vocab_size, ignore_index, transform, sum_z=False,
                 entropy=False, sum_sq=False, top1=False):
    """``stats [C, N_STATS]`` fp32 ← the statistics of each row of the local ``logits [C, V_r]``,
    the columns ``[vocab_start, vocab_start + V_r)`` of a vocabulary of ``vocab_size``; the
    columns not asked for are left as they were."""
    n_rows, n_cols = logits.shape
    block_v, num_warps, n_programs = vocab_row_geometry(n_rows, max(n_cols, 1), logits.element_size(), logits.device)
    vocab_parallel_stats_kernel[(n_programs,)](
        logits, target, stats,
        n_rows, n_cols, vocab_start, vocab_size,
        logits.stride(0), target.stride(0), stats.stride(0),
        ignore_index, **transform,
        STORE_SUM_Z=sum_z, STORE_ENTROPY=entropy, STORE_SUM_SQ=sum_sq, STORE_TOP1=top1,
        BLOCK_V=block_v, num_warps=num_warps,
    )


def launch_grad(logits, target, terms, vocab_start, vocab_size, ignore_index, transform, uniform=False,
                entropy_grad=False):
    """``logits [C, V_r]`` (the columns from ``vocab_start``) ← ``dL/dy`` of the rows'
    ``terms [C, N_TERMS]`` (fp32)."""
    n_rows, n_cols = logits.shape
    block_v, num_warps, n_programs = vocab_row_geometry(n_rows, max(n_cols, 1), logits.element_size(), logits.device)
    vocab_parallel_grad_kernel[(n_programs,)](
        logits, target, terms,
        n_rows, n_cols, vocab_start, vocab_size,
        logits.stride(0), target.stride(0), terms.stride(0),
        ignore_index, **transform,
        HAS_UNIFORM=uniform, HAS_ENTROPY_GRAD=entropy_grad, BLOCK_V=block_v, num_warps=num_warps,
    )


@dataclass
class RowStats:
    """Per-row statistics of the whole vocabulary, from every rank's: ``lse = shift +
    log_sum_exp`` kept in two parts (``z − shift`` is exact where ``lse`` rounded is not), and
    each field only where asked for."""

    shift: torch.Tensor
    log_sum_exp: torch.Tensor
    z_target: torch.Tensor
    sum_z: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None

    @property
    def lse(self) -> torch.Tensor:
        return self.shift + self.log_sum_exp

    @property
    def log_prob(self) -> torch.Tensor:
        return (self.z_target - self.shift) - self.log_sum_exp


def combined_stats(gathered: torch.Tensor, sum_z=False, entropy=False, sum_sq=False, top1=False) -> RowStats:
    """Every rank's statistics ``gathered [tp, C, N_STATS]`` → those of the whole vocabulary."""
    maxes = gathered[..., STAT_MAX.value]
    top = maxes.amax(0)
    shift = torch.where(top == float("-inf"), 0.0, top)
    rank_shift = torch.where(maxes == float("-inf"), 0.0, maxes)
    # Each rank's sums move from its shift to the common one: exp(z − shift) = e_r·exp(shift_r − shift).
    rescale = torch.exp(rank_shift - shift)
    sum_exp_r = gathered[..., STAT_SUM_EXP.value]
    sum_exp = (rescale * sum_exp_r).sum(0)
    log_sum_exp = sum_exp.log()
    result = RowStats(shift, log_sum_exp, gathered[..., STAT_Z_TARGET.value].sum(0))
    if sum_z:
        result.sum_z = gathered[..., STAT_SUM_Z.value].sum(0)
    if entropy:
        # Σ exp(z − shift)·(z − shift) = Σ_r rescale_r·(Σ e·(z − shift_r) + (shift_r − shift)·s_r).
        sum_exp_dz = (rescale * (gathered[..., STAT_SUM_EXP_DZ.value] + (rank_shift - shift) * sum_exp_r)).sum(0)
        result.entropy = log_sum_exp - sum_exp_dz / sum_exp
    if sum_sq:
        result.log_sum_sq = (rescale.square() * gathered[..., STAT_SUM_EXP_SQ.value]).sum(0).log() - 2.0 * log_sum_exp
    if top1:
        before = gathered[..., STAT_MAX_BEFORE_TARGET.value].amax(0)
        result.is_top1 = (result.z_target >= top) & (result.z_target > before)
    return result


def logprob_grad_terms(lse, grad_log_prob=None, grad_entropy=None, entropy=None) -> torch.Tensor:
    """``[C, N_TERMS]`` of the log-probs' gradient for the upstream ``g = grad_log_prob`` and
    ``h = grad_entropy`` (``[C]``, ``None`` for 0): dL/dz = g·([j = t] − p) − h·p·(log p + H),
    so ``a = c = −g``."""
    terms = lse.new_zeros((lse.shape[0], N_TERMS))
    terms[:, TERM_LSE.value] = lse
    if grad_log_prob is not None:
        terms[:, TERM_PROB.value] = -grad_log_prob.reshape(-1).float()
        terms[:, TERM_TARGET.value] = terms[:, TERM_PROB.value]
    if grad_entropy is not None:
        terms[:, TERM_ENTROPY_GRAD.value] = grad_entropy.reshape(-1).float()
        terms[:, TERM_ENTROPY.value] = entropy
    return terms


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[vocab_start, vocab_start + V_r)`` of a vocabulary of ``vocab_size``
    sharded over ``group``, and what a loss does with it: the whole vocabulary's statistics of a
    chunk's rows (:meth:`stats`), the slice's gradient (:meth:`grad`), the input's gradient
    reduced (:meth:`grad_input_sum`). ``reduce_grad_input``: all-reduce the input's gradient
    (else it is left as this rank's partial sum)."""

    group: dist.ProcessGroup
    vocab_start: int
    vocab_size: int
    reduce_grad_input: bool

    def chunk_rows(self, n_rows: int, element_size: int, chunk_memory_bytes: int | None) -> int:
        """Rows per chunk: those of one process over the whole vocabulary (``chunk_memory_bytes``
        bounds a chunk's logits over all ``V`` columns), so that each rank's buffer of its slice
        holds ``1 / TP`` of them; the same count on every rank."""
        return chunk_rows_for(n_rows, self.vocab_size, element_size, chunk_memory_bytes)

    def valid_rows(self, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Which rows have a target: the kernels' rule, over the whole vocabulary."""
        return (target != ignore_index) & (target >= 0) & (target < self.vocab_size)

    def stats(self, logits, target, ignore_index, transform, **asked) -> RowStats:
        """The whole vocabulary's statistics of the rows of this rank's ``logits [C, V_r]``
        (``asked``: ``sum_z``, ``entropy``, ``sum_sq``, ``top1``): the local kernel, the chunk's
        all-gather, the combination."""
        stats = logits.new_empty((logits.shape[0], N_STATS), dtype=torch.float32)
        launch_stats(logits, target, stats, self.vocab_start, self.vocab_size, ignore_index, transform, **asked)
        return combined_stats(_all_gather(stats, self.group).view(-1, *stats.shape), **asked)

    def grad(self, logits, target, terms, ignore_index, transform, uniform=False, entropy_grad=False) -> None:
        """``logits [C, V_r]`` ← ``dL/dy`` of the rows' ``terms [C, N_TERMS]``."""
        launch_grad(logits, target, terms, self.vocab_start, self.vocab_size, ignore_index, transform, uniform,
                    entropy_grad)

    def logprob_fields(self, logits, target, ignore_index, transform, fields) -> None:
        """Write the rows' ``fields`` (``log_prob, lse, entropy, log_sum_sq, mean_logit,
        is_top1``: ``[C]`` tensors, ``None`` where not wanted) over the whole vocabulary, from
        this rank's ``logits [C, V_r]``. Ignored rows get 0 (and any ``lse``)."""
        log_prob, lse, entropy, log_sum_sq, mean_logit, is_top1 = fields
        asked = {
            "sum_z": mean_logit is not None, "entropy": entropy is not None, "sum_sq": log_sum_sq is not None,
            "top1": is_top1 is not None,
        }
        row = self.stats(logits, target, ignore_index, transform, **asked)
        valid = self.valid_rows(target, ignore_index)
        log_prob.copy_(torch.where(valid, row.log_prob, 0.0))
        lse.copy_(row.lse)
        for out, value in ((entropy, row.entropy), (log_sum_sq, row.log_sum_sq), (is_top1, row.is_top1)):
            if out is not None and value is not None:
                out.copy_(torch.where(valid, value, torch.zeros((), dtype=value.dtype)))
        if mean_logit is not None and row.sum_z is not None:
            mean_logit.copy_(torch.where(valid, row.sum_z / self.vocab_size, 0.0))

    def logprob_grad(self, logits, target, ignore_index, transform, lse, grad_log_prob=None, grad_entropy=None,
                     entropy=None) -> None:
        """``logits [C, V_r]`` ← the log-probs' ``dL/dy`` for the upstream ``grad_log_prob`` and
        ``grad_entropy`` (``[C]``, ``None`` for 0), from the rows' global ``lse`` (and entropy)."""
        terms = logprob_grad_terms(lse, grad_log_prob, grad_entropy, entropy)
        self.grad(logits, target, terms, ignore_index, transform, entropy_grad=grad_entropy is not None)

    def grad_input_sum(self, grad_input: torch.Tensor | None) -> GradInputSum:
        """The input's gradient summed over the ranks' slices chunk by chunk, when the op reduces it."""
        return GradInputSum(grad_input if self.reduce_grad_input else None, self.group)


def vocab_shard(weight: torch.Tensor, n_rows: int, group: dist.ProcessGroup, reduce_grad_input: bool) -> VocabShard:
    """The layout of the shards ``weight [V_r, H]`` over ``group`` (in rank order), gathered: one
    small collective and a host sync. Raises ``ValueError`` on every rank alike when the ranks
    disagree on ``n_rows`` (the tokens must be the same on every rank)."""
    local = torch.tensor([[weight.shape[0], n_rows]], dtype=torch.int64, device=weight.device)
    sizes, rows = _all_gather(local, group).cpu().t().tolist()
    if len(set(rows)) > 1:
        raise ValueError(
            f"input must hold the same tokens on every rank of the vocabulary-parallel group; got {rows} rows"
        )
    rank = dist.get_rank(group)
    return VocabShard(group, sum(sizes[:rank]), sum(sizes), reduce_grad_input)


def _grads_or_none(grads, needs, input_shape):
    grad_input, grad_weight, grad_bias = (grad if needed else None for grad, needed in zip(grads, needs))
    return None if grad_input is None else grad_input.view(input_shape), grad_weight, grad_bias


def _scale_grads(grads, needs, scale, keep_zeros: bool) -> None:
    """The gradients computed in forward, times ``scale`` (fp32 ``[1]``) in place; with
    ``keep_zeros``, zero entries stay zero (see :func:`~tigon.ops.cross_entropy.cross_entropy_bwd`)."""
    for grad, needed in zip(grads, needs):
        if needed and grad.numel() > 0:  # a rank may hold no row of a small vocabulary
            cross_entropy_bwd(grad.view(-1, grad.shape[-1]), scale, keep_zeros=keep_zeros)


def _cross_entropy_terms(lse, scale, label_smoothing, lse_square_scale, vocab_size):
    """``[C, N_TERMS]`` of the cross entropy: ``a = 1 + 2·s·lse``, ``u = ε/V``, ``c = 1 − ε``, each
    times ``scale`` (``None``, fp32 ``[1]`` or ``[C]``)."""
    terms = lse.new_empty((lse.shape[0], N_TERMS))
    scale = torch.ones_like(lse) if scale is None else scale.expand_as(lse)
    terms[:, TERM_LSE.value] = lse
    terms[:, TERM_PROB.value] = scale * (1.0 + 2.0 * lse_square_scale * lse)
    terms[:, TERM_TARGET.value] = scale * (1.0 - label_smoothing)
    terms[:, TERM_UNIFORM.value] = scale * (label_smoothing / vocab_size)
    return terms


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """As :class:`~tigon.ops.fused_linear_cross_entropy.FusedLinearCrossEntropyFunction` on a
    vocabulary shard: ``"mean"``/``"sum"`` compute the gradients in forward (backward scales them
    in place), ``"none"`` saves the inputs and the global ``lse`` and recomputes the local logits
    in backward, with no collective but the input gradient's all-reduce."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, shard: VocabShard, ignore_index, reduction, label_smoothing,
                lse_square_scale, softcap, return_z_loss, chunk_memory_bytes, needs):
        x2d, target = as_rows(input), target.reshape(-1)
        n_rows = x2d.shape[0]
        chunk_rows = shard.chunk_rows(n_rows, x2d.element_size(), chunk_memory_bytes)
        n_valid = count_valid(target, shard.vocab_size, ignore_index) if reduction == "mean" else None
        in_forward = reduction != "none"
        grad_input, grad_weight, grad_bias = new_grads(x2d, weight, *(n and in_forward for n in needs))
        compute_grad = in_forward and any(needs)
        grad_scale, matmul_scale = None, 1.0
        if n_valid is not None and compute_grad:
            grad_scale, matmul_scale = mean_scales(n_valid, n_rows)
        loss = x2d.new_empty(n_rows, dtype=torch.float32)
        z_loss = torch.empty_like(loss)
        lse = torch.empty_like(loss)
        transform = transform_args(1.0, softcap, 1.0)
        smoothing = label_smoothing > 0.0

        def cross_entropy_head(ranges, logits):
            rows = slice(*ranges[0])
            row = shard.stats(logits, target[rows], ignore_index, transform, sum_z=smoothing)
            # loss = (1 − ε)·(lse − z_t) + ε·(lse − mean z) + s·lse², lse kept as shift + log Σe.
            row_lse = row.lse
            row_z_loss = lse_square_scale * row_lse.square()
            row_loss = row.log_sum_exp + (1.0 - label_smoothing) * (row.shift - row.z_target) + row_z_loss
            if smoothing:
                row_loss += label_smoothing * (row.shift - row.sum_z / shard.vocab_size)
            valid = shard.valid_rows(target[rows], ignore_index)
            loss[rows] = torch.where(valid, row_loss, 0.0)
            z_loss[rows] = torch.where(valid, row_z_loss, 0.0)
            lse[rows] = row_lse
            if compute_grad:
                terms = _cross_entropy_terms(row_lse, grad_scale, label_smoothing, lse_square_scale, shard.vocab_size)
                shard.grad(logits, target[rows], terms, ignore_index, transform, uniform=smoothing)

        grad_input_sum = shard.grad_input_sum(grad_input)
        fused_linear_chunks(
            x2d, weight, bias, row_chunks(n_rows, chunk_rows), cross_entropy_head, grad_input, grad_weight,
            grad_bias, matmul_scale, grad_input_written=grad_input_sum.rows_written,
        )
        grad_input_sum.wait()
        if reduction == "none":
            ctx.save_for_backward(x2d, weight, target, bias, lse)
        else:
            ctx.save_for_backward(grad_input, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype))
        ctx.shard, ctx.reduction, ctx.needs, ctx.input_shape, ctx.chunk_rows = (
            shard, reduction, needs, input.shape, chunk_rows,
        )
        ctx.options = (ignore_index, label_smoothing, lse_square_scale, transform)
        z_loss = reduce_rows(z_loss, reduction, n_valid) if return_z_loss else loss.new_empty(0)
        ctx.mark_non_differentiable(z_loss)
        return reduce_rows(loss, reduction, n_valid), z_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss):
        if ctx.reduction != "none":
            grads = ctx.saved_tensors
            _scale_grads(grads, ctx.needs, grad_loss.reshape(1).float(), keep_zeros=True)
        else:
            x2d, weight, target, bias, lse = ctx.saved_tensors
            ignore_index, label_smoothing, lse_square_scale, transform = ctx.options
            shard = ctx.shard
            grad_loss = grad_loss.reshape(-1).float()
            grads = new_grads(x2d, weight, *ctx.needs)

            def cross_entropy_grad_head(ranges, logits):
                rows = slice(*ranges[0])
                terms = _cross_entropy_terms(lse[rows], grad_loss[rows], label_smoothing, lse_square_scale,
                                             shard.vocab_size)
                shard.grad(logits, target[rows], terms, ignore_index, transform, uniform=label_smoothing > 0.0)

            grad_input_sum = shard.grad_input_sum(grads[0])
            fused_linear_chunks(x2d, weight, bias, row_chunks(x2d.shape[0], ctx.chunk_rows), cross_entropy_grad_head,
                                *grads, grad_input_written=grad_input_sum.rows_written)
            grad_input_sum.wait()
            grads = (*grads[:2], None if grads[2] is None else grads[2].to(bias.dtype))
        grad_input, grad_weight, grad_bias = _grads_or_none(grads, ctx.needs, ctx.input_shape)
        return grad_input, grad_weight, None, grad_bias, *(None,) * 9


def fused_linear_cross_entropy(input, weight, target, bias, shard: VocabShard, ignore_index, reduction,
                               label_smoothing, lse_square_scale, softcap, return_z_loss, chunk_memory_bytes):
    """:func:`tigon.ops.fused_linear_cross_entropy.fused_linear_cross_entropy` with ``weight``
    (and ``bias``) this rank's shard of the vocabulary ``shard``; inputs validated by
    :mod:`tigon.functional`."""
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(t is not None and t.requires_grad and grad_enabled for t in (input, weight, bias))
    bounds = target_bounds(target, ignore_index)
    loss, z_loss = VocabParallelCrossEntropyFunction.apply(
        input, weight, target, bias, shard, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
        return_z_loss, chunk_memory_bytes, needs,
    )
    check_target_bounds(bounds, shard.vocab_size, ignore_index)
    return shaped_losses(loss, z_loss, target, reduction, return_z_loss)


class VocabParallelLogprobsFunction(torch.autograd.Function):
    """As :class:`~tigon.ops.fused_linear_logprobs.FusedLinearLogprobsFunction` on a vocabulary
    shard. Saves the inputs, the global ``lse`` and entropy for a recomputing backward
    (``8·N·H·V / tp`` matmul FLOPs per rank), and the logits buffer, which still holds the last
    chunk's logits, so backward starts there. With ``grad_in_forward`` (and more than one chunk)
    the forward also computes the gradients of ``Σ log_prob`` (``6·N·H·V / tp``), which backward
    scales when the upstream gradient keeps the promise (uniform over the non-ignored rows, none
    to the entropy), else recomputes, as the one-process op. A recomputing backward runs inside
    ``backward_context()`` when one is given."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, shard: VocabShard, ignore_index, temperature, softcap, logit_scale,
                stored, chunk_memory_bytes, needs, grad_in_forward, backward_context):
        x2d, target = as_rows(input), target.reshape(-1)
        n_rows = x2d.shape[0]
        chunk_rows = shard.chunk_rows(n_rows, x2d.element_size(), chunk_memory_bytes)
        grad_in_forward = grad_in_forward and any(needs) and n_rows > chunk_rows
        grads = new_grads(x2d, weight, *(n and grad_in_forward for n in needs))
        fields = [x2d.new_empty(n_rows if wanted else 0, dtype=torch.float32) for wanted in (True, True, *stored[:3])]
        fields.append(x2d.new_empty(n_rows if stored[3] else 0, dtype=torch.bool))
        log_prob, lse, entropy, log_sum_sq, mean_logit, is_top1 = fields
        transform = transform_args(temperature, softcap, logit_scale)
        ones = x2d.new_ones(min(chunk_rows, n_rows), dtype=torch.float32)

        def logprobs_head(ranges, logits):
            rows = slice(*ranges[0])
            shard.logprob_fields(
                logits, target[rows], ignore_index, transform,
                [None if field.numel() == 0 else field[rows] for field in fields],
            )
            if grad_in_forward:
                shard.logprob_grad(logits, target[rows], ignore_index, transform, lse[rows], ones[: logits.shape[0]])

        logits_buffer = x2d.new_empty((min(chunk_rows, n_rows), weight.shape[0]))
        grad_input_sum = shard.grad_input_sum(grads[0])
        fused_linear_chunks(x2d, weight, bias, row_chunks(n_rows, chunk_rows), logprobs_head, *grads,
                            logits_buffer=logits_buffer, grad_input_written=grad_input_sum.rows_written)
        grad_input_sum.wait()
        # With gradients in forward the buffer holds the last chunk's gradient, not its logits.
        kept = logits_buffer if any(needs) and not grad_in_forward else None
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x2d, weight, target, bias, lse, entropy, kept, *grads)
        ctx.shard, ctx.needs, ctx.input_shape, ctx.chunk_rows = shard, needs, input.shape, chunk_rows
        ctx.options, ctx.grad_in_forward, ctx.backward_context = (ignore_index, transform), grad_in_forward, backward_context
        ctx.mark_non_differentiable(log_sum_sq, mean_logit, is_top1)
        return log_prob, entropy, log_sum_sq, mean_logit, is_top1

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy, *_):
        x2d, weight, target, bias, lse, entropy, logits_buffer, *grads = ctx.saved_tensors
        if grad_log_prob is None and grad_entropy is None:
            return (None,) * 14
        ignore_index, transform = ctx.options
        shard = ctx.shard
        scale = None
        if ctx.grad_in_forward and grad_entropy is None:
            grad_rows = grad_log_prob.reshape(-1).float()
            if host_sync_allowed(grad_rows):
                scale = uniform_grad(grad_rows, target, ignore_index)
            else:
                scale = uniform_grad_or_nan(grad_rows, target, ignore_index)
        if scale is not None:
            _scale_grads(grads, ctx.needs, scale, keep_zeros=False)
        else:
            grads = new_grads(x2d, weight, *ctx.needs)

            def logprobs_grad_head(ranges, logits):
                rows = slice(*ranges[0])
                shard.logprob_grad(
                    logits, target[rows], ignore_index, transform, lse[rows],
                    None if grad_log_prob is None else grad_log_prob.reshape(-1)[rows],
                    None if grad_entropy is None else grad_entropy.reshape(-1)[rows], entropy[rows],
                )

            chunks = row_chunks(x2d.shape[0], ctx.chunk_rows)
            kept = logits_buffer is not None
            grad_input_sum = shard.grad_input_sum(grads[0])
            with contextlib.nullcontext() if ctx.backward_context is None else ctx.backward_context():
                fused_linear_chunks(
                    x2d, weight, bias, chunks[-1:] + chunks[:-1], logprobs_grad_head, *grads,
                    logits_buffer=logits_buffer, first_chunk_computed=kept,
                    grad_input_written=grad_input_sum.rows_written,
                )
            grad_input_sum.wait()
        grads = (*grads[:2], None if grads[2] is None else grads[2].to(bias.dtype))
        grad_input, grad_weight, grad_bias = _grads_or_none(grads, ctx.needs, ctx.input_shape)
        return grad_input, grad_weight, None, grad_bias, *(None,) * 10


def fused_linear_logprobs(input, weight, target, bias, shard: VocabShard, ignore_index, temperature, softcap,
                          logit_scale, outputs, chunk_memory_bytes, grad_in_forward, backward_context):
    """:func:`tigon.ops.fused_linear_logprobs.fused_linear_logprobs` with ``weight`` (and
    ``bias``) this rank's shard of the vocabulary ``shard``: the five fields, each
    ``target``-shaped, ``None`` unless in ``outputs``."""
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(t is not None and t.requires_grad and grad_enabled for t in (input, weight, bias))
    stored = tuple(name in outputs for name in FIELDS[1:])
    bounds = target_bounds(target, ignore_index)
    fields = VocabParallelLogprobsFunction.apply(
        input, weight, target, bias, shard, ignore_index, temperature, softcap, logit_scale, stored,
        chunk_memory_bytes, needs, grad_in_forward, backward_context,
    )
    check_target_bounds(bounds, shard.vocab_size, ignore_index)
    return tuple(field.view(target.shape) if name in outputs else None for name, field in zip(FIELDS, fields))
