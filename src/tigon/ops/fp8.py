"""FP8 matmuls for the fused losses' chunk loop (:mod:`tigon.ops.fused_linear`), in the scalings of
torchao's float8 training recipes, so that a head converted by ``convert_to_float8_training``
keeps its FP8 matmuls under tigon's fused loss.

Each of a chunk's three matmuls, ``logits = x_c @ Wᵀ``, ``dx_c = dlogits @ W`` and
``dW += dlogitsᵀ @ x_c``, runs as ``torch._scaled_mm`` on FP8 operands with fp32 accumulation
(no fast accumulation), its result in the weight's dtype (an fp32 one through bf16, as
torchao); the softmax and its gradient stay fp32 in tigon's kernel, as in bf16. An operand is
scaled by ``448 / amax`` (e4m3; 57344 for e5m2) over the whole tensor (tensorwise) or over each
row or column along the matmul's inner dimension (axiswise), its scale computed in fp64, then
rounded down to a power of two where the recipe says:

=====================  ====================  =========================  =====================
recipe                 logits                dx = dlogits @ W           dW = dlogitsᵀ @ x
=====================  ====================  =========================  =====================
tensorwise             x, W: e4m3, tensor    dlogits e5m2, W: tensor    dlogits e5m2, x: tensor
rowwise                x, W: e4m3, per row   dlogits e4m3 per row, W    dlogits, x: e4m3 per
                       (along H)             per column (along V)       column (along the rows)
rowwise_with_gw_hp     as rowwise            dlogits per row, W tensor  in the weight's dtype
=====================  ====================  =========================  =====================

(torchao's recipes, with power-of-two scales for the two rowwise ones.) Where torchao scales a
tensorwise input or output gradient over all ``N`` rows, the chunk loop scales each chunk's own:
a finer scale, as exact as the format allows. The weight's FP8 copies (one for the logits, one
column-major for ``dx``) are made once per call: ``V·H`` bytes each.

``torch._scaled_mm`` needs the inner and output dimensions to divide by 16 on the GPU: ``H`` and
``V`` must (torchao converts only such linears), and a chunk's rows, the inner dimension of
``dW``, are padded with zeros to a multiple of 16. Its operands must have the inner dimension
contiguous, so ``dW``'s take ``x`` and ``dlogits`` transposed. Each tensor is cast once for both
matmuls that take it (:func:`cast`): one kernel finds the largest magnitudes of its rows, columns
or whole (:func:`fp8_amax_kernel`), a second (:func:`fp8_cast_kernel`) reads it again and writes
its row-major and transposed FP8 copies, each with its own scales, rounding to nearest even as
``.to(float8)`` does.

With one scale per tensor, the cross entropy's dlogits skip both: the loss's kernel writes each
row's statistics, from which the chunk's largest gradient magnitude is known before the gradient
is (:func:`~tigon.ops.cross_entropy.launch_cross_entropy_fwd`), and
:func:`cross_entropy_grad_fp8_kernel` computes dlogits tile by tile straight into their two FP8
copies (:meth:`Fp8HeadMatmuls.cross_entropy_grad`). Their ``dW`` then spans several chunks per
matmul (:meth:`Fp8HeadMatmuls.group_grad_weight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import triton
import triton.language as tl

from tigon.ops._launch import interpreting, launch
from tigon.ops.cross_entropy import logits_grad

# The recipes' names, as torchao's Float8LinearConfig.from_recipe_name takes them.
RecipeName = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# torchao's floor on amax, so that an all-zero tensor gets a finite scale.
AMAX_EPS = 1e-12
# _scaled_mm's alignment of the inner and output dimensions.
ALIGN = 16
# Rows of the weight gradient computed per FP8 matmul after a chunk's first (then added).
GRAD_WEIGHT_SLICE_ROWS = 16384
# Rows (of x and dlogits: the matmul's inner dimension) that one FP8 matmul of the weight gradient
# takes at most, from consecutive chunks whose dlogits the cross entropy casts itself
# (Fp8HeadMatmuls.group_grad_weight): fewer [V, H] additions of partial products.
GRAD_WEIGHT_GROUP_ROWS = 4096


# The tile of rows and columns, and the warps, of the amax and cast kernels (the fastest of a
# few on the H100, for a chunk of dlogits [2048, 128256]).
AMAX_BLOCK_M, AMAX_BLOCK_K, AMAX_WARPS = 64, 64, 4
CAST_BLOCK_M, CAST_BLOCK_K, CAST_WARPS = 64, 128, 8
# The same for the cross entropy's gradient computed and cast in one pass (cross_entropy_grad_fp8_kernel).
GRAD_CAST_BLOCK_M, GRAD_CAST_BLOCK_K, GRAD_CAST_WARPS = 64, 128, 4
# How a copy made by fp8_cast_kernel is scaled (its ROW_SCALE and COLUMN_SCALE): not made, one
# scale per row (or column) of the input, one for the whole input.
NO_COPY, PER_SLICE, PER_TENSOR = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# Adding then subtracting 2^23 rounds an fp32 in [0, 2^22) to an integer, to nearest even.
ROUND_TO_INTEGER = tl.constexpr(8388608.0)
# FP8 bytes by the GPU's conversion (one instruction per two values), else from the bits (fp8_code).
HARDWARE_FP8_CAST = tl.constexpr(not interpreting())


@triton.jit
def fp8_code(y, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr):
    """The FP8 byte (sign, ``8 - 1 - MANT_BITS`` exponent bits of bias ``EXP_BIAS``, ``MANT_BITS``
    mantissa bits: e4m3 or e5m2) of fp32 ``y``, rounded to nearest even; ``|y|`` must not exceed
    the format's largest finite value. The GPU converts in hardware; Triton's CPU interpreter
    rounds fp32 → FP8 otherwise than the GPU (42 → 44 in e4m3, 31.6875 → 16), so there the byte is
    computed from the bits, as the GPU rounds."""
    if HARDWARE_FP8_CAST:
        if MANT_BITS == 3:
            code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        sign = (y.to(tl.uint32, bitcast=True) >> 31) << 7
        magnitude = tl.abs(y)
        exponent = ((magnitude.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        # The format's spacing at |y|: 2^(e - MANT_BITS) for normals, 2^(1 - bias - MANT_BITS) below.
        spacing_exponent = tl.maximum(exponent, 1 - EXP_BIAS) - MANT_BITS
        spacing = ((spacing_exponent + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        # Multiplying by powers of two is exact (a division would be approximate on the GPU).
        per_spacing = ((127 - spacing_exponent).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        rounded_steps = (magnitude * per_spacing + ROUND_TO_INTEGER) - ROUND_TO_INTEGER
        rounded = rounded_steps * spacing
        rounded_bits = rounded.to(tl.uint32, bitcast=True)
        rounded_exponent = ((rounded_bits >> 23) & 0xFF).to(tl.int32) - 127
        normal_code = ((rounded_exponent + EXP_BIAS).to(tl.uint32) << MANT_BITS) | (
            (rounded_bits >> (23 - MANT_BITS)) & ((1 << MANT_BITS) - 1))
        # Below the smallest normal, the code is the count of subnormal steps (the smallest
        # normal's code where rounding reached it).
        subnormal_code = rounded_steps.to(tl.uint32)
        is_normal = rounded_exponent >= 1 - EXP_BIAS
        code = (tl.where(is_normal, normal_code, subnormal_code) | sign).to(tl.uint8)
    return code


@triton.jit
def tile_amax(values):
    """The largest magnitude in a 2-D tile, in fp32."""
    return tl.max(tl.max(tl.abs(values.to(tl.float32)), axis=1), axis=0)


@triton.jit
def saturated_fp8_code(x, scale, LIMIT: tl.constexpr, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr):
    """The FP8 byte of fp32 ``x · scale`` clamped to ``±LIMIT`` (the format's largest finite
    value), as torchao's saturated cast makes it."""
    return fp8_code(tl.minimum(tl.maximum(x * scale, -LIMIT), LIMIT), MANT_BITS, EXP_BIAS)


