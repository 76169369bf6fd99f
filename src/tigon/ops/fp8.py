"""FP8 matmuls for the fused losses' chunk loop (:mod:`tigon.ops.fused_linear`), in the scalings of
torchao's float8 training recipes, so that a head converted by ``convert_to_float8_training``
keeps its FP8 matmuls under tigon's fused loss.

Each of a chunk's three matmuls, ``logits = x_c @ Wᵀ``, ``dx_c = dlogits @ W`` and
``dW += dlogitsᵀ @ x_c``, runs as ``torch._scaled_mm`` on FP8 operands with fp32 accumulation
(no fast accumulation), its result in the weight's dtype (an fp32 one through bf16, as torchao); the softmax and its gradient stay fp32 in
tigon's kernel, as in bf16. An operand is scaled by ``448 / amax`` (e4m3; 57344 for e5m2) over
the whole tensor (tensorwise) or over each row or column along the matmul's inner dimension
(axiswise), its scale computed in fp64, then rounded down to a power of two where the recipe says:

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
``dW``, are padded with zero rows to a multiple of 16. The casts are PyTorch's (``.to(float8)``,
round to nearest even), blocked over rows so that their fp32 temporaries stay small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# The recipes' names, as torchao's Float8LinearConfig.from_recipe_name takes them.
RecipeName = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# torchao's floor on amax, so that an all-zero tensor gets a finite scale.
AMAX_EPS = 1e-12
# _scaled_mm's alignment of the inner and output dimensions.
ALIGN = 16
# Elements cast per block of rows: the fp32 temporary of one block.
CAST_BLOCK_ELEMENTS = 2**25


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


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool,
             rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [M, K]`` → ``(t_fp8 [rows or M, K], inverse scale)``: one scale for the tensor
    (``dim`` ``None``, a 0-d fp32 tensor), one per row (``dim = 1``: ``[M, 1]``) or one per column
    (``dim = 0``: ``[1, K]``), each ``max(dtype) / amax`` of its slice. ``rows`` > M pads with zero
    rows (their scale, per row, is 1)."""
    limit = torch.finfo(dtype).max
    # max |t| from its extremes: no [M, K] temporary of |t| or of an fp32 copy.
    low, high = torch.aminmax(t) if dim is None else torch.aminmax(t, dim=dim, keepdim=True)
    amax = torch.maximum(high, -low).float()
    scale = (limit / amax.double().clamp(min=AMAX_EPS)).float()
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    n_rows = t.shape[0] if rows is None else rows
    out = t.new_empty((n_rows, t.shape[1]), dtype=dtype)
    block = max(1, CAST_BLOCK_ELEMENTS // max(t.shape[1], 1))
    for start in range(0, t.shape[0], block):
        end = min(start + block, t.shape[0])
        row_scale = scale[start:end] if dim == 1 else scale
        out[start:end] = (t[start:end].float() * row_scale).clamp_(-limit, limit)
    inverse = scale.reciprocal()
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

    def logits(self, x_chunk: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """``out [C, V] = x_chunk @ Wᵀ (+ bias)``."""
        x_fp8, x_inverse = quantize(x_chunk, E4M3, 1 if self.recipe.axiswise else None, self.recipe.power_of_2_scales)
        scaled_mm(x_fp8, self.weight_fp8.t(), x_inverse, self.weight_inverse, out.dtype, out)
        if bias is not None:
            out.add_(bias)

    def grad_input(self, dlogits: torch.Tensor, out: torch.Tensor | None, alpha: float) -> torch.Tensor:
        """``dlogits [C, V] @ W`` times ``alpha``, into ``out [C, H]`` (a new tensor when ``None``)."""
        grad_fp8, grad_inverse = quantize(dlogits, self.recipe.grad_dtype, 1 if self.recipe.axiswise else None,
                                          self.recipe.power_of_2_scales)
        weight_fp8, weight_inverse = self.weight_for_grad_input
        result = scaled_mm(grad_fp8, weight_fp8, grad_inverse, weight_inverse, self.dtype, out)
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
        grad_fp8, grad_inverse = quantize(dlogits, self.recipe.grad_dtype, dim, pow2, rows)
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
