"""Applying a family's row of the patch table, to its modeling module or to one model.

Two ways, one table:

- **before a model is built** (``model=None``): the family's modeling module gets tigon's classes
  in place of its RMSNorm and MLP classes, tigon's rotary function in place of its own, and its
  causal LM class a wrapped ``forward`` (and ``post_init``, which registers the loss path's hook
  on each new model's ``lm_head``); every model of the family built afterwards uses them.
- **on a built model** (``model=...``): each RMSNorm and MLP instance of the model changes class
  in place (``module.__class__``), keeping its parameters, device and dtype, and the model gets
  the wrapped ``forward`` as an instance attribute. The attention layers call the rotary function
  through their modeling module's global name, so this path patches that module-level function
  as well: every model of the family in the process then uses tigon's RoPE (same math).

Patches accumulate and are idempotent; there is no unpatching.
"""

from __future__ import annotations

import importlib
import inspect
import types

import transformers

from tigon.transformers import layers
from tigon.transformers.causal_lm import (
    hook_head_loss,
    hook_head_loss_after_init,
    output_embeddings,
    wrap_causal_lm_forward,
)
from tigon.transformers.families import FAMILIES, Family

_MLP_MIXINS = {"separate": layers.TigonGatedMLP, "gate_up": layers.TigonFusedGateUpMLP}
_DERIVED: dict[tuple[type, type], type] = {}


def tigon_class(original: type, mixin: type, **settings) -> type:
    """``Tigon<Original>``: ``original`` with ``mixin``'s forward and ``settings`` as class
    attributes, made once per pair so that instances patched twice share one class."""
    if (original, mixin) not in _DERIVED:
        attributes = {**settings, "tigon_replaces": original, "__module__": __name__}
        _DERIVED[original, mixin] = type(f"Tigon{original.__name__}", (mixin, original), attributes)
    return _DERIVED[original, mixin]


def _modeling_module(family: Family):
    try:
        return importlib.import_module(family.module)
    except ImportError as error:
        raise ImportError(
            f"tigon: cannot import {family.module} for {family.model_type!r} models "
            f"(transformers {transformers.__version__}): {error}"
        ) from error


def _lookup(module, name: str, what: str, flag: str):
    found = getattr(module, name, None)
    if found is None:
        raise AttributeError(
            f"tigon: {module.__name__} has no {name!r} ({what}) in transformers {transformers.__version__}; "
            f"tigon's patch table was written for 5.17. Pass {flag}=False to skip this patch."
        )
    return found


def _class_patches(family: Family, module, rms_norm: bool, gated: bool):
    """``(name in module, original class, tigon class)`` for each enabled class patch."""
    wanted = []
    if rms_norm and family.rms_norm is not None:
        settings = dict(
            eps_attribute=family.rms_norm_eps, offset=family.rms_norm_offset, casting_mode=family.rms_norm_casting
        )
        wanted.append((family.rms_norm, "RMSNorm class", "rms_norm", layers.TigonRMSNorm, settings))
    if gated and family.mlp is not None:
        settings = dict(gate=family.gate, activation_attribute=family.activation)
        wanted.append((family.mlp, "MLP class", family.gate, _MLP_MIXINS[family.mlp_layout], settings))
    patches = []
    for name, what, flag, mixin, settings in wanted:
        found = _lookup(module, name, what, flag)
        original = getattr(found, "tigon_replaces", found)  # the module may hold tigon's class already
        patches.append((name, original, tigon_class(original, mixin, **settings)))
    return patches