@triton.jit
def fp8_amax_kernel(
    x_ptr, row_amax_ptr, column_amax_ptr, tensor_amax_ptr, n_rows, n_cols, x_row_stride,
    ROWS: tl.constexpr, COLUMNS: tl.constexpr, TENSOR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The largest ``|x|`` over tile ``(program_id(0), program_id(1))`` of ``x [M, K]`` (unit
    column stride), folded by atomic maxima into the zero-initialised fp32 ``row_amax [M]``
    (``ROWS``), ``column_amax [K]`` (``COLUMNS``) and ``tensor_amax [1]`` (``TENSOR``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    magnitude = tl.abs(x.to(tl.float32))
    if ROWS:
        tl.atomic_max(row_amax_ptr + rows, tl.max(magnitude, axis=1), mask=row_mask)
    if COLUMNS:
        tl.atomic_max(column_amax_ptr + cols, tl.max(magnitude, axis=0), mask=col_mask)
    if TENSOR:
        tl.atomic_max(tensor_amax_ptr, tl.max(tl.max(magnitude, axis=1), axis=0))


@triton.jit
def store_fp8_copies(
    x, rows, cols, row_mask, col_mask, padded_rows, row_scale_ptr, column_scale_ptr, out_ptr, out_t_ptr,
    out_row_stride, out_t_row_stride, ROW_SCALE: tl.constexpr, COLUMN_SCALE: tl.constexpr, LIMIT: tl.constexpr,
    MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr,
):
    """The fp32 tile ``x`` (rows ``rows``, columns ``cols`` of an ``[M, K]`` tensor) scaled and
    stored as FP8 bytes. Unless ``ROW_SCALE`` is ``NO_COPY``: into ``out [M, K]``, scaled by
    ``row_scale [M]`` (``PER_SLICE``) or ``row_scale [1]`` (``PER_TENSOR``). Unless
    ``COLUMN_SCALE`` is ``NO_COPY``: transposed into ``out_t [K, padded_rows]`` (``x`` must be
    zero in its rows past ``M``), scaled by ``column_scale [K]`` or ``column_scale [1]``. Two copies
    scaled per tensor share their scale (``row_scale``): their codes are computed once."""
    if ROW_SCALE != NO_COPY:
        if ROW_SCALE == PER_SLICE:
            scale = tl.load(row_scale_ptr + rows, mask=row_mask, other=1.0)[:, None]
        else:
            scale = tl.load(row_scale_ptr)
        row_codes = saturated_fp8_code(x, scale, LIMIT, MANT_BITS, EXP_BIAS)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :], row_codes,
                 mask=row_mask[:, None] & col_mask[None, :])
    if COLUMN_SCALE != NO_COPY:
        if (ROW_SCALE == PER_TENSOR) & (COLUMN_SCALE == PER_TENSOR):
            codes = row_codes
        else:
            if COLUMN_SCALE == PER_SLICE:
                scale = tl.load(column_scale_ptr + cols, mask=col_mask, other=1.0)[None, :]
            else:
                scale = tl.load(column_scale_ptr)
            codes = saturated_fp8_code(x, scale, LIMIT, MANT_BITS, EXP_BIAS)
        tl.store(out_t_ptr + cols.to(tl.int64)[:, None] * out_t_row_stride + rows[None, :], tl.trans(codes),
                 mask=col_mask[:, None] & (rows < padded_rows)[None, :])


