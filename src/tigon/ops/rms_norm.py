"""RMSNorm, fused residual-add + RMSNorm, and RMSNorm gated by ``silu(gate)`` (optionally per group).

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

The gated variant (the output norm of Qwen3-Next's gated DeltaNet, Mamba2's and Falcon-H1's
mixers) multiplies by ``σ_g = silu(gate)`` in fp32, after the norm or before it::

    norm before gate:  y = h · σ_g,   h = w · x̂            (h rounded to the input dtype first
                                                            in "llama" casting when w has that
                                                            dtype, as torch's w · x̂ would be)
    gate before norm:  y = w · ẑ,     ẑ = z · rstd(z),  z = x · σ_g

and may normalise each of ``H / group_size`` equal slices of the row on its own (its own rstd;
``w`` stays one ``[H]`` vector). Backward, with ``silu'(g) = σ(g)·(1 + g·(1 − σ(g)))``::

    norm before gate:  dgate = dy · h · silu'(gate),   then the RMSNorm backward of dy · σ_g
    gate before norm:  the RMSNorm backward of z gives dz;  dx = dz · σ_g,  dgate = dz · x · silu'(gate)

A group is one program's row: the grid's second axis runs over the groups of a row (one when
there are none), so the kernels below serve all three ops.

Launch geometry: a program holds a ``[BLOCK_M, BLOCK_N]`` tile of rows (groups). Rows wider than
512 keep the H100-swept helpers of :mod:`tigon.ops._launch` (one to four rows a forward program,
one persistent backward program per SM with 8K-16K-element steps). Shorter rows (Qwen3-Next's
per-head [N·heads, 128], Qwen3's q/k norms) stack many rows into one tile of 16 elements a thread:
4K-element forward programs and, when there are rows enough for 4+ of them per SM, backward
programs of 64+ rows looping over 2K-element tiles, several resident per SM so that the hardware
overlaps one program's loads with another's arithmetic.

Shapes: ``x [..., H]`` (and ``gate``) of fp32/bf16/fp16 with any row stride, ``weight [H]``;
``rstd`` is saved per row (per group) in fp32. Bytes per call (the roofline): forward reads x and
writes y (2·N·H elements, plus the residual pair for the fused op, plus the gate for the gated
one), backward reads x and dy and writes dx (3·N·H; the gated op also reads gate and writes dgate:
5·N·H).
"""

from __future__ import annotations

import functools

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
from tigon.ops.fp8 import fp8_format, fp8_scales, saturated_fp8_code, tile_amax
from tigon.ops.gated import gate_activation

CASTING_MODES = ("llama", "gemma")

# Rows (groups) narrower than this (as a power of two) take the short-row geometry below.
SHORT_ROW = 1024
# Short rows: elements a thread holds per tensor (two 16-byte loads of bf16), a forward
# program's tile (8 warps, 32-64 registers: 4-5 programs resident per SM on an H100) and a
# backward step's tile (4 warps: x, dy, gate and their products take 80-170 registers by
# variant, so 3-6 programs fit).
SHORT_ROW_ELEMENTS_PER_THREAD = 16
SHORT_ROW_FWD_TILE = 4096
SHORT_ROW_BWD_TILE = 2048
# Backward programs for short rows: up to 16 per SM, more than fit at once, so that the hardware
# starts a program wherever one ends (no variant's register count can leave part of a persistent
# grid waiting for a second pass) in 3-5 waves; at least 64 rows each, so that a program's fp32
# dw partial (written, then read by the final sum) is at most ~2% of the bytes its rows move; and
# at least 4 per SM, or the swept geometry's larger steps hide the loads better.
SHORT_ROW_BWD_PROGRAMS_PER_SM = 16
SHORT_ROW_BWD_MIN_PROGRAMS_PER_SM = 4
SHORT_ROW_BWD_MIN_ROWS = 64


