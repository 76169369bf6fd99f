"""RMSNorm and fused residual-add + RMSNorm.

Forward, per row ``x [H]`` (fp32 math whatever the storage dtype)::

    rstd = 1 / sqrt(mean(x²) + eps)
    y    = (offset + w) · x · rstd          offset = 1 for Gemma's (1 + w)

Casting modes: ``"llama"`` rounds ``x · rstd`` to the input dtype before the weight multiplies it
(as Hugging Face's Llama does); ``"gemma"`` keeps everything in fp32 and rounds ``y`` once.

Backward, with ``x̂ = x · rstd`` and ``g = dy · (offset + w)``::

    dx = rstd · (g − x̂ · mean(g · x̂))      the second term is the gradient through rstd
    dw = Σ_rows dy · x̂

The fused variant computes ``s = x + residual`` (rounded to the input dtype, as the eager model
does), normalises ``s`` and also returns it; its backward adds the gradient arriving at ``s`` to
the one coming through the norm and returns that sum for both ``x`` and ``residual``.

Shapes: ``x [..., H]`` of fp32/bf16/fp16 with any row stride, ``weight [H]``; ``rstd`` is saved
per row in fp32. Bytes per call (the roofline): forward reads x and writes y (2·N·H elements,
plus the residual pair for the fused op), backward reads x and dy and writes dx (3·N·H).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.ops._launch import (
    as_rows,
    norm_bwd_geometry,
    num_programs_for,
    row_launch_config,
    rows_per_block,
    tigon_op,
)

CASTING_MODES = ("llama", "gemma")


@triton.jit
def rms_norm_fwd_kernel(
    X, RESIDUAL, W, Y, SUM_OUT, RSTD,
    n_rows, n_cols,
    stride_x, stride_residual, stride_y, stride_sum,
    eps, offset,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, LLAMA_CASTING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    rows64 = rows.to(tl.int64)[:, None]

    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(RESIDUAL + rows64 * stride_residual + cols[None, :], mask=mask, other=0.0)
        # The sum is rounded to the storage dtype before normalising, exactly as the eager model.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(SUM_OUT + rows64 * stride_sum + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)

    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    x_hat = x * rstd[:, None]
    if LLAMA_CASTING:
        x_hat = x_hat.to(Y.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
        x_hat = x_hat * w[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], x_hat.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_kernel(
    X, W, RSTD, DY, DSUM, DX, DW_PARTIAL,
    n_rows, n_cols,
    stride_x, stride_dy, stride_dsum, stride_dx,
    offset,
    HAS_DSUM: tl.constexpr, HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Persistent grid: program p handles row blocks p, p + P, p + 2P, ... and keeps its share of
    # dw in registers, so the weight gradient needs one small [P, H] reduction afterwards instead
    # of atomics or a serial pass over the rows.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    for block_start in range(pid * BLOCK_M, n_rows, n_programs * BLOCK_M):
        rows = block_start + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]

        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)

        x_hat = x * rstd[:, None]
        g = dy * w[None, :] if HAS_WEIGHT else dy
        if COMPUTE_DW:
            dw_acc += tl.sum(dy * x_hat, axis=0)
        mean_g_xhat = tl.sum(g * x_hat, axis=1) / n_cols
        dx = rstd[:, None] * (g - x_hat * mean_g_xhat[:, None])
        if HAS_DSUM:
            dx += tl.load(DSUM + rows64 * stride_dsum + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw_acc, mask=col_mask)


def _fwd_fake(x, residual, weight, eps, offset, casting_mode):
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    y = x.new_empty((n_rows, n_cols))
    sum_out = x.new_empty((n_rows, n_cols)) if residual is not None else x.new_empty(0)
    return y, sum_out, x.new_empty(n_rows, dtype=torch.float32)


@tigon_op("rms_norm_fwd", fake=_fwd_fake)
def rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
    eps: float, offset: float, casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x, residual [..., H]`` → ``y [N, H]``, ``x + residual [N, H]`` (empty without a residual),
    ``rstd [N]`` fp32 (of the sum when a residual is given)."""
    x2d = as_rows(x)
    n_rows, n_cols = x2d.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if residual is not None:
        residual2d = as_rows(residual)
        sum_out = torch.empty_like(y)
    else:
        residual2d, sum_out = x2d, y.new_empty(0)
    block_n, num_warps = row_launch_config(n_cols, x.element_size())
    block_m = rows_per_block(n_cols)
    rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        x2d, residual2d, weight, y, sum_out, rstd,
        n_rows, n_cols,
        x2d.stride(0), residual2d.stride(0), y.stride(0), n_cols,
        eps, offset,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        LLAMA_CASTING=casting_mode == "llama",
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y, sum_out, rstd


