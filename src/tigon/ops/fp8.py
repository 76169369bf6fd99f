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
``dW``, are padded with zero rows to a multiple of 16. Each operand is cast by one kernel
(:func:`fp8_cast_kernel`: a row's amax and cast in one program for per-row scales; per-column and
per-tensor scales from PyTorch's ``aminmax``), rounding to nearest even as ``.to(float8)`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from tigon.ops._launch import launch

# The recipes' names, as torchao's Float8LinearConfig.from_recipe_name takes them.
RecipeName = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# torchao's floor on amax, so that an all-zero tensor gets a finite scale.
AMAX_EPS = 1e-12
# _scaled_mm's alignment of the inner and output dimensions.
ALIGN = 16


# A cast kernel's block of columns, and its warps.
CAST_BLOCK_N, CAST_WARPS = 2048, 8
# Where quantize's scale comes from in the cast kernel (its SCALE).
SCALE_ROW, SCALE_COLUMN, SCALE_TENSOR = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# Adding then subtracting 2^23 rounds an fp32 in [0, 2^22) to an integer, to nearest even.
ROUND_TO_INTEGER = tl.constexpr(8388608.0)


@triton.jit
def fp8_code(y, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr):
    """The FP8 byte (sign, ``8 - 1 - MANT_BITS`` exponent bits of bias ``EXP_BIAS``, ``MANT_BITS``
    mantissa bits) of fp32 ``y``, rounded to nearest even; ``|y|`` must not exceed the format's
    largest finite value. Computed from the bits rather than by Triton's cast: its CPU interpreter
    rounds fp32 → FP8 otherwise than the GPU (42 → 44 in e4m3, 31.6875 → 16)."""
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
    # Below the smallest normal, the code is the count of subnormal steps (the smallest normal's
    # code where rounding reached it).
    subnormal_code = rounded_steps.to(tl.uint32)
    is_normal = rounded_exponent >= 1 - EXP_BIAS
    return (tl.where(is_normal, normal_code, subnormal_code) | sign).to(tl.uint8)


@triton.jit
def fp8_cast_kernel(
    x_ptr, scale_ptr, out_ptr, inverse_ptr, n_cols, x_row_stride, out_row_stride,
    LIMIT: tl.constexpr, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr, SCALE: tl.constexpr,
    POWER_OF_2: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row ``program_id`` of ``x [M, K]`` (unit column stride) scaled and cast to FP8 bytes in
    ``out [M, K]``. ``SCALE``: ``SCALE_ROW`` computes the row's scale, ``LIMIT / amax`` (in fp64,
    then fp32, rounded down to a power of two with ``POWER_OF_2``) in a first pass over the row and
    writes its inverse to ``inverse[row]``; ``SCALE_COLUMN`` reads one per column from ``scale [K]``;
    ``SCALE_TENSOR`` one for every element from ``scale [1]``."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    if SCALE == SCALE_ROW:
        amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        row_amax = tl.maximum(tl.max(amax, axis=0).to(tl.float64), AMAX_FLOOR)
        row_scale = (LIMIT / row_amax).to(tl.float32)
        if POWER_OF_2:  # the largest power of two not above it: its mantissa cleared
            row_scale = (row_scale.to(tl.uint32, bitcast=True) & 0xFF800000).to(tl.float32, bitcast=True)
        tl.store(inverse_ptr + row, tl.div_rn(1.0, row_scale))  # as PyTorch's reciprocal rounds
    elif SCALE == SCALE_TENSOR:
        row_scale = tl.load(scale_ptr)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if SCALE == SCALE_COLUMN:
            scaled = x * tl.load(scale_ptr + cols, mask=mask, other=1.0)
        else:
            scaled = x * row_scale
        scaled = tl.minimum(tl.maximum(scaled, -LIMIT), LIMIT)
        tl.store(out_row + cols, fp8_code(scaled, MANT_BITS, EXP_BIAS), mask=mask)


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


def power_of_2_floor(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of two not above each (positive, normal) fp32 ``scale``: its mantissa
    cleared, exactly."""
    return (scale.view(torch.int32) & -(1 << 23)).view(torch.float32)


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool,
             rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [M, K]`` (unit column stride) → ``(t_fp8 [rows or M, K], inverse scale)``: one scale for
    the tensor (``dim`` ``None``, a 0-d fp32 tensor), one per row (``dim = 1``: ``[M, 1]``) or one
    per column (``dim = 0``: ``[1, K]``), each ``max(dtype) / amax`` of its slice (computed in fp64,
    floored to a power of two with ``power_of_2``), by :func:`fp8_cast_kernel` (a row's amax and
    cast in one program). ``rows`` > M pads with zero rows (their scale, per row, is 1)."""
    limit = torch.finfo(dtype).max
    n_rows = t.shape[0] if rows is None else rows
    out = t.new_empty((n_rows, t.shape[1]), dtype=dtype)
    inverse = torch.empty((t.shape[0], 1), dtype=torch.float32, device=t.device)
    scale = inverse
    if dim != 1:
        # max |t| from its extremes: no [M, K] temporary of |t| or of an fp32 copy.
        low, high = torch.aminmax(t) if dim is None else torch.aminmax(t, dim=0, keepdim=True)
        scale = (limit / torch.maximum(high, -low).double().clamp(min=AMAX_EPS)).float()
        if power_of_2:
            scale = power_of_2_floor(scale)
        inverse = scale.reciprocal()
    mant_bits, exp_bias = FORMATS[dtype]
    scale_from = SCALE_ROW if dim == 1 else SCALE_COLUMN if dim == 0 else SCALE_TENSOR
    if t.shape[0] > 0:
        launch(
            fp8_cast_kernel, (t.shape[0],), t, scale, out.view(torch.uint8), inverse, t.shape[1], t.stride(0),
            out.stride(0), LIMIT=limit, MANT_BITS=mant_bits, EXP_BIAS=exp_bias,
            SCALE=scale_from.value, POWER_OF_2=power_of_2,
            AMAX_FLOOR=AMAX_EPS, BLOCK_N=CAST_BLOCK_N, num_warps=CAST_WARPS,
        )
    if n_rows > t.shape[0]:
        out[t.shape[0]:].zero_()
        if dim == 1:
            inverse = torch.cat([inverse, inverse.new_ones((n_rows - t.shape[0], 1))])
    return out, inverse


def is_float8_weight(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is torchao's ``Float8TrainingTensor``: FP8 ``_data`` with its ``_scale``
    (``max(dtype) / amax``), standing for a tensor of its ``dtype``."""
    data = getattr(weight, "_data", None)
    return isinstance(data, torch.Tensor) and data.dtype in (E4M3, E5M2) and hasattr(weight, "_scale")


def column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same values, laid out column-major (``_scaled_mm``'s second operand)."""
    return t.t().contiguous().t()


def _aligned(rows: int) -> int:
    return -(rows // -ALIGN) * ALIGN


def scaled_mm(a, b, a_inverse, b_inverse, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(a · a_inverse) @ (b · b_inverse)`` by ``torch._scaled_mm``, fp32 accumulation, in
    ``out_dtype`` (into ``out`` when given). An fp32 result is computed in bf16 and widened, as
    torchao does: the GPU's rowwise FP8 matmul has no fp32 output."""
    compute_dtype = torch.bfloat16 if out_dtype == torch.float32 else out_dtype
    if out is not None and compute_dtype == out_dtype:
        return torch._scaled_mm(a, b, a_inverse, b_inverse, out_dtype=compute_dtype, out=out)
    result = torch._scaled_mm(a, b, a_inverse, b_inverse, out_dtype=compute_dtype)
    return result.to(out_dtype) if out is None else out.copy_(result)


class Fp8HeadMatmuls:
    """The chunk loop's matmuls over ``weight [V, H]`` in FP8 by ``recipe`` (module docstring)."""

    def __init__(self, weight: torch.Tensor, recipe: str, grad_input_needed: bool = True):
        self.recipe = RECIPES[recipe]
        self.dtype = weight.dtype
        pow2 = self.recipe.power_of_2_scales
        if is_float8_weight(weight):
            # Already cast, tensorwise (FSDP2 all-gathers torchao's weights in FP8 so).
            if self.recipe.axiswise:
                raise ValueError(f"fp8={recipe!r}: the weight is already FP8 with one scale (tensorwise); "
                                 "expected the tensorwise recipe")
            self.weight_fp8, weight_inverse = weight._data, weight._scale.float().reciprocal()
        else:
            self.weight_fp8, weight_inverse = quantize(weight, E4M3, 1 if self.recipe.axiswise else None, pow2)
        # The logits' second operand is Wᵀ [H, V], column-major: W's rows as they are.
        self.weight_inverse = weight_inverse.reshape(1, -1) if self.recipe.axiswise else weight_inverse
        self.weight_for_grad_input = None
        if grad_input_needed:
            if self.recipe.weight_axiswise_for_grad_input:
                weight_fp8, inverse = quantize(weight, E4M3, 0, pow2)
            elif self.recipe.axiswise:
                weight_fp8, inverse = quantize(weight, E4M3, None, pow2)
                # _scaled_mm takes one granularity for both operands: dlogits' are per row, so the
                # weight's one scale goes per column (as torchao expands it).
                inverse = inverse.expand(1, weight.shape[1]).contiguous()
            else:
                weight_fp8, inverse = self.weight_fp8, self.weight_inverse
            self.weight_for_grad_input = (column_major(weight_fp8), inverse)
        # Tensorwise, a chunk's x and dlogits are cast once for both of the matmuls that take them
        # (padded for dW): (the tensor, its cast), kept until the chunk's weight gradient.
        self.cast_x = self.cast_grad = None

    def _cast(self, t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``t`` cast for a matmul (:func:`quantize`); tensorwise, padded to aligned rows."""
        rows = None if self.recipe.axiswise else _aligned(t.shape[0])
        return quantize(t, dtype, dim, self.recipe.power_of_2_scales, rows)

    def logits(self, x_chunk: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """``out [C, V] = x_chunk @ Wᵀ (+ bias)``."""
        x_fp8, x_inverse = self._cast(x_chunk, E4M3, 1 if self.recipe.axiswise else None)
        if not self.recipe.axiswise:
            self.cast_x = (x_chunk, x_fp8, x_inverse)
        scaled_mm(x_fp8[: x_chunk.shape[0]], self.weight_fp8.t(), x_inverse, self.weight_inverse, out.dtype, out)
        if bias is not None:
            out.add_(bias)

    def grad_input(self, dlogits: torch.Tensor, out: torch.Tensor | None, alpha: float) -> torch.Tensor:
        """``dlogits [C, V] @ W`` times ``alpha``, into ``out [C, H]`` (a new tensor when ``None``)."""
        grad_fp8, grad_inverse = self._cast(dlogits, self.recipe.grad_dtype, 1 if self.recipe.axiswise else None)
        if not self.recipe.axiswise:
            self.cast_grad = (dlogits, grad_fp8, grad_inverse)
        weight_fp8, weight_inverse = self.weight_for_grad_input
        result = scaled_mm(grad_fp8[: dlogits.shape[0]], weight_fp8, grad_inverse, weight_inverse, self.dtype, out)
        if alpha != 1.0:
            result.mul_(alpha)
        return result

    def accumulate_grad_weight(self, grad_weight: torch.Tensor, dlogits: torch.Tensor, x_chunk: torch.Tensor,
                               first: bool, alpha: float) -> None:
        """``grad_weight [V, H] (+)= alpha · dlogitsᵀ @ x_chunk`` (written when ``first``)."""
        if not self.recipe.grad_weight_fp8:
            grad_weight.addmm_(dlogits.t(), x_chunk, beta=0 if first else 1, alpha=alpha)
            return
        rows = _aligned(dlogits.shape[0])
        dim = 0 if self.recipe.axiswise else None
        pow2 = self.recipe.power_of_2_scales
        cast_grad, cast_x, self.cast_grad, self.cast_x = self.cast_grad, self.cast_x, None, None
        if cast_grad is not None and cast_grad[0] is dlogits:
            grad_fp8, grad_inverse = cast_grad[1:]
        else:
            grad_fp8, grad_inverse = quantize(dlogits, self.recipe.grad_dtype, dim, pow2, rows)
        if cast_x is not None and cast_x[0] is x_chunk:
            x_fp8, x_inverse = cast_x[1:]
        else:
            x_fp8, x_inverse = quantize(x_chunk, E4M3, dim, pow2, rows)
        # dlogitsᵀ [V, C] row-major and x [C, H] column-major; per-column scales become per-row of dlogitsᵀ.
        partial = scaled_mm(
            grad_fp8.t().contiguous(), column_major(x_fp8),
            grad_inverse.reshape(-1, 1) if self.recipe.axiswise else grad_inverse, x_inverse, grad_weight.dtype,
        )
        if first:
            torch.mul(partial, alpha, out=grad_weight)
        else:
            grad_weight.add_(partial, alpha=alpha)