def base_model(model):
    """The Hugging Face model inside ``model`` (itself, or the model a PEFT wrapper adapts)."""
    while hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def apply_family(
    family: Family, *, rope: bool, rms_norm: bool, gated: bool, cross_entropy: bool,
    fused_linear_cross_entropy: bool, model=None,
):
    """Patch ``family``'s modeling module (``model=None``) or ``model`` in place; see the module
    docstring. Returns ``model``."""
    if cross_entropy and fused_linear_cross_entropy:
        raise ValueError(
            "pass at most one of cross_entropy=True and fused_linear_cross_entropy=True: "
            "the fused loss already computes the cross entropy"
        )
    loss = "fused_linear_cross_entropy" if fused_linear_cross_entropy else "cross_entropy" if cross_entropy else None
    module = _modeling_module(family)
    class_patches = _class_patches(family, module, rms_norm, gated)
    rope_function = _lookup(module, family.rope, "rotary function", "rope") if rope and family.rope else None
    causal_lm = _lookup(module, family.causal_lm, "causal LM class", loss) if loss else None

    if model is not None:
        hf_model = base_model(model)
        model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
        if model_type != family.model_type:
            raise ValueError(f"tigon: model has model_type {model_type!r}, not {family.model_type!r}")
        for _, original, tigon in class_patches:
            if issubclass(tigon, layers.TigonMLP):
                layers.check_activation(tigon, hf_model.config)
            for layer in hf_model.modules():
                if type(layer) is original:
                    layer.__class__ = tigon
        layers.follow_gradient_checkpointing(hf_model)
    else:
        for name, _, tigon in class_patches:
            setattr(module, name, tigon)

    if rope_function is not None:
        setattr(module, family.rope, layers.apply_rotary_pos_emb)
    if causal_lm is not None:
        if model is None:
            causal_lm.forward = wrap_causal_lm_forward(causal_lm.forward, family, loss)
            if loss == "fused_linear_cross_entropy":
                causal_lm.post_init = hook_head_loss_after_init(causal_lm.post_init, family)
        elif isinstance(hf_model, causal_lm):
            forward = wrap_causal_lm_forward(type(hf_model).forward, family, loss)
            hf_model.forward = types.MethodType(forward, hf_model)
            if loss == "fused_linear_cross_entropy":
                hook_head_loss(output_embeddings(hf_model, family))
    return model


def family_patcher(model_type: str):
    """``apply_tigon_to_<family>(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
    fused_linear_cross_entropy=True, layer_norm=True, model=None)`` for one row of the table
    (``geglu=`` in place of ``swiglu=`` where the MLP is GeGLU)."""
    family = FAMILIES[model_type]
    signature = inspect.Signature(
        [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
            for name, default in (
                ("rope", True), ("rms_norm", True), (family.gate, True), ("cross_entropy", False),
                ("fused_linear_cross_entropy", True), ("layer_norm", True), ("model", None),
            )
        ]
    )

    def patch(*args, **kwargs):
        flags = signature.bind(*args, **kwargs)
        flags.apply_defaults()
        options = dict(flags.arguments)
        options["gated"] = options.pop(family.gate)
        # No family of the table has a LayerNorm: the flag keeps every patcher's flags the same.
        options.pop("layer_norm")
        return apply_family(family, **options)

    patch.__signature__ = signature
    patch.__name__ = patch.__qualname__ = f"apply_tigon_to_{model_type}"
    patch.__module__ = "tigon.transformers"
    patch.__doc__ = f"""Use tigon's kernels in {family.causal_lm} and its layers.

    Called before the model is built, patches {family.module} so that models built afterwards use
    tigon; given ``model=`` (also on GPU, in bf16, or wrapped by PEFT), patches that model in place,
    keeping its weights, and returns it.

    Args:
        rope: tigon's rotary embedding kernel.
        rms_norm: tigon's RMSNorm in place of {family.rms_norm}.
        {family.gate}: the fused {family.gate} gate in {family.mlp or "(no dense MLP in this family)"}.
        cross_entropy: in training with labels, tigon's cross entropy on the logits.
        fused_linear_cross_entropy: in training with labels, the loss straight from the hidden
            states and lm_head's weight, never building the logits (``logits=None`` is returned).
        layer_norm: accepted for a uniform signature; this family has no LayerNorm.
        model: a built model to patch in place, or ``None``.
    """
    return patch