@triton.jit
def fp8_cast_kernel(
    x_ptr, row_scale_ptr, column_scale_ptr, out_ptr, out_t_ptr, n_rows, n_cols, padded_rows,
    x_row_stride, out_row_stride, out_t_row_stride,
    ROW_SCALE: tl.constexpr, COLUMN_SCALE: tl.constexpr, LIMIT: tl.constexpr, MANT_BITS: tl.constexpr,
    EXP_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Tile ``(program_id(0), program_id(1))`` of ``x [M, K]`` (unit column stride) read once for
    its two FP8 copies (:func:`store_fp8_copies`)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    store_fp8_copies(x, rows, cols, row_mask, col_mask, padded_rows, row_scale_ptr, column_scale_ptr, out_ptr,
                     out_t_ptr, out_row_stride, out_t_row_stride, ROW_SCALE, COLUMN_SCALE, LIMIT, MANT_BITS,
                     EXP_BIAS)


@triton.jit
def cross_entropy_grad_fp8_kernel(
    logits_ptr, target_ptr, row_stats_ptr, scale_ptr, out_ptr, out_t_ptr, n_rows, n_cols, padded_rows,
    logits_row_stride, target_stride, row_stats_stride, out_row_stride, out_t_row_stride, softcap,
    ROW_COPY: tl.constexpr, COLUMN_COPY: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LIMIT: tl.constexpr,
    MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Tile ``(program_id(0), program_id(1))`` of the cross entropy's gradient with respect to
    ``logits [M, K]`` (:func:`~tigon.ops.cross_entropy.logits_grad`, from the rows' statistics
    ``row_stats [4, M]`` that the loss's kernel wrote), stored as its FP8 copies scaled by
    ``scale [1]`` (:func:`store_fp8_copies`): the gradient is never stored in 16 bits."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * logits_row_stride + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    # The padding rows (past M, up to padded_rows) get the zero gradient of an ignored row.
    shift = tl.load(row_stats_ptr + rows, mask=row_mask, other=float("inf"))[:, None]
    prob_scale = tl.load(row_stats_ptr + row_stats_stride + rows, mask=row_mask, other=0.0)[:, None]
    smoothing_grad = tl.load(row_stats_ptr + 2 * row_stats_stride + rows, mask=row_mask, other=0.0)[:, None]
    target_grad = tl.load(row_stats_ptr + 3 * row_stats_stride + rows, mask=row_mask, other=0.0)[:, None]
    target = tl.load(target_ptr + rows * target_stride, mask=row_mask, other=-1)[:, None]
    grad = logits_grad(x, cols[None, :], target, shift, prob_scale, smoothing_grad, target_grad, softcap,
                       HAS_SOFTCAP)
    store_fp8_copies(grad, rows, cols, row_mask, col_mask, padded_rows, scale_ptr, scale_ptr, out_ptr, out_t_ptr,
                     out_row_stride, out_t_row_stride, ROW_COPY, COLUMN_COPY, LIMIT, MANT_BITS, EXP_BIAS)


@dataclass(frozen=True)
class Fp8Recipe:
    """How a recipe scales each operand: ``axiswise`` x and W for the logits (else tensorwise),
    the output gradient's dtype, an axiswise W for ``dx``, ``dW`` in FP8 (else in the weight's
    dtype), scales rounded to powers of two."""

    axiswise: bool
    grad_dtype: torch.dtype
    weight_axiswise_for_grad_input: bool
    grad_weight_fp8: bool
    power_of_2_scales: bool


RECIPES = {
    "tensorwise": Fp8Recipe(False, E5M2, False, True, False),
    "rowwise": Fp8Recipe(True, E4M3, True, True, True),
    "rowwise_with_gw_hp": Fp8Recipe(True, E4M3, False, False, True),
}


def check_recipe(recipe: str | None, weight_shape: torch.Size) -> None:
    """Raise ``ValueError`` unless ``recipe`` is ``None`` or one of :data:`RECIPES` and the head
    ``[V, H]`` is aligned for FP8 matmuls."""
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise ValueError(f"fp8 must be None or one of {', '.join(map(repr, RECIPES))}, got {recipe!r}")
    if any(size % ALIGN for size in weight_shape):
        raise ValueError(
            f"fp8: the head's weight is {tuple(weight_shape)}; FP8 matmuls need both dimensions divisible by {ALIGN}"
        )


FORMATS = {E4M3: (3, 7), E5M2: (2, 15)}  # mantissa bits, exponent bias


def fp8_format(dtype: torch.dtype) -> dict:
    """The constexprs by which a kernel stores ``dtype`` bytes (:func:`saturated_fp8_code`): its
    largest finite value, mantissa bits and exponent bias."""
    mant_bits, exp_bias = FORMATS[dtype]
    return dict(LIMIT=torch.finfo(dtype).max, MANT_BITS=mant_bits, EXP_BIAS=exp_bias)


class Fp8Cast(NamedTuple):
    """A cast to FP8 with one dynamic scale for the whole tensor, which a kernel makes on its
    output for the torchao ``Float8Linear`` matmul that consumes it: the FP8 ``dtype``, whether
    the scale ``max(dtype) / amax`` is floored to a power of two, and what torchao's
    ``Float8TrainingTensor`` carries besides its data and scale (the 16-bit dtype it stands for,
    the linear's ``LinearMMConfig``, the operand's ``GemmInputRole``). Constants only, so that
    torch.compile takes it into its graph."""

    dtype: torch.dtype
    power_of_2: bool
    orig_dtype: torch.dtype
    linear_mm_config: object
    role: object

    def wrap(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``data`` (FP8) and ``scale`` (fp32, 0-d) as the tensor the matmul takes as cast."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        return Float8TrainingTensor(data, scale, self.orig_dtype, self.linear_mm_config, self.role)


def power_of_2_floor(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of two not above each (positive, normal) fp32 ``scale``: its mantissa
    cleared, exactly."""
    return (scale.view(torch.int32) & -(1 << 23)).view(torch.float32)


# How a copy of an operand is scaled: one scale per row (of the row-major copy) or per column
# (of the transposed copy), along the matmul's inner dimension; or one for the whole operand.
Scaling = Literal["axiswise", "tensorwise"]
_SCALE_KINDS = {None: NO_COPY, "axiswise": PER_SLICE, "tensorwise": PER_TENSOR}

# An operand in FP8 and its inverse scale: 0-d, or one per row of the FP8 tensor ([rows, 1]).
Fp8Operand = tuple[torch.Tensor, torch.Tensor]


def fp8_scales(amax: torch.Tensor, limit: float, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(limit / amax, its reciprocal)``, computed in fp64 and floored to a power of two with
    ``power_of_2`` (torchao's scales); an amax below :data:`AMAX_EPS` counts as it."""
    scale = (limit / amax.double().clamp(min=AMAX_EPS)).float()
    if power_of_2:
        scale = power_of_2_floor(scale)
    return scale, scale.reciprocal()


def cast(t: torch.Tensor, dtype: torch.dtype, rows: Scaling | None, columns: Scaling | None,
         power_of_2: bool) -> tuple[Fp8Operand | None, Fp8Operand | None]:
    """``t [M, K]`` (unit column stride) in FP8 ``dtype``, read twice (the largest magnitudes, then
    the casts) for up to two copies, each scaled by ``max(dtype) / amax`` over a slice
    (:func:`fp8_scales`) and rounded to nearest even as ``.to(dtype)`` rounds:

    - ``rows``: ``t`` row-major ``[M, K]``, scaled per row (inverse ``[M, 1]``) or per tensor
      (inverse 0-d); the first operand of a matmul over ``K``.
    - ``columns``: ``tᵀ`` row-major ``[K, M']``, its columns past ``M`` zero up to ``M'``, ``M``
      rounded up to 16; scaled per column of ``t`` (inverse ``[K, 1]``) or per tensor; a matmul
      over ``M`` takes it (its transpose, column-major, as the second operand).

    ``None`` where that copy is not wanted. Copies scaled per tensor share their scale."""
    limit = torch.finfo(dtype).max
    n_rows, n_cols = t.shape
    padded_rows = _aligned(n_rows)
    # One buffer of amaxes, zeroed once: [M] per row, [K] per column, [1] for the tensor.
    amax = torch.zeros(n_rows + n_cols + 1, dtype=torch.float32, device=t.device)
    row_amax, column_amax, tensor_amax = amax.split((n_rows, n_cols, 1))
    wanted = (rows, columns)
    if t.numel():
        launch(
            fp8_amax_kernel, (triton.cdiv(n_rows, AMAX_BLOCK_M), triton.cdiv(n_cols, AMAX_BLOCK_K)),
            t, row_amax, column_amax, tensor_amax, n_rows, n_cols, t.stride(0),
            ROWS=rows == "axiswise", COLUMNS=columns == "axiswise", TENSOR="tensorwise" in wanted,
            BLOCK_M=AMAX_BLOCK_M, BLOCK_K=AMAX_BLOCK_K, num_warps=AMAX_WARPS,
        )
    tensor = fp8_scales(tensor_amax, limit, power_of_2) if "tensorwise" in wanted else None

    def scales(scaling: Scaling | None, slice_amax: torch.Tensor):
        if scaling is None:
            return None, None
        return tensor if scaling == "tensorwise" else fp8_scales(slice_amax, limit, power_of_2)

    row_scale, row_inverse = scales(rows, row_amax)
    column_scale, column_inverse = scales(columns, column_amax)
    out = t.new_empty((n_rows, n_cols), dtype=dtype) if rows else None
    out_t = t.new_empty((n_cols, padded_rows), dtype=dtype) if columns else None
    if padded_rows * n_cols:
        launch(
            fp8_cast_kernel, (triton.cdiv(padded_rows, CAST_BLOCK_M), triton.cdiv(n_cols, CAST_BLOCK_K)),
            t, row_scale, column_scale, None if out is None else out.view(torch.uint8),
            None if out_t is None else out_t.view(torch.uint8), n_rows, n_cols, padded_rows, t.stride(0),
            n_cols, padded_rows, ROW_SCALE=_SCALE_KINDS[rows].value, COLUMN_SCALE=_SCALE_KINDS[columns].value,
            **fp8_format(dtype), BLOCK_M=CAST_BLOCK_M, BLOCK_K=CAST_BLOCK_K,
            num_warps=CAST_WARPS,
        )

    def operand(fp8: torch.Tensor | None, inverse: torch.Tensor, scaling: Scaling | None) -> Fp8Operand | None:
        if fp8 is None:
            return None
        return fp8, inverse.reshape(()) if scaling == "tensorwise" else inverse.reshape(-1, 1)

    return operand(out, row_inverse, rows), operand(out_t, column_inverse, columns)


def is_float8_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is torchao's ``Float8TrainingTensor``: FP8 ``_data`` with its ``_scale``
    (``max(dtype) / amax``), standing for a tensor of its ``dtype``."""
    data = getattr(t, "_data", None)
    return isinstance(data, torch.Tensor) and data.dtype in (E4M3, E5M2) and hasattr(t, "_scale")


def float8_operand(t: torch.Tensor) -> Fp8Operand:
    """A ``Float8TrainingTensor`` ``t [*, K]`` as an operand: its FP8 data ``[M, K]`` and the
    inverse of its scale."""
    return t._data.reshape(-1, t.shape[-1]), t._scale.float().reciprocal()


def column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same values, laid out column-major (``_scaled_mm``'s second operand)."""
    return t.t().contiguous().t()


def _aligned(rows: int) -> int:
    return -(rows // -ALIGN) * ALIGN


def scaled_mm(a, b, a_inverse, b_inverse, out_dtype: torch.dtype, out: torch.Tensor | None = None,
              alpha: float = 1.0, use_fast_accum: bool = False) -> torch.Tensor:
    """``alpha · (a · a_inverse) @ (b · b_inverse)`` by ``torch._scaled_mm``, fp32 accumulation
    (in the tensor cores' faster, coarser way with ``use_fast_accum``), in ``out_dtype`` (into
    ``out`` when given); ``alpha`` joins ``a``'s scale (fp32, before the product is rounded). An
    fp32 result is computed in bf16 and widened, as torchao does: the GPU's rowwise FP8 matmul
    has no fp32 output."""
    if alpha != 1.0:
        a_inverse = a_inverse * alpha
    compute_dtype = torch.bfloat16 if out_dtype == torch.float32 else out_dtype
    if out is not None and compute_dtype == out_dtype:
        return torch._scaled_mm(a, b, a_inverse, b_inverse, out_dtype=compute_dtype, out=out,
                                use_fast_accum=use_fast_accum)
    result = torch._scaled_mm(a, b, a_inverse, b_inverse, out_dtype=compute_dtype, use_fast_accum=use_fast_accum)
    return result.to(out_dtype) if out is None else out.copy_(result)


class Fp8HeadMatmuls:
    """The chunk loop's matmuls over ``weight [V, H]`` in FP8 by ``recipe`` (module docstring).
    A chunk's ``x`` and ``dlogits`` are each cast once, in one pass, for both of the matmuls that
    take them: row-major for the logits and ``dx``, transposed for ``dW`` (kept until then)."""

    def __init__(self, weight: torch.Tensor, recipe: str, grad_input_needed: bool = True,
                 grad_weight_needed: bool = True):
        self.recipe = RECIPES[recipe]
        self.dtype = weight.dtype
        self.scaling: Scaling = "axiswise" if self.recipe.axiswise else "tensorwise"
        # How the transposed copies of x and dlogits that an FP8 dW takes are scaled, if it is wanted.
        self.grad_weight_scaling = self.scaling if self.recipe.grad_weight_fp8 and grad_weight_needed else None
        pow2 = self.recipe.power_of_2_scales
        self.weight_for_grad_input: Fp8Operand | None = None
        if is_float8_tensor(weight):
            # Already cast, tensorwise (FSDP2 all-gathers torchao's weights in FP8 so).
            if self.recipe.axiswise:
                raise ValueError(f"fp8={recipe!r}: the weight is already FP8 with one scale (tensorwise); "
                                 "expected the tensorwise recipe")
            self.weight_fp8, self.weight_inverse = float8_operand(weight)
            if grad_input_needed:
                self.weight_for_grad_input = (column_major(self.weight_fp8), self.weight_inverse)
        else:
            columns: Scaling | None = None
            if grad_input_needed:
                columns = "axiswise" if self.recipe.weight_axiswise_for_grad_input else "tensorwise"
            (self.weight_fp8, weight_inverse), transposed = cast(weight, E4M3, self.scaling, columns, pow2)
            # The logits' second operand is Wᵀ [H, V], column-major: W's rows as they are.
            self.weight_inverse = weight_inverse.reshape(1, -1) if self.recipe.axiswise else weight_inverse
            if transposed is not None:
                weight_t, inverse = transposed
                if self.recipe.axiswise:
                    # _scaled_mm takes one granularity for both operands: dlogits' are per row, so
                    # the weight's (per column, or one, as torchao expands it) go per column of W.
                    inverse = inverse.reshape(1, -1).expand(1, weight.shape[1]).contiguous()
                self.weight_for_grad_input = (weight_t.t(), inverse)
        # (the tensor, its transposed copy) of the current chunk, for dW.
        self.x_transposed: tuple[torch.Tensor, Fp8Operand] | None = None
        self.grad_transposed: tuple[torch.Tensor, Fp8Operand] | None = None
        # (the chunk's logits, its dlogits' row-major copy) made by cross_entropy_grad, for dx.
        self.grad_cast: tuple[torch.Tensor, Fp8Operand] | None = None
        # Chunks whose dW is one matmul (group_grad_weight): dlogitsᵀ of each, side by side in
        # grad_group [V, GRAD_WEIGHT_GROUP_ROWS], and each chunk's x with its dlogits' inverse scale.
        self.grouped = False
        self.grad_group: torch.Tensor | None = None
        self.group_inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.group_columns = 0
        self.grad_weight_written = False

    @property
    def casts_cross_entropy_grad(self) -> bool:
        """Whether a cross entropy head may hand over its gradient as :meth:`cross_entropy_grad`
        makes it: with one scale per tensor, which a bound on its magnitudes gives before it is
        computed (a scale per row or column needs the gradient's own largest magnitudes)."""
        return not self.recipe.axiswise

    def group_grad_weight(self, chunk_rows: int) -> None:
        """Compute dW over consecutive chunks of ``chunk_rows`` rows in one FP8 matmul, of up to
        :data:`GRAD_WEIGHT_GROUP_ROWS` rows, instead of one per chunk each added to the others':
        for chunks whose dlogits :meth:`cross_entropy_grad` casts (one scale per tensor) and whose
        rows divide by 16 (so that only the last chunk's copy is padded). Each chunk keeps its own
        dlogits scale ``d_j``; the matmul takes the first chunk's ``d_0``, and each chunk's ``x``
        times ``d_j / d_0`` (exactly the same product), cast to FP8 with one scale for them all.
        :meth:`finish_grad_weight` computes what is left after the last chunk."""
        if self.casts_cross_entropy_grad and self.grad_weight_scaling is not None and chunk_rows % ALIGN == 0 \
                and 2 * chunk_rows <= GRAD_WEIGHT_GROUP_ROWS:
            self.grouped = True
            self.grad_weight_scaling = None  # the chunks' x are cast for dW when their group is complete

    def cross_entropy_grad(self, logits: torch.Tensor, target: torch.Tensor, row_stats: torch.Tensor,
                           grad_bound: torch.Tensor, softcap: float | None) -> None:
        """The cross entropy's dlogits of this chunk, computed from its ``logits [C, V]``,
        ``target [C]`` and the loss kernel's ``row_stats [4, C]`` and ``grad_bound [1]``
        (:func:`~tigon.ops.cross_entropy.launch_cross_entropy_fwd`), written straight to the FP8
        copies that ``dx`` and ``dW`` take, scaled by ``max / grad_bound``: in one pass, without
        a 16-bit dlogits or the pass that finds its largest magnitude. :meth:`grad_input` and
        :meth:`accumulate_grad_weight` then take ``logits`` for the dlogits they stand for."""
        limit = torch.finfo(self.recipe.grad_dtype).max
        scale, inverse = fp8_scales(grad_bound, limit, self.recipe.power_of_2_scales)
        n_rows, n_cols = logits.shape
        padded_rows = _aligned(n_rows)
        out = logits.new_empty(logits.shape, dtype=self.recipe.grad_dtype) \
            if self.weight_for_grad_input is not None else None
        if self.grouped:
            if self.grad_group is None:
                self.grad_group = logits.new_empty((n_cols, GRAD_WEIGHT_GROUP_ROWS), dtype=self.recipe.grad_dtype)
            out_t = self.grad_group[:, self.group_columns : self.group_columns + padded_rows]
        elif self.grad_weight_scaling is not None:
            out_t = logits.new_empty((n_cols, padded_rows), dtype=self.recipe.grad_dtype)
        else:
            out_t = None
        if padded_rows * n_cols:
            launch(
                cross_entropy_grad_fp8_kernel,
                (triton.cdiv(padded_rows, GRAD_CAST_BLOCK_M), triton.cdiv(n_cols, GRAD_CAST_BLOCK_K)),
                logits, target, row_stats, scale, None if out is None else out.view(torch.uint8),
                None if out_t is None else out_t.view(torch.uint8), n_rows, n_cols, padded_rows, logits.stride(0),
                target.stride(0), row_stats.stride(0), n_cols, 0 if out_t is None else out_t.stride(0),
                1.0 if softcap is None else softcap,
                ROW_COPY=(NO_COPY if out is None else PER_TENSOR).value,
                COLUMN_COPY=(NO_COPY if out_t is None else PER_TENSOR).value, HAS_SOFTCAP=softcap is not None,
                **fp8_format(self.recipe.grad_dtype), BLOCK_M=GRAD_CAST_BLOCK_M,
                BLOCK_K=GRAD_CAST_BLOCK_K, num_warps=GRAD_CAST_WARPS,
            )
        inverse = inverse.reshape(())
        self.grad_cast = None if out is None else (logits, (out, inverse))
        self.grad_transposed = None if out_t is None else (logits, (out_t, inverse))

    def logits(self, x_chunk: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """``out [C, V] = x_chunk @ Wᵀ (+ bias)``."""
        pow2 = self.recipe.power_of_2_scales
        (x_fp8, x_inverse), x_t = cast(x_chunk, E4M3, self.scaling, self.grad_weight_scaling, pow2)
        self.x_transposed = None if x_t is None else (x_chunk, x_t)
        scaled_mm(x_fp8, self.weight_fp8.t(), x_inverse, self.weight_inverse, out.dtype, out)
        if bias is not None:
            out.add_(bias)

    def grad_input(self, dlogits: torch.Tensor, out: torch.Tensor | None, alpha: float) -> torch.Tensor:
        """``dlogits [C, V] @ W`` times ``alpha``, into ``out [C, H]`` (a new tensor when ``None``)."""
        cast_grad, self.grad_cast = self.grad_cast, None
        if cast_grad is not None and cast_grad[0] is dlogits:
            grad_fp8, grad_inverse = cast_grad[1]
        else:
            (grad_fp8, grad_inverse), grad_t = cast(
                dlogits, self.recipe.grad_dtype, self.scaling, self.grad_weight_scaling, self.recipe.power_of_2_scales)
            self.grad_transposed = None if grad_t is None else (dlogits, grad_t)
        weight_fp8, weight_inverse = self.weight_for_grad_input
        return scaled_mm(grad_fp8, weight_fp8, grad_inverse, weight_inverse, self.dtype, out, alpha)

    def _transposed(self, kept: tuple[torch.Tensor, Fp8Operand] | None, t: torch.Tensor,
                    dtype: torch.dtype) -> Fp8Operand:
        """``t``'s transposed copy for dW: the one ``kept`` when it was made from ``t``, else cast."""
        if kept is not None and kept[0] is t:
            return kept[1]
        _, transposed = cast(t, dtype, None, self.scaling, self.recipe.power_of_2_scales)
        assert transposed is not None
        return transposed

    def accumulate_grad_weight(self, grad_weight: torch.Tensor, dlogits: torch.Tensor, x_chunk: torch.Tensor,
                               first: bool, alpha: float) -> None:
        """``grad_weight [V, H] (+)= alpha · dlogitsᵀ @ x_chunk`` (written when ``first``); in a
        group (:meth:`group_grad_weight`), when the group is complete."""
        if not self.recipe.grad_weight_fp8:
            grad_weight.addmm_(dlogits.t(), x_chunk, beta=0 if first else 1, alpha=alpha)
            return
        if self.grouped:
            (_, (_, grad_inverse)), self.grad_transposed = self.grad_transposed, None
            self.group_inputs.append((x_chunk, grad_inverse))
            self.group_columns += _aligned(x_chunk.shape[0])
            if self.group_columns + x_chunk.shape[0] > GRAD_WEIGHT_GROUP_ROWS:
                self.finish_grad_weight(grad_weight, alpha)
            return
        kept_grad, kept_x, self.grad_transposed, self.x_transposed = self.grad_transposed, self.x_transposed, None, None
        grad_t, grad_inverse = self._transposed(kept_grad, dlogits, self.recipe.grad_dtype)
        x_t, x_inverse = self._transposed(kept_x, x_chunk, E4M3)
        # dlogitsᵀ [V, C'] row-major and x [C', H] column-major (the rows past C zero in both);
        # x's per-column scales are per column of the product.
        x_inverse = x_inverse.reshape(1, -1) if self.recipe.axiswise else x_inverse
        self._grad_weight_matmul(grad_weight, grad_t, grad_inverse, x_t, x_inverse, first, alpha)

    def finish_grad_weight(self, grad_weight: torch.Tensor | None, alpha: float) -> None:
        """The weight gradient of the chunks of the current group (:meth:`group_grad_weight`)."""
        if not self.group_inputs:
            return
        inputs, columns, self.group_inputs, self.group_columns = self.group_inputs, self.group_columns, [], 0
        first_inverse = inputs[0][1]
        # x_j · (d_j / d_0) in fp32, so that one scale of dlogits, d_0, stands for every chunk's.
        x_group = torch.cat([x.float() * (inverse / first_inverse) for x, inverse in inputs])
        _, (x_t, x_inverse) = cast(x_group, E4M3, None, "tensorwise", False)
        self._grad_weight_matmul(grad_weight, self.grad_group[:, :columns], first_inverse, x_t, x_inverse,
                                 not self.grad_weight_written, alpha)

    def _grad_weight_matmul(self, grad_weight: torch.Tensor, grad_t: torch.Tensor, grad_inverse: torch.Tensor,
                            x_t: torch.Tensor, x_inverse: torch.Tensor, first: bool, alpha: float) -> None:
        """``grad_weight (+)= alpha · (grad_t · grad_inverse) @ (x_t · x_inverse)ᵀ`` (written when
        ``first``), from ``grad_t [V, K]`` and ``x_t [H, K]`` row-major in FP8."""
        self.grad_weight_written = True
        if first:
            scaled_mm(grad_t, x_t.t(), grad_inverse, x_inverse, grad_weight.dtype, grad_weight, alpha)
            return
        # An FP8 matmul cannot add to its output: each slice of rows of the product goes through a
        # smaller buffer and is added from there, not a whole [V, H] temporary.
        partial = grad_weight.new_empty((min(GRAD_WEIGHT_SLICE_ROWS, grad_weight.shape[0]), grad_weight.shape[1]))
        for start in range(0, grad_weight.shape[0], GRAD_WEIGHT_SLICE_ROWS):
            rows = slice(start, start + GRAD_WEIGHT_SLICE_ROWS)
            out = partial[: grad_t[rows].shape[0]]
            scaled_mm(grad_t[rows], x_t.t(), grad_inverse[rows] if grad_inverse.dim() else grad_inverse, x_inverse,
                      grad_weight.dtype, out, alpha)
            grad_weight[rows].add_(out)


class TensorwiseFp8LinearFunction(torch.autograd.Function):
    """``x @ weight.t()`` (``x [*, K]`` 16-bit, or FP8 already as a ``Float8TrainingTensor``;
    ``weight [N, K]`` 16-bit) as torchao's tensorwise ``Float8Linear`` computes it: ``x``, the weight
    and the output gradient in ``dtypes`` (input, weight, gradient), each with one scale
    (:func:`fp8_scales`, floored to a power of two with ``power_of_2``), and ``torch._scaled_mm``
    for the output, the input gradient and the weight gradient (``fast_accum``, in that order).
    Each operand is cast by :func:`cast`, which writes both copies its two matmuls take (row-major
    and transposed) from one amax pass and one cast pass. The backward keeps ``x``'s transposed copy
    (or the FP8 ``x`` itself; nothing for a weight that needs no gradient, whose matmul is skipped)
    and computes the weight gradient before the input's."""

    @staticmethod
    def forward(ctx, x, weight, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype], power_of_2: bool,
                fast_accum: tuple[bool, bool, bool]):
        grad_weight_wanted = ctx.needs_input_grad[1]
        if is_float8_tensor(x):
            x_fp8, x_inverse = float8_operand(x)
            saved_x = x_fp8 if grad_weight_wanted else None
        else:
            (x_fp8, x_inverse), transposed = cast(
                x.reshape(-1, x.shape[-1]), dtypes[0], "tensorwise", "tensorwise" if grad_weight_wanted else None,
                power_of_2)
            saved_x = transposed and transposed[0]
        (weight_fp8, weight_inverse), _ = cast(weight, dtypes[1], "tensorwise", None, power_of_2)
        output = scaled_mm(x_fp8, weight_fp8.t(), x_inverse, weight_inverse, x.dtype, use_fast_accum=fast_accum[0])
        ctx.save_for_backward(saved_x, x_inverse, weight)
        ctx.dtypes, ctx.power_of_2, ctx.fast_accum = dtypes, power_of_2, fast_accum
        ctx.x_transposed = saved_x is not x_fp8
        return output.reshape(*x.shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        saved_x, x_inverse, weight = ctx.saved_tensors
        _, weight_dtype, grad_dtype = ctx.dtypes
        grad_input_wanted, grad_weight_wanted = ctx.needs_input_grad[:2]
        if is_float8_tensor(grad_output):  # cast by a tigon kernel (the gate's gradients)
            grad_fp8, grad_inverse = float8_operand(grad_output)
            grad_fp8 = grad_fp8.contiguous()
            grad_t = grad_fp8.t().contiguous() if grad_weight_wanted else None
        else:
            rows, columns = cast(
                grad_output.reshape(-1, grad_output.shape[-1]), grad_dtype,
                "tensorwise" if grad_input_wanted else None, "tensorwise" if grad_weight_wanted else None,
                ctx.power_of_2)
            grad_fp8, grad_inverse = rows or columns
            grad_t = columns and columns[0]
        grad_input = grad_weight = None
        if grad_weight_wanted:
            x_column_major = saved_x.t() if ctx.x_transposed else column_major(saved_x)
            grad_weight = scaled_mm(grad_t, x_column_major, grad_inverse, x_inverse, grad_output.dtype,
                                    use_fast_accum=ctx.fast_accum[2])
            del x_column_major, grad_t
        if grad_input_wanted:
            _, (weight_t, weight_inverse) = cast(weight, weight_dtype, None, "tensorwise", ctx.power_of_2)
            grad_input = scaled_mm(grad_fp8, weight_t.t(), grad_inverse, weight_inverse, grad_output.dtype,
                                   use_fast_accum=ctx.fast_accum[1])
            grad_input = grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1])
        return grad_input, grad_weight, None, None, None
