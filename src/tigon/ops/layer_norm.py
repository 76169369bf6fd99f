"""LayerNorm (``torch.nn.functional.layer_norm`` over the last dimension).

Forward, per row ``x [H]`` (fp32 math whatever the storage dtype)::

    mean = Σ x / H
    rstd = 1 / sqrt(Σ (x − mean)² / H + eps)
    x̂    = (x − mean) · rstd
    y    = x̂ · (w + offset) + b             w, b optional, each on its own

``offset`` (Nemotron's ``NemotronLayerNorm1P``: ``layer_norm(x, w + 1, b)``) is added to the
weight and the sum rounded to the weight's dtype, as the eager ``weight + 1.0`` is; the weight's
gradient is that of ``w + offset``, the same.

Backward, with ``g = dy · (w + offset)`` (the gradient arriving at ``x̂``)::

    dx = rstd · (g − mean(g) − x̂ · mean(g · x̂))
    dw = Σ_rows dy · x̂
    db = Σ_rows dy

Shapes: ``x [..., H]`` of fp32/bf16/fp16 with any row stride, ``weight``/``bias [H]`` of any float
dtype or ``None``; ``mean`` and ``rstd`` are saved per row in fp32, ``x̂`` is recomputed. Bytes
per call (the roofline): forward reads x and writes y (2·N·H elements), backward reads x and dy and
writes dx (3·N·H); the weight and bias gradients add a ``[programs, H]`` fp32 partial sum each.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tigon.ops._launch import (
    as_rows,
    cdiv,
    launch,
    next_power_of_2,
    norm_bwd_geometry,
    num_programs_for,
    row_launch_config,
    rows_per_block,
    sum_partials,
    tigon_op,
)

# Shared memory an SM gives to the backward's software pipeline (x and dy tiles in flight).
_PIPELINE_SMEM_BYTES = 128 * 1024


@triton.jit
def _offset_weight(W, cols, col_mask, offset):
    """``w + offset`` in fp32, rounded through the weight's dtype as the eager sum is (exact for
    offset 0)."""
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    return w.to(W.dtype.element_ty).to(tl.float32)


@triton.jit
def layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    n_rows, n_cols,
    stride_x, stride_y,
    eps, offset,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]

    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    # Variance of the centred row (two passes over registers), not E[x²] − mean², which cancels
    # catastrophically when |mean| ≫ std. Padding columns are zeroed so they add nothing.
    x_centred = tl.where(col_mask[None, :], x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x_centred * x_centred, axis=1) / n_cols + eps)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    y = x_centred * rstd[:, None]
    if HAS_WEIGHT:
        y = y * _offset_weight(W, cols, col_mask, offset)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_bwd_kernel(
    X, W, MEAN, RSTD, DY, DX, PARTIALS,
    n_rows, n_cols,
    stride_x, stride_dy, stride_dx, stride_partial,
    offset,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # Persistent grid: program p handles row blocks p, p + P, p + 2P, ... and keeps its share of
    # dw and db in registers, so the parameter gradients need one small [P, H] reduction
    # afterwards instead of atomics or a serial pass over the rows. The loop is software-pipelined
    # (NUM_STAGES): the next blocks' x and dy are in flight while this one is computed.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    # Rows of 16K or more leave no registers for w beside x, dy, dw and db: it is then reloaded
    # (from L2) at each step instead of being held.
    W_IN_REGISTERS: tl.constexpr = BLOCK_N < 16384
    if HAS_WEIGHT and W_IN_REGISTERS:
        w = _offset_weight(W, cols, col_mask, offset)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    for block_start in tl.range(pid * BLOCK_M, n_rows, n_programs * BLOCK_M, num_stages=NUM_STAGES):
        rows = block_start + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]

        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)

        # Padding (rows or columns) has dy = 0, so it adds nothing to the sums below.
        x_hat = (x - mean[:, None]) * rstd[:, None]
        if HAS_WEIGHT and not W_IN_REGISTERS:
            w = _offset_weight(W, cols, col_mask, offset)
        g = dy * w[None, :] if HAS_WEIGHT else dy
        if COMPUTE_DW:
            dw_acc += tl.sum(dy * x_hat, axis=0)
        if COMPUTE_DB:
            db_acc += tl.sum(dy, axis=0)
        # y depends on x through x − mean and through rstd. dx = rstd · (g − mean(g) − x̂·mean(g·x̂)):
        # g is the direct path; −mean(g) is the gradient through the mean, which every x_j shifts
        # by 1/H; −x̂·mean(g·x̂) is the gradient through rstd, whose derivative in x_j is
        # −rstd²·x̂_j / H. Both means are projections that leave dx with zero mean and no
        # component along x̂, as a normalisation's gradient must.
        mean_g = tl.sum(g, axis=1) / n_cols
        mean_g_xhat = tl.sum(g * x_hat, axis=1) / n_cols
        dx = rstd[:, None] * (g - mean_g[:, None] - x_hat * mean_g_xhat[:, None])
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    if COMPUTE_DW:
        tl.store(PARTIALS + pid * stride_partial + cols, dw_acc, mask=col_mask)
    if COMPUTE_DB:
        # PARTIALS is [P, 2, H] with both sums ([P, 1, H] with one): db's row is the last.
        tl.store(PARTIALS + pid * stride_partial + (stride_partial - n_cols) + cols, db_acc, mask=col_mask)


class _BwdConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    programs_per_sm: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def _bwd_launch_config(n_cols: int, element_size: int) -> _BwdConfig:
    """Tile and grid of the backward.

    At H = 4096 and 8192 a loop step covers ~8K elements (two rows at H = 4096) with 16 warps, so
    every thread moves 16-byte vectors and holds few enough registers for dw, db and w besides the
    tile; one such program per SM keeps the [P, H] partial sums small (P = SM count), and the
    pipeline depth is what fits ``_PIPELINE_SMEM_BYTES``: 94% of the copy ceiling on the H100.
    Narrower and wider rows take RMSNorm's swept geometry without pipelining (at H = 16384 the
    pipelined 16-warp version spilled and ran at 11%).
    """
    block_n = next_power_of_2(n_cols)
    if not 4096 <= block_n <= 8192:
        block_m, num_warps, programs_per_sm = norm_bwd_geometry(block_n)
        return _BwdConfig(block_m, block_n, num_warps, programs_per_sm, 1)
    block_m = rows_per_block(n_cols, min_elements=8192)
    tile = block_m * block_n
    num_warps = min(16, max(4, tile // 512))
    programs_per_sm = max(1, 16 // num_warps)
    stage_bytes = 2 * tile * element_size * programs_per_sm
    num_stages = max(1, min(3, _PIPELINE_SMEM_BYTES // stage_bytes))
    return _BwdConfig(block_m, block_n, num_warps, programs_per_sm, num_stages)


@functools.lru_cache(maxsize=None)
def _fwd_launch_config(n_cols: int, element_size: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the forward."""
    block_n, num_warps = row_launch_config(n_cols, element_size)
    return rows_per_block(n_cols), block_n, num_warps


