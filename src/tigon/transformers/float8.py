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

from tigon.ops.fp8 import FORMATS, Fp8Cast


def is_float8_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (``convert_to_float8_training``'s), without
    importing torchao where nothing did."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    return float8_linear is not None and isinstance(module, float8_linear.Float8Linear)


def float8_cast(linear: torch.nn.Module, operand: str) -> Fp8Cast | None:
    """For a torchao ``Float8Linear`` that takes ``operand`` (``"input"``, ``"weight"`` or
    ``"grad_output"``) in one FP8 dtype with one dynamic scale for both the matmuls that use it
    (the ``tensorwise`` recipe): the :class:`~tigon.ops.fp8.Fp8Cast` a kernel makes for it, handing
    it the ``Float8TrainingTensor`` it then takes as cast (it casts nothing; an input stays in FP8
    for its backward). ``None`` for any other module or recipe."""
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


def torchao_cast(t: torch.Tensor, cast: Fp8Cast) -> torch.Tensor:
    """``t`` cast by torchao itself as ``cast`` says (one dynamic scale for the whole tensor), or
    ``t`` where it already is FP8 (a weight FSDP2 gathered in FP8)."""
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    if tensor_already_casted_to_fp8(t):
        return t
    return hp_tensor_to_float8_dynamic(
        t, cast.dtype, cast.linear_mm_config, gemm_input_role=cast.role, round_scales_to_power_of_2=cast.power_of_2)


@torch._dynamo.allow_in_graph
class Float8GradWeightFirstMatmul(torch.autograd.Function):
    """``x8 @ weight_t`` (``x8 [*, K]`` already FP8, a ``Float8TrainingTensor``; ``weight_t [K, N]``
    the 16-bit weight transposed, cast as ``weight_cast`` says) with torchao's matmuls and casts,
    whose backward computes the weight gradient first. torchao's own backward allocates
    ``grad_input [*, K]`` and then computes the weight gradient, whose matmul takes ``x8`` through
    a column-major copy; here that copy is freed before ``grad_input`` exists. Under the down
    projection, ``K`` is the MLP's width and ``grad_input`` is the widest tensor of the backward's
    peak. The gradient, cast once by ``grad_cast``, feeds both matmuls (torchao casts it for each,
    to the same bytes): the gradients are torchao's bit for bit."""

    @staticmethod
    def forward(ctx, x8, weight_t, weight_cast: Fp8Cast, grad_cast: Fp8Cast):
        ctx.save_for_backward(x8, weight_t)
        ctx.weight_cast, ctx.grad_cast = weight_cast, grad_cast
        output = torch.mm(x8.reshape(-1, x8.shape[-1]), torchao_cast(weight_t, weight_cast))
        return output.reshape(*x8.shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        x8, weight_t = ctx.saved_tensors
        grad8 = torchao_cast(grad_output.reshape(-1, grad_output.shape[-1]), ctx.grad_cast)
        grad_weight_t = torch.mm(grad8.t(), x8.reshape(-1, x8.shape[-1])).t()
        grad_input = torch.mm(grad8, torchao_cast(weight_t, ctx.weight_cast).t())
        return grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1]), grad_weight_t, None, None


def float8_down_projection(linear: torch.nn.Module, x8: torch.Tensor) -> torch.Tensor:
    """``linear(x8)`` for the gate's product ``x8``, cast to FP8 for ``linear`` (a torchao
    ``Float8Linear``); by :class:`Float8GradWeightFirstMatmul` where ``linear`` has no bias and no
    hooks and casts its weight and output gradient per tensor. A hooked layer (an FSDP2 shard's, a
    user's) is called as a module."""
    weight_cast, grad_cast = float8_cast(linear, "weight"), float8_cast(linear, "grad_output")
    hooked = linear._forward_pre_hooks or linear._forward_hooks or (
        nn_module._global_forward_pre_hooks or nn_module._global_forward_hooks)
    if weight_cast is None or grad_cast is None or linear.bias is not None or hooked:
        return linear(x8)
    return Float8GradWeightFirstMatmul.apply(x8, linear.weight.t(), weight_cast, grad_cast)