def _bwd_fake(dy, dsum, x, weight, rstd, offset, weight_requires_grad):
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    dw = x.new_empty(n_cols, dtype=weight.dtype) if weight is not None and weight_requires_grad else x.new_empty(0)
    return x.new_empty((n_rows, n_cols)), dw


@tigon_op("rms_norm_bwd", fake=_bwd_fake)
def rms_norm_bwd(
    dy: torch.Tensor, dsum: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None,
    rstd: torch.Tensor, offset: float, weight_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``dx [N, H]`` (including ``dsum``, the gradient arriving at ``x + residual``)
    and ``dw [H]`` (empty when the weight is absent or frozen)."""
    x2d, dy2d = as_rows(x), as_rows(dy)
    dsum2d = as_rows(dsum) if dsum is not None else dy2d
    n_rows, n_cols = x2d.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block_n = triton.next_power_of_2(n_cols)
    block_m, num_warps, programs_per_sm = norm_bwd_geometry(block_n)
    n_programs = max(1, min(triton.cdiv(n_rows, block_m), num_programs_for(x.device, programs_per_sm)))
    compute_dw = weight is not None and weight_requires_grad
    dw_partial = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x.device) if compute_dw else None
    rms_norm_bwd_kernel[(n_programs,)](
        x2d, weight, rstd, dy2d, dsum2d, dx, dw_partial,
        n_rows, n_cols,
        x2d.stride(0), dy2d.stride(0), dsum2d.stride(0), dx.stride(0),
        offset,
        HAS_DSUM=dsum is not None, HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    dw = dw_partial.sum(0).to(weight.dtype) if compute_dw else x.new_empty(0)
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """Saves ``x`` (or the residual sum) and ``rstd``; ``x̂`` is recomputed in backward."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting_mode):
        y, sum_out, rstd = rms_norm_fwd(x, residual, weight, eps, offset, casting_mode)
        normed_input = sum_out if residual is not None else x
        ctx.save_for_backward(normed_input, weight, rstd)
        ctx.offset = offset
        ctx.has_residual = residual is not None
        y = y.view(x.shape)
        if residual is None:
            return y
        return y, sum_out.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dsum=None):
        normed_input, weight, rstd = ctx.saved_tensors
        weight_requires_grad = weight is not None and ctx.needs_input_grad[2]
        dx, dw = rms_norm_bwd(dy, dsum, normed_input, weight, rstd, ctx.offset, weight_requires_grad)
        dx = dx.view(dy.shape)
        return dx, dx if ctx.has_residual else None, dw if weight_requires_grad else None, None, None, None


def rms_norm(x, weight, eps, offset, casting_mode):
    """``x [..., H]`` → ``y [..., H]``; inputs validated by :mod:`tigon.functional`."""
    return RMSNormFunction.apply(x, None, weight, eps, offset, casting_mode)


def fused_add_rms_norm(x, residual, weight, eps, offset, casting_mode):
    """``(rms_norm(x + residual), x + residual)``; inputs validated by :mod:`tigon.functional`."""
    return RMSNormFunction.apply(x, residual, weight, eps, offset, casting_mode)
