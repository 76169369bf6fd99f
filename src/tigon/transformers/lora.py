"""PEFT's LoRA layers on tigon's fused paths.

PEFT's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) · scaling`` as a chain of
modules (see :mod:`tigon.ops.lora` for what that costs). Once tigon patches a model (or a family's
modeling module), PEFT's ``lora.Linear.forward`` goes through :func:`lora_linear_forward`, which
calls :func:`tigon.functional.lora_linear` whenever the layer is one tigon computes exactly, and
PEFT's own forward otherwise. The patched gated MLPs go one step further under checkpointing: with
LoRA (without dropout) on any of gate, up and down they call :func:`tigon.functional.swiglu_mlp`
with the adapters, which keeps only the MLP's input (:class:`tigon.transformers.layers.TigonGatedMLP`).

The patch is on PEFT's class, so adapters added after tigon's patch (``get_peft_model`` on a
patched model, or ``SFTTrainer(peft_config=...)``) take the fused path too. Parameters, names and
saved adapter files are PEFT's own: only ``forward`` changes.

LoRA on MoE experts' stacked weights (PEFT's ``target_parameters``, ``ParamWrapper``): its forward
hands the experts the adapters' factors, which tigon's experts kernel fuses into its grouped
matmuls (see :mod:`tigon.transformers.moe`).

QLoRA: over bitsandbytes' 4-bit base layers, PEFT's ``lora.Linear4bit.forward`` runs the base
layer's own 4-bit matmul and adds the adapter by :func:`tigon.functional.add_lora` (one ``addmm``
over the base output, no fp32 copies); the whole-MLP function does not apply there.

What stays on PEFT's path (same results, PEFT's speed): DoRA and the other LoRA variants (their
magnitude vector's norm is taken over the merged weight: not a sum of two products), several
active adapters or a mixed batch (``adapter_names=``), merged or disabled adapters, a LoRA bias,
``fan_in_fan_out`` (Conv1D bases), 8-bit and hooked base layers (DeepSpeed ZeRO-3, FSDP2 shards),
and autocast (base weight and input of different dtypes).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules import module as _module

from tigon import functional as F
from tigon.nn import linear_weight_usable
from tigon.transformers import moe


class Adapter(NamedTuple):
    """The one active adapter of a PEFT LoRA layer: its weights, scaling and dropout (``None``
    without one)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    dropout: nn.Dropout | None

    def input(self, x: torch.Tensor) -> torch.Tensor | None:
        """What the adapter reads: ``None`` for ``x`` itself, else its dropout in PEFT's order and
        dtype (the same mask from the same random stream)."""
        return None if self.dropout is None else self.dropout(x.to(self.lora_a.dtype))


class FusableLoRA(NamedTuple):
    """What :func:`tigon.functional.lora_linear` needs of a PEFT LoRA layer over an ``nn.Linear``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    adapter: Adapter


def _plain_linear(linear) -> bool:
    return (
        type(linear) is nn.Linear and not isinstance(linear.weight, DTensor)
        and not (linear._forward_pre_hooks or linear._forward_hooks)
    )


def active_adapter(layer) -> Adapter | None:
    """The adapter of PEFT LoRA layer ``layer`` when tigon computes it exactly: one active plain
    LoRA adapter (no variant, no LoRA bias) with no dropout or ``nn.Dropout``; else ``None``."""
    if layer.disable_adapters or layer.merged or getattr(layer, "fan_in_fan_out", False):
        return None
    if len(layer.active_adapters) != 1:
        return None
    (name,) = layer.active_adapters
    if name not in layer.lora_A or name in layer.lora_variant:
        return None
    lora_a, lora_b, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    if not (_plain_linear(lora_a) and _plain_linear(lora_b) and lora_a.bias is None and lora_b.bias is None):
        return None
    if type(dropout) is nn.Identity or (type(dropout) is nn.Dropout and (dropout.p == 0 or not dropout.training)):
        dropout = None
    elif type(dropout) is not nn.Dropout:
        return None
    return Adapter(lora_a.weight, lora_b.weight, layer.scaling[name], dropout)


def fusable_lora(layer, x: torch.Tensor) -> FusableLoRA | None:
    """The base weight and adapter of PEFT ``lora.Linear`` layer ``layer`` when tigon computes its
    forward exactly on input ``x``; ``None`` for anything on PEFT's own path (module docstring)."""
    adapter = active_adapter(layer)
    if adapter is None or not linear_weight_usable(layer.base_layer, x):
        return None
    return FusableLoRA(layer.base_layer.weight, layer.base_layer.bias, adapter)