def _fwd_fake(x, weight, bias, eps, offset):
    stats = x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)
    return x.new_empty(x.shape), stats, torch.empty_like(stats)


@tigon_op("layer_norm_fwd", fake=_fwd_fake)
def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., H]`` → ``y [..., H]`` in ``x.dtype`` (contiguous), ``mean [N]`` and ``rstd [N]`` in fp32."""
    x2d = as_rows(x)
    n_rows, n_cols = x2d.shape
    y = x.new_empty(x.shape)
    mean = x.new_empty(n_rows, dtype=torch.float32)
    rstd = x.new_empty(n_rows, dtype=torch.float32)
    block_m, block_n, num_warps = _fwd_launch_config(n_cols, x.element_size())
    launch(
        layer_norm_fwd_kernel, (cdiv(n_rows, block_m),),
        x2d, weight, bias, y, mean, rstd,
        n_rows, n_cols,
        x2d.stride(0), n_cols,
        eps, offset,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y, mean, rstd


def _bwd_fake(dy, x, weight, mean, rstd, offset, compute_dw, compute_db, bias_dtype):
    dw = x.new_empty(x.shape[-1], dtype=weight.dtype) if compute_dw else x.new_empty(0)
    db = x.new_empty(x.shape[-1], dtype=bias_dtype) if compute_db else x.new_empty(0)
    return x.new_empty(x.shape), dw, db


@tigon_op("layer_norm_bwd", fake=_bwd_fake)
def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
    offset: float, compute_dw: bool, compute_db: bool, bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dx [..., H]`` in ``x.dtype`` (contiguous), ``dw [H]`` in the weight's dtype
    and ``db [H]`` in ``bias_dtype`` (each empty unless computed)."""
    x2d, dy2d = as_rows(x), as_rows(dy)
    n_rows, n_cols = x2d.shape
    dx = x.new_empty(x.shape)
    config = _bwd_launch_config(n_cols, x.element_size())
    n_programs = max(1, min(cdiv(n_rows, config.block_m), num_programs_for(x.device, config.programs_per_sm)))
    weight_dtype = None if weight is None else weight.dtype
    n_param_grads = int(compute_dw) + int(compute_db)
    partials = x.new_empty((n_programs, n_param_grads, n_cols), dtype=torch.float32) if n_param_grads else None
    launch(
        layer_norm_bwd_kernel, (n_programs,),
        x2d, weight, mean, rstd, dy2d, dx, partials,
        n_rows, n_cols,
        x2d.stride(0), dy2d.stride(0), n_cols, n_param_grads * n_cols,
        offset,
        HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    dtypes = [dtype for dtype, needed in ((weight_dtype, compute_dw), (bias_dtype, compute_db)) if needed]
    sums = sum_partials(partials, *dtypes) if dtypes else ()
    dw = sums[0] if compute_dw else x.new_empty(0)
    db = sums[-1] if compute_db else x.new_empty(0)
    return dx, dw, db


class LayerNormFunction(torch.autograd.Function):
    """Saves ``x``, ``mean`` and ``rstd``; ``x̂`` is recomputed in backward. ``dw`` and ``db`` are
    computed only for parameters that require grad."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, offset):
        y, mean, rstd = layer_norm_fwd(x, weight, bias, eps, offset)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.offset = offset
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        compute_dw, compute_db = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx, dw, db = layer_norm_bwd(dy, x, weight, mean, rstd, ctx.offset, compute_dw, compute_db, ctx.bias_dtype)
        return dx, dw if compute_dw else None, db if compute_db else None, None, None


def layer_norm(x, weight, bias, eps, offset=0.0):
    """``x [..., H]`` → ``y [..., H]``; inputs validated by :mod:`tigon.functional`."""
    return LayerNormFunction.apply(x, weight, bias, eps, offset)