@triton.jit
def rms_norm_fwd_kernel(
    X, RESIDUAL, GATE, W, Y, SUM_OUT, RSTD,
    n_rows, n_cols,
    stride_x, stride_residual, stride_gate, stride_y, stride_sum,
    eps, offset,
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, LLAMA_CASTING: tl.constexpr, ROUND_BEFORE_GATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    OUTPUT: tl.constexpr = "store", SCALE=None,
    LIMIT: tl.constexpr = None, MANT_BITS: tl.constexpr = None, EXP_BIAS: tl.constexpr = None,
):
    # Program (i, g) normalises columns [g·n_cols, (g + 1)·n_cols) of row block i; n_cols is the
    # group's width (the whole row without groups, when the grid's second axis is 1). OUTPUT as
    # the gate's (gated_fwd_kernel): y stored ("store"), rounded to X's dtype and its largest
    # magnitude folded into SCALE [1] ("amax"), or rounded, times SCALE and stored as FP8 bytes
    # into Y ("fp8").
    group = tl.program_id(1)
    n_groups = tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    group_cols = group * n_cols + cols

    x = tl.load(X + rows64 * stride_x + group_cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(RESIDUAL + rows64 * stride_residual + group_cols[None, :], mask=mask, other=0.0)
        # The sum is rounded to the storage dtype before normalising, exactly as the eager model.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(SUM_OUT + rows64 * stride_sum + group_cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    if HAS_GATE:
        gate = tl.load(GATE + rows64 * stride_gate + group_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        silu_gate, _ = gate_activation(gate, "silu")
        if not NORM_BEFORE_GATE:
            x = x * silu_gate  # unrounded: the eager modules multiply the fp32 upcasts

    if OUTPUT == "fp8":
        # The amax pass's rstd: a recomputed one may differ in its last bit (another compiled
        # reduction), and so may y, past the amax that scales it.
        rstd = tl.load(RSTD + rows * n_groups + group, mask=row_mask, other=0.0)
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        tl.store(RSTD + rows * n_groups + group, rstd, mask=row_mask)
    x_hat = x * rstd[:, None]
    if LLAMA_CASTING:
        x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + group_cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        x_hat = x_hat * w[None, :]
    if HAS_GATE and NORM_BEFORE_GATE:
        if ROUND_BEFORE_GATE:
            x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
        x_hat = x_hat * silu_gate
    y = x_hat.to(X.dtype.element_ty)
    if OUTPUT == "amax":
        tl.atomic_max(SCALE, tile_amax(y))
    elif OUTPUT == "fp8":
        y = saturated_fp8_code(y.to(tl.float32), tl.load(SCALE), LIMIT, MANT_BITS, EXP_BIAS)
    if OUTPUT != "amax":
        tl.store(Y + rows64 * stride_y + group_cols[None, :], y, mask=mask)


@triton.jit
def rms_norm_bwd_kernel(
    X, GATE, W, RSTD, DY, DSUM, DX, DGATE, DW_PARTIAL,
    n_rows, n_cols,
    stride_x, stride_gate, stride_dy, stride_dsum, stride_dx, stride_dgate, stride_dw,
    offset,
    HAS_DSUM: tl.constexpr, HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, LLAMA_CASTING: tl.constexpr,
    ROUND_BEFORE_GATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Program p handles row blocks p, p + P, p + 2P, ... and keeps its share of dw in registers,
    # so the weight gradient needs one small [P, H] reduction afterwards instead of atomics or a
    # serial pass over the rows. P is one program per SM for long rows (a persistent grid) and a
    # few waves of smaller programs for many short ones. The grid's second axis is the group, as
    # in forward.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    group = tl.program_id(1)
    n_groups = tl.num_programs(1)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    group_cols = group * n_cols + cols
    if HAS_WEIGHT:
        w = tl.load(W + group_cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    for block_start in range(pid * BLOCK_M, n_rows, n_programs * BLOCK_M):
        rows = block_start + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]

        x = tl.load(X + rows64 * stride_x + group_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + group_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows * n_groups + group, mask=row_mask, other=0.0)
        if HAS_GATE:
            gate = tl.load(GATE + rows64 * stride_gate + group_cols[None, :], mask=mask, other=0.0).to(tl.float32)
            silu_gate, silu_grad = gate_activation(gate, "silu")
            if NORM_BEFORE_GATE:
                # y = h · silu(gate): the gate's gradient takes h as forward multiplied it (with
                # its roundings), and the norm below receives dh = dy · silu(gate).
                h = x * rstd[:, None]
                if LLAMA_CASTING:
                    h = h.to(X.dtype.element_ty).to(tl.float32)
                if HAS_WEIGHT:
                    h = h * w[None, :]
                if ROUND_BEFORE_GATE:
                    h = h.to(X.dtype.element_ty).to(tl.float32)
                dgate = dy * h * silu_grad
                dy = dy * silu_gate
            else:
                # The norm acts on z = x · silu(gate); its gradient dz is split by the product rule below.
                x_in = x
                x = x * silu_gate

        x_hat = x * rstd[:, None]
        g = dy * w[None, :] if HAS_WEIGHT else dy
        if COMPUTE_DW:
            dw_acc += tl.sum(dy * x_hat, axis=0)
        mean_g_xhat = tl.sum(g * x_hat, axis=1) / n_cols
        dx = rstd[:, None] * (g - x_hat * mean_g_xhat[:, None])
        if HAS_DSUM:
            dx += tl.load(DSUM + rows64 * stride_dsum + group_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            if not NORM_BEFORE_GATE:
                dgate = dx * x_in * silu_grad
                dx = dx * silu_gate
            tl.store(DGATE + rows64 * stride_dgate + group_cols[None, :], dgate.to(DGATE.dtype.element_ty), mask=mask)
        tl.store(DX + rows64 * stride_dx + group_cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * stride_dw + group_cols, dw_acc, mask=col_mask)


def _launch_fwd(x2d, residual2d, gate2d, weight, eps, offset, casting_mode, group_size, norm_before_gate, shape,
                output="store", scale=None, fp8_dtype=None, rstd=None):
    """``y`` and, with a residual, the sum, both new and contiguous in ``shape`` (``x``'s), and
    ``rstd [N · groups]``, from ``[N, H]`` row views (unit column stride); the sum is ``None``
    without a residual. ``output`` as :func:`rms_norm_fwd_kernel`'s: with ``"amax"`` ``y`` is
    ``None``, with ``"fp8"`` it holds ``fp8_dtype``'s bytes (uint8) and ``rstd`` is the amax pass's."""
    n_rows, n_cols = x2d.shape
    n_groups = n_cols // group_size
    y = None if output == "amax" else x2d.new_empty(shape, dtype=torch.uint8 if output == "fp8" else x2d.dtype)
    if rstd is None:
        rstd = x2d.new_empty(n_rows * n_groups, dtype=torch.float32)
    sum_out = x2d.new_empty(shape) if residual2d is not None else None
    block_m, block_n, num_warps = _fwd_geometry(group_size, x2d.element_size())
    launch(
        rms_norm_fwd_kernel, (cdiv(n_rows, block_m), n_groups),
        x2d, residual2d, gate2d, weight, y, sum_out, rstd,
        n_rows, group_size,
        x2d.stride(0), _row_stride(residual2d), _row_stride(gate2d), n_cols, n_cols,
        eps, offset,
        HAS_RESIDUAL=residual2d is not None, HAS_GATE=gate2d is not None, NORM_BEFORE_GATE=norm_before_gate,
        HAS_WEIGHT=weight is not None, LLAMA_CASTING=casting_mode == "llama",
        ROUND_BEFORE_GATE=_rounds_before_gate(x2d, weight, casting_mode),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        OUTPUT=output, SCALE=scale, **(fp8_format(fp8_dtype) if fp8_dtype is not None else {}),
    )
    return y, sum_out, rstd


def _launch_bwd(dy2d, dsum2d, x2d, gate2d, weight, rstd, offset, casting_mode, group_size, norm_before_gate,
                compute_dw, shape):
    """``dx`` and, with a gate, ``dgate``, new and contiguous in ``shape`` (``x``'s), and ``dw [H]``
    in the weight's dtype if ``compute_dw``, from ``[N, H]`` row views; ``None`` for those not computed."""
    n_rows, n_cols = x2d.shape
    n_groups = n_cols // group_size
    dx = x2d.new_empty(shape)
    dgate = gate2d.new_empty(shape) if gate2d is not None else None
    block_m, block_n, num_warps, n_programs = _bwd_geometry(group_size, n_rows, n_groups, x2d.device)
    dw_partial = x2d.new_empty((n_programs, n_cols), dtype=torch.float32) if compute_dw else None
    launch(
        rms_norm_bwd_kernel, (n_programs, n_groups),
        x2d, gate2d, weight, rstd, dy2d, dsum2d, dx, dgate, dw_partial,
        n_rows, group_size,
        x2d.stride(0), _row_stride(gate2d), dy2d.stride(0), _row_stride(dsum2d), n_cols, n_cols, n_cols,
        offset,
        HAS_DSUM=dsum2d is not None, HAS_GATE=gate2d is not None, NORM_BEFORE_GATE=norm_before_gate,
        HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, LLAMA_CASTING=casting_mode == "llama",
        ROUND_BEFORE_GATE=_rounds_before_gate(x2d, weight, casting_mode),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    dw = sum_partials(dw_partial, weight.dtype)[0] if compute_dw else None
    return dx, dgate, dw


@functools.lru_cache(maxsize=None)
def _fwd_geometry(group_size: int, element_size: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the forward, a program per ``BLOCK_M`` rows."""
    block_n = next_power_of_2(group_size)
    if block_n < SHORT_ROW:
        return _short_row_tile(block_n, SHORT_ROW_FWD_TILE)
    block_n, num_warps = row_launch_config(group_size, element_size)
    return rows_per_block(group_size), block_n, num_warps


@functools.lru_cache(maxsize=4096)
def _bwd_geometry(group_size: int, n_rows: int, n_groups: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, programs)`` of the backward, ``programs`` per group: the
    short-row grid when there are rows enough to fill it, else the swept persistent one."""
    block_n = next_power_of_2(group_size)
    if block_n < SHORT_ROW:
        block_m, block_n, num_warps = _short_row_tile(block_n, SHORT_ROW_BWD_TILE)
        programs = min(
            cdiv(n_rows, max(block_m, SHORT_ROW_BWD_MIN_ROWS)),
            cdiv(num_programs_for(device, SHORT_ROW_BWD_PROGRAMS_PER_SM), n_groups),
        )
        if programs * n_groups >= num_programs_for(device, SHORT_ROW_BWD_MIN_PROGRAMS_PER_SM):
            return block_m, block_n, num_warps, programs
    block_m, num_warps, programs_per_sm = norm_bwd_geometry(block_n)
    programs = cdiv(num_programs_for(device, programs_per_sm), n_groups)
    return block_m, block_n, num_warps, max(1, min(cdiv(n_rows, block_m), programs))


def _short_row_tile(block_n: int, tile: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of a ``[BLOCK_M, block_n]`` tile of ``tile`` elements
    (both powers of two), ``SHORT_ROW_ELEMENTS_PER_THREAD`` of them a thread.

    Warps follow the tile, not the row: the row-length rule of ``row_launch_config`` gives a
    128-wide row one warp, which then holds 64 elements of each tensor a thread for a 2K tile and
    ~140 registers, leaving an SM ~14 warps to hide the loads and the reductions.
    """
    block_m = max(1, tile // block_n)
    return block_m, block_n, max(1, block_m * block_n // (32 * SHORT_ROW_ELEMENTS_PER_THREAD))


def _row_stride(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None and t.dim() == 2 else 0


def _rounds_before_gate(x: torch.Tensor, weight: torch.Tensor | None, casting_mode: str) -> bool:
    """Whether ``w · x̂`` is rounded before the gate multiplies it: in Llama casting the eager
    ``weight * x̂.to(input_dtype)`` is a tensor of the promoted dtype, the input's own when the
    weight has it (Qwen3-Next's bf16 weight on bf16 activations), fp32 otherwise."""
    return casting_mode == "llama" and weight is not None and weight.dtype == x.dtype


def _n_rows(x: torch.Tensor) -> int:
    n_cols = x.shape[-1]
    return x.numel() // n_cols if n_cols else 0


def _stats_fake(x, groups=1):
    return x.new_empty(_n_rows(x) * groups, dtype=torch.float32)


def _fwd_fake(x, weight, eps, offset, casting_mode):
    return x.new_empty(x.shape), _stats_fake(x)


@tigon_op("rms_norm_fwd", fake=_fwd_fake)
def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H]`` → ``y [..., H]`` (contiguous) and ``rstd [N]`` fp32."""
    x2d = as_rows(x)
    y, _, rstd = _launch_fwd(x2d, None, None, weight, eps, offset, casting_mode, x2d.shape[1], True, x.shape)
    return y, rstd


def _fwd_fp8_fake(x, weight, eps, offset, casting_mode, dtype, power_of_2):
    return x.new_empty(x.shape, dtype=dtype), _stats_fake(x), x.new_empty((), dtype=torch.float32)


@tigon_op("rms_norm_fwd_fp8", fake=_fwd_fp8_fake)
def rms_norm_fwd_fp8(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str,
    dtype: torch.dtype, power_of_2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`rms_norm_fwd`, ``y`` cast as torchao's tensorwise cast makes it from the 16-bit
    ``y``: FP8 ``dtype [..., H]`` (contiguous) times ``scale = max(dtype) / amax`` over the whole
    tensor (fp64, floored to a power of two with ``power_of_2``); returns it, ``rstd [N]`` fp32
    and ``scale`` (fp32, 0-d). Two reads of ``x`` (the amax and ``rstd``, then the cast); the
    16-bit ``y`` is never stored. ``y`` is the one ``rstd`` gives, which may differ from
    :func:`rms_norm_fwd`'s in the last bit of a row's ``rstd`` (another compiled reduction)."""
    x2d = as_rows(x)
    n_cols = x2d.shape[1]
    amax = x2d.new_zeros(1, dtype=torch.float32)
    _, _, rstd = _launch_fwd(
        x2d, None, None, weight, eps, offset, casting_mode, n_cols, True, x.shape, output="amax", scale=amax,
    )
    scale, _ = fp8_scales(amax, torch.finfo(dtype).max, power_of_2)
    y, _, _ = _launch_fwd(
        x2d, None, None, weight, eps, offset, casting_mode, n_cols, True, x.shape, output="fp8", scale=scale,
        fp8_dtype=dtype, rstd=rstd,
    )
    return y.view(dtype), rstd, scale.reshape(())


def _fused_add_fwd_fake(x, residual, weight, eps, offset, casting_mode):
    return x.new_empty(x.shape), x.new_empty(x.shape), _stats_fake(x)


@tigon_op("fused_add_rms_norm_fwd", fake=_fused_add_fwd_fake)
def fused_add_rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
    eps: float, offset: float, casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x, residual [..., H]`` → ``y``, ``x + residual`` (both ``[..., H]``, contiguous) and the
    sum's ``rstd [N]`` fp32."""
    x2d = as_rows(x)
    return _launch_fwd(x2d, as_rows(residual), None, weight, eps, offset, casting_mode, x2d.shape[1], True, x.shape)


def _param_grad_fake(x, weight, weight_requires_grad):
    if weight is not None and weight_requires_grad:
        return x.new_empty(x.shape[-1], dtype=weight.dtype)
    return x.new_empty(0)


def _bwd_fake(dy, dsum, x, weight, rstd, offset, weight_requires_grad):
    return x.new_empty(x.shape), _param_grad_fake(x, weight, weight_requires_grad)


@tigon_op("rms_norm_bwd", fake=_bwd_fake)
def rms_norm_bwd(
    dy: torch.Tensor, dsum: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None,
    rstd: torch.Tensor, offset: float, weight_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``dx [..., H]`` (including ``dsum``, the gradient arriving at ``x + residual``)
    and ``dw [H]`` (empty when the weight is absent or frozen)."""
    x2d = as_rows(x)
    dsum2d = as_rows(dsum) if dsum is not None else None
    # The backward recomputes x̂ unrounded in either casting mode, so the mode does not matter here.
    dx, _, dw = _launch_bwd(
        as_rows(dy), dsum2d, x2d, None, weight, rstd, offset, "gemma", x2d.shape[1], True,
        weight is not None and weight_requires_grad, x.shape,
    )
    return dx, x.new_empty(0) if dw is None else dw


def _gated_fwd_fake(x, gate, weight, eps, group_size, norm_before_gate, casting_mode):
    return x.new_empty(x.shape), _stats_fake(x, x.shape[-1] // group_size)


@tigon_op("rms_norm_gated_fwd", fake=_gated_fwd_fake)
def rms_norm_gated_fwd(
    x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
    group_size: int, norm_before_gate: bool, casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, gate [..., H]`` → ``y [..., H]`` in ``x.dtype`` (contiguous) and
    ``rstd [N · H / group_size]`` fp32 (row-major over rows, then groups)."""
    gate2d = as_rows(gate) if gate is not None else None
    y, _, rstd = _launch_fwd(
        as_rows(x), None, gate2d, weight, eps, 0.0, casting_mode, group_size, norm_before_gate, x.shape,
    )
    return y, rstd


def _gated_bwd_fake(dy, x, gate, weight, rstd, group_size, norm_before_gate, casting_mode, weight_requires_grad):
    dgate = gate.new_empty(x.shape) if gate is not None else x.new_empty(0)
    return x.new_empty(x.shape), dgate, _param_grad_fake(x, weight, weight_requires_grad)


@tigon_op("rms_norm_gated_bwd", fake=_gated_bwd_fake)
def rms_norm_gated_bwd(
    dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, rstd: torch.Tensor,
    group_size: int, norm_before_gate: bool, casting_mode: str, weight_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dx [..., H]``, ``dgate [..., H]`` (empty without a gate) and ``dw [H]`` (empty
    when the weight is absent or frozen)."""
    gate2d = as_rows(gate) if gate is not None else None
    dx, dgate, dw = _launch_bwd(
        as_rows(dy), None, as_rows(x), gate2d, weight, rstd, 0.0, casting_mode, group_size, norm_before_gate,
        weight is not None and weight_requires_grad, x.shape,
    )
    return dx, x.new_empty(0) if dgate is None else dgate, x.new_empty(0) if dw is None else dw


class RMSNormFunction(torch.autograd.Function):
    """Saves ``x`` (or the residual sum) and ``rstd``; ``x̂`` is recomputed in backward."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting_mode):
        ctx.offset = offset
        ctx.has_residual = residual is not None
        if residual is None:
            y, rstd = rms_norm_fwd(x, weight, eps, offset, casting_mode)
            ctx.save_for_backward(x, weight, rstd)
            return y
        y, sum_out, rstd = fused_add_rms_norm_fwd(x, residual, weight, eps, offset, casting_mode)
        ctx.save_for_backward(sum_out, weight, rstd)
        return y, sum_out

    @staticmethod
    def backward(ctx, dy, dsum=None):
        normed_input, weight, rstd = ctx.saved_tensors
        weight_requires_grad = weight is not None and ctx.needs_input_grad[2]
        dx, dw = rms_norm_bwd(dy, dsum, normed_input, weight, rstd, ctx.offset, weight_requires_grad)
        return dx, dx if ctx.has_residual else None, dw if weight_requires_grad else None, None, None, None


@torch._dynamo.allow_in_graph
class RMSNormFp8Function(torch.autograd.Function):
    """:class:`RMSNormFunction` (no residual) whose output is the FP8 input of the matmuls that
    take it, cast in its kernels as ``cast`` (a :class:`tigon.ops.fp8.Fp8Cast`) says
    (:func:`rms_norm_fwd_fp8`); the 16-bit output is never stored. Its gradient arrives in 16
    bits, as through torchao's own cast, and the backward is :class:`RMSNormFunction`'s. Whole in
    torch.compile's graph, as :class:`tigon.ops.gated.GatedFp8Function` (for the same reason)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, cast):
        data, rstd, scale = rms_norm_fwd_fp8(x, weight, eps, offset, casting_mode, cast.dtype, cast.power_of_2)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return cast.wrap(data, scale)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        weight_requires_grad = weight is not None and ctx.needs_input_grad[1]
        dx, dw = rms_norm_bwd(dy, None, x, weight, rstd, ctx.offset, weight_requires_grad)
        return dx, dw if weight_requires_grad else None, None, None, None, None


class RMSNormGatedFunction(torch.autograd.Function):
    """Saves ``x``, ``gate`` and ``rstd``; the normalised row and ``silu(gate)`` are recomputed in
    backward."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps, group_size, norm_before_gate, casting_mode):
        y, rstd = rms_norm_gated_fwd(x, gate, weight, eps, group_size, norm_before_gate, casting_mode)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.options = (group_size, norm_before_gate, casting_mode)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        weight_requires_grad = weight is not None and ctx.needs_input_grad[2]
        dx, dgate, dw = rms_norm_gated_bwd(dy, x, gate, weight, rstd, *ctx.options, weight_requires_grad)
        return (
            dx,
            dgate if gate is not None and ctx.needs_input_grad[1] else None,
            dw if weight_requires_grad else None,
            None, None, None, None,
        )


def rms_norm(x, weight, eps, offset, casting_mode):
    """``x [..., H]`` → ``y [..., H]``; inputs validated by :mod:`tigon.functional`."""
    return RMSNormFunction.apply(x, None, weight, eps, offset, casting_mode)


def rms_norm_fp8(x, weight, eps, offset, casting_mode, cast):
    """``x [..., H]`` → ``y [..., H]`` as the FP8 tensor ``cast`` describes, for the matmuls that
    take it (:class:`RMSNormFp8Function`); ``eps``, ``offset`` and ``casting_mode`` as
    :func:`tigon.functional.rms_norm` validates them."""
    return RMSNormFp8Function.apply(x, weight, eps, offset, casting_mode, cast)


def fused_add_rms_norm(x, residual, weight, eps, offset, casting_mode):
    """``(rms_norm(x + residual), x + residual)``; inputs validated by :mod:`tigon.functional`."""
    return RMSNormFunction.apply(x, residual, weight, eps, offset, casting_mode)


def rms_norm_gated(x, gate, weight, eps, group_size, norm_before_gate, casting_mode):
    """RMSNorm of ``x [..., H]`` gated by ``silu(gate)`` (``gate`` may be ``None``), per group of
    ``group_size`` features; inputs validated by :mod:`tigon.functional`."""
    return RMSNormGatedFunction.apply(x, gate, weight, eps, group_size, norm_before_gate, casting_mode)
