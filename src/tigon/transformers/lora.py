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

import torch
from torch.nn.modules import module as _module

from tigon import functional as F
from tigon.transformers import moe
from tigon.transformers.adapters import active_adapter, fusable_lora


def lora_linear_forward(forward):
    """PEFT's ``lora.Linear.forward`` through :func:`tigon.functional.lora_linear` when
    :func:`~tigon.transformers.adapters.fusable_lora` allows, else ``forward`` (PEFT's own)."""

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
    adapter by :func:`tigon.functional.add_lora`, when
    :func:`~tigon.transformers.adapters.active_adapter` allows and autocast is off; else ``forward``
    (PEFT's own)."""

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
