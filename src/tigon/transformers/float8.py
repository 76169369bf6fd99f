"""tigon's layers around torchao's float8 training (``convert_to_float8_training``).

Which torchao ``Float8Linear`` layers a kernel may hand an operand already cast to FP8
(:func:`float8_cast`: those of one tensorwise cast for both matmuls taking it), and the down
projection's matmuls over the gate's FP8 product with the weight gradient first
(:func:`float8_down_projection`). torchao is imported only where a model already uses it.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules import module as nn_module

from tigon.ops.fp8 import ALIGN, FORMATS, Fp8Cast, TensorwiseFp8LinearFunction
from tigon.transformers.registry import tigon_class


def is_float8_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (``convert_to_float8_training``'s), without
    importing torchao where nothing did."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    return float8_linear is not None and isinstance(module, float8_linear.Float8Linear)


def float8_cast(linear: torch.nn.Module, operand: str) -> Fp8Cast | None:
    """For a torchao ``Float8Linear`` that takes ``operand`` (``"input"``, ``"weight"`` or
    ``"grad_output"``) in one FP8 dtype with one dynamic scale for both the matmuls that use it (the ``tensorwise``
    recipe): the :class:`~tigon.ops.fp8.Fp8Cast` a kernel makes for it, handing it the
    ``Float8TrainingTensor`` it then takes as cast (it casts nothing; an input stays in FP8 for
    its backward). ``None`` for any other module or recipe."""
    if not is_float8_linear(linear):
        return None
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_training_tensor import GemmInputRole

    config = linear.config
    casts, role = {
        "input": ((config.cast_config_input, config.cast_config_input_for_grad_weight), GemmInputRole.INPUT),
        "weight": ((config.cast_config_weight, config.cast_config_weight_for_grad_input), GemmInputRole.WEIGHT),
        "grad_output": ((config.cast_config_grad_output, config.cast_config_grad_output_for_grad_weight),
                        GemmInputRole.GRAD_OUTPUT),
    }[operand]
    # Plain comparisons only: this runs inside compiled layers, and dynamo (torch 2.11) breaks the
    # graph at a set's `<=`, which leaves the gate's FP8 output at the graph's edge.
    dtype = casts[0].target_dtype
    one_tensorwise_cast = all(
        cast.target_dtype == dtype and cast.scaling_type is ScalingType.DYNAMIC
        and cast.scaling_granularity is ScalingGranularity.TENSORWISE for cast in casts
    )
    if not one_tensorwise_cast or dtype not in FORMATS:
        return None
    return Fp8Cast(dtype, config.round_scales_to_power_of_2, linear.weight.dtype, linear.linear_mm_config, role)


def kernels_may_cast(x: torch.Tensor) -> bool:
    """Whether tigon's kernels may cast their outputs (or gradients) to FP8 for torchao's
    matmuls: not on a DTensor (a tensor-parallel plan's) nor under autocast."""
    return not isinstance(x, DTensor) and not torch.is_autocast_enabled(x.device.type)


# For each cast torchao's linear makes: the operand, its cast's name in ``Float8LinearConfig``,
# its role, and the dimension a rowwise (axiswise) scale spans, for x [M, K] @ weight_t [K, N]:
# scales along K for the output's matmul, along M for the weight gradient's, along N for the
# input gradient's.
TORCHAO_CASTS = {
    "input": ("cast_config_input", "INPUT", -1),
    "weight": ("cast_config_weight", "WEIGHT", 0),
    "grad_output_for_grad_weight": ("cast_config_grad_output_for_grad_weight", "GRAD_OUTPUT", 0),
    "input_for_grad_weight": ("cast_config_input_for_grad_weight", "INPUT", 0),
    "grad_output": ("cast_config_grad_output", "GRAD_OUTPUT", -1),
    "weight_for_grad_input": ("cast_config_weight_for_grad_input", "WEIGHT", -1),
}


def torchao_cast(t: torch.Tensor, operand: str, config, linear_mm_config) -> torch.Tensor:
    """``t`` as torchao's linear of ``config`` (a ``Float8LinearConfig``) takes it in the matmul
    operand ``operand`` (a key of :data:`TORCHAO_CASTS`): cast by torchao itself, or ``t`` where
    it already is FP8 (cast by a tigon kernel, or a weight FSDP2 gathered in FP8) or where that
    cast is disabled (a matmul in high precision)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    name, role, axis = TORCHAO_CASTS[operand]
    cast_config = getattr(config, name)
    if tensor_already_casted_to_fp8(t) or cast_config.scaling_type is ScalingType.DISABLED:
        return t
    rowwise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
    return hp_tensor_to_float8_dynamic(
        t, cast_config.target_dtype, linear_mm_config, gemm_input_role=GemmInputRole[role],
        scaling_granularity=cast_config.scaling_granularity, axiswise_dim=axis if rowwise else None,
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    )


@torch._dynamo.allow_in_graph
class Float8GradWeightFirstMatmul(torch.autograd.Function):
    """``x @ weight_t`` (``x [*, K]``, 16-bit or already FP8; ``weight_t [K, N]`` the weight
    transposed) as torchao's ``Float8Linear`` of ``config`` computes it, every operand cast as
    torchao casts it (:func:`torchao_cast`), with the backward's matmuls in the other order.
    torchao's backward allocates ``grad_input [*, K]`` and then computes the weight gradient,
    whose operands are ``x``'s and the gradient's transposed casts; here those are made, used and
    freed before ``grad_input`` exists. Under the down projection, ``K`` is the MLP's width and
    ``grad_input`` the widest tensor of the backward's peak. Where both matmuls take the gradient
    in one cast per tensor (tensorwise), it is cast once (torchao casts it for each, to the same
    bytes). The results are torchao's bit for bit."""

    @staticmethod
    def forward(ctx, x, weight_t, config, linear_mm_config):
        ctx.save_for_backward(x, weight_t)
        ctx.config, ctx.linear_mm_config = config, linear_mm_config
        output = torch.mm(
            torchao_cast(x.reshape(-1, x.shape[-1]), "input", config, linear_mm_config),
            torchao_cast(weight_t, "weight", config, linear_mm_config),
        )
        return output.reshape(*x.shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        from torchao.float8.config import ScalingGranularity

        x, weight_t = ctx.saved_tensors
        config, linear_mm_config = ctx.config, ctx.linear_mm_config
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_for_weight = torchao_cast(grad, "grad_output_for_grad_weight", config, linear_mm_config)
        x_for_weight = torchao_cast(x.reshape(-1, x.shape[-1]), "input_for_grad_weight", config, linear_mm_config)
        grad_weight_t = torch.mm(grad_for_weight.t(), x_for_weight).t()
        del x_for_weight
        one_tensorwise_cast = (
            config.cast_config_grad_output == config.cast_config_grad_output_for_grad_weight
            and config.cast_config_grad_output.scaling_granularity is ScalingGranularity.TENSORWISE
        )
        grad_for_input = grad_for_weight if one_tensorwise_cast else torchao_cast(
            grad, "grad_output", config, linear_mm_config)
        del grad_for_weight
        weight_for_input = torchao_cast(weight_t, "weight_for_grad_input", config, linear_mm_config)
        grad_input = torch.mm(grad_for_input, weight_for_input.t())
        return grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1]), grad_weight_t, None, None


