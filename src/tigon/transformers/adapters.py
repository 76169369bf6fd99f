"""PEFT's LoRA layers as tigon's fused paths take them: the one adapter of a layer that tigon
computes exactly (:func:`active_adapter`, :func:`fusable_lora`), and what the whole-MLP function
takes of a projection, plain or with an adapter (:func:`mlp_projection`).

Read by the patched MLPs (:mod:`tigon.transformers.layers`) and by the forwards that
:mod:`tigon.transformers.lora` gives PEFT's layers, so it sits below both; what stays on PEFT's
path is listed there.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tigon.nn import linear_weight_usable


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


def _patched_peft_linear():
    """PEFT's ``lora.Linear`` if it is imported and patched, else ``None`` (a cheap check, made on
    every MLP forward)."""
    layer_module = sys.modules.get("peft.tuners.lora.layer")
    linear = getattr(layer_module, "Linear", None)
    return linear if hasattr(getattr(linear, "forward", None), "tigon_wraps") else None