def mlp_projection(linear, x: torch.Tensor):
    """``(weight, adapter or None)`` of an MLP projection that the whole-MLP function takes: a plain
    bias-free ``nn.Linear``, or a fusable PEFT LoRA layer over one without dropout (the function
    recomputes its products in backward, which a dropout mask would have to be kept for); else
    ``None``."""
    if linear_weight_usable(linear, x):
        return None if linear.bias is not None else (linear.weight, None)
    peft_linear = _patched_peft_linear()
    if peft_linear is None or type(linear) is not peft_linear or linear._forward_pre_hooks or linear._forward_hooks:
        return None
    fusable = fusable_lora(linear, x)
    if fusable is None or fusable.bias is not None or fusable.adapter.dropout is not None:
        return None
    adapter = fusable.adapter
    return fusable.weight, (adapter.lora_a, adapter.lora_b, adapter.scaling)


def lora_linear_forward(forward):
    """PEFT's ``lora.Linear.forward`` through :func:`tigon.functional.lora_linear` when
    :func:`fusable_lora` allows, else ``forward`` (PEFT's own)."""

    @functools.wraps(forward)
    def tigon_lora_forward(self, x, *args, **kwargs):
        fusable = None if args or kwargs or _module._global_forward_hooks else fusable_lora(self, x)
        if fusable is None:
            return forward(self, x, *args, **kwargs)
        adapter = fusable.adapter
        return F.lora_linear(
            x, fusable.weight, adapter.lora_a, adapter.lora_b, adapter.scaling, bias=fusable.bias,
            x_adapter=adapter.input(x),
        )

    tigon_lora_forward.tigon_wraps = forward
    return tigon_lora_forward


def lora_4bit_forward(forward):
    """PEFT's ``lora.Linear4bit.forward`` (QLoRA): the base layer's own 4-bit matmul, then the
    adapter by :func:`tigon.functional.add_lora`, when :func:`active_adapter` allows and autocast
    is off; else ``forward`` (PEFT's own)."""

    @functools.wraps(forward)
    def tigon_lora_4bit_forward(self, x, *args, **kwargs):
        adapter = None
        if not (args or kwargs or _module._global_forward_hooks or torch.is_autocast_enabled(x.device.type)):
            adapter = active_adapter(self)
        if adapter is None:
            return forward(self, x, *args, **kwargs)
        base_out = self.base_layer(x)
        x_adapter = adapter.input(x)
        return F.add_lora(base_out, x if x_adapter is None else x_adapter, adapter.lora_a, adapter.lora_b, adapter.scaling)

    tigon_lora_4bit_forward.tigon_wraps = forward
    return tigon_lora_4bit_forward


def param_wrapper_forward(forward):
    """PEFT's ``ParamWrapper.forward`` (LoRA on an experts module's stacked weights): the experts
    called directly with the chain's adapters when tigon's kernel computes them
    (:func:`tigon.transformers.moe.peft_adapters`), else ``forward`` (PEFT's own)."""

    @functools.wraps(forward)
    def tigon_param_wrapper_forward(self, x, *args, **kwargs):
        adapters = None if kwargs.get("adapter_names") else moe.peft_adapters(self)
        if adapters is None:
            return forward(self, x, *args, **kwargs)
        experts = self.get_base_layer()
        with moe.handing_adapters(experts, adapters):
            return experts(x, *args, **kwargs)

    tigon_param_wrapper_forward.tigon_wraps = forward
    return tigon_param_wrapper_forward


def _patched_peft_linear():
    """PEFT's ``lora.Linear`` if it is imported and patched, else ``None`` (a cheap check, made on
    every MLP forward)."""
    layer_module = sys.modules.get("peft.tuners.lora.layer")
    linear = getattr(layer_module, "Linear", None)
    return linear if hasattr(getattr(linear, "forward", None), "tigon_wraps") else None


def _peft_patches() -> list:
    """``(PEFT layer class, tigon's wrapper of its forward)`` for each LoRA layer class tigon
    routes; empty without PEFT."""
    if importlib.util.find_spec("peft") is None:
        return []
    from peft.tuners.lora.layer import Linear

    patches = [(Linear, lora_linear_forward)]
    param_wrapper = getattr(importlib.import_module("peft.tuners.lora.layer"), "ParamWrapper", None)
    if param_wrapper is not None:  # PEFT 0.17 and newer: LoRA on parameters (target_parameters)
        patches.append((param_wrapper, param_wrapper_forward))
    if importlib.util.find_spec("bitsandbytes") is not None:
        from peft.tuners.lora.bnb import Linear4bit

        patches.append((Linear4bit, lora_4bit_forward))
    return patches


def patch_peft() -> None:
    """Route PEFT's ``lora.Linear.forward``, ``ParamWrapper.forward`` (and, with bitsandbytes,
    ``lora.Linear4bit.forward``) through tigon (idempotent; nothing without PEFT)."""
    for layer_class, wrap in _peft_patches():
        if not hasattr(layer_class.forward, "tigon_wraps"):
            layer_class.forward = wrap(layer_class.forward)


def unpatch_peft() -> None:
    """Give PEFT's LoRA layer classes back their own ``forward`` (idempotent)."""
    for layer_class, _ in _peft_patches():
        forward = vars(layer_class).get("forward")
        if hasattr(forward, "tigon_wraps"):
            layer_class.forward = forward.tigon_wraps