def tigon_casts_apply(linear: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether ``linear(x)`` runs by :func:`tigon_cast_linear`: not compiled (the
    compiler fuses torchao's casts itself), a bias-free torchao ``Float8Linear`` casting all three
    operands per tensor (:func:`float8_cast`), a plain 16-bit weight (not a DTensor, nor FP8 as
    FSDP2 gathers it), ``x`` plain (:func:`kernels_may_cast`) in the weight's dtype, and sizes the
    FP8 matmuls take (multiples of 16)."""
    if torch.compiler.is_compiling() or not is_float8_linear(linear) or linear.bias is not None:
        return False
    if any(float8_cast(linear, operand) is None for operand in ("input", "weight", "grad_output")):
        return False
    weight = linear.weight
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        type(weight) in (torch.Tensor, torch.nn.Parameter) and kernels_may_cast(x) and x.dtype == weight.dtype
        and weight.shape[0] % ALIGN == 0 and weight.shape[1] % ALIGN == 0 and rows % ALIGN == 0
    )


def tigon_cast_linear(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for a torchao ``Float8Linear`` of the tensorwise recipe, its operands cast by
    tigon's kernels (:class:`tigon.ops.fp8.TensorwiseFp8LinearFunction`) in the dtypes, scale rule
    and matmul accumulation of ``linear``'s config: torchao's bytes, scales and matmuls, its
    results bit for bit."""
    config, mm_config = linear.config, linear.linear_mm_config
    dtypes = tuple(getattr(config, name).target_dtype
                   for name in ("cast_config_input", "cast_config_weight", "cast_config_grad_output"))
    fast_accum = (mm_config.output.use_fast_accum, mm_config.grad_input.use_fast_accum,
                  mm_config.grad_weight.use_fast_accum)
    return TensorwiseFp8LinearFunction.apply(x, linear.weight, dtypes, config.round_scales_to_power_of_2, fast_accum)


class TigonFloat8Linear:
    """``forward`` of torchao's ``Float8Linear``: by :func:`tigon_cast_linear` where
    :func:`tigon_casts_apply`, else torchao's own."""

    def forward(self, input):
        return tigon_cast_linear(self, input) if tigon_casts_apply(self, input) else super().forward(input)


def float8_down_projection(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for an MLP's down projection. Where ``linear`` is a torchao ``Float8Linear``
    with no bias and no hooks, over an ``x`` that tigon's kernels may cast (:func:`kernels_may_cast`;
    the gate's product, 16-bit or cast to FP8), the weight gradient comes first: by
    :func:`tigon_cast_linear` where :func:`tigon_casts_apply`, else by
    :class:`Float8GradWeightFirstMatmul`. A hooked layer (an FSDP2 shard's, a user's) is called as
    a module."""
    hooked = linear._forward_pre_hooks or linear._forward_hooks or (
        nn_module._global_forward_pre_hooks or nn_module._global_forward_hooks)
    if not is_float8_linear(linear) or linear.bias is not None or hooked or not kernels_may_cast(x):
        return linear(x)
    if tigon_casts_apply(linear, x):
        return tigon_cast_linear(linear, x)
    return Float8GradWeightFirstMatmul.apply(x, linear.weight.t(), linear.config, linear.linear_mm_config)


def adopt_float8_linears(model: torch.nn.Module) -> None:
    """Give every torchao ``Float8Linear`` of ``model`` tigon's forward (:class:`TigonFloat8Linear`,
    its class changed in place as tigon's layers are; ``unapply_tigon`` gives it back). Nothing
    where torchao's float8 was never imported."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    if float8_linear is None:
        return
    for module in model.modules():
        if type(module) is float8_linear.Float8Linear:
            module.__class__ = tigon_class(float8_linear.Float8Linear, TigonFloat8Linear)
