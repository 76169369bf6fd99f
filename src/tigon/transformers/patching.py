"""Applying a family's row of the patch table, to its modeling module or to one model.

Two ways, one table:

- **before a model is built** (``model=None``): the family's modeling module gets tigon's classes
  in place of its norm and MLP classes, tigon's rotary functions in place of its own, and its
  head class a wrapped ``forward`` and ``post_init``, which patches each new model's layers that
  no module-level name reaches (sub-models of other families, ``torch.nn.LayerNorm``) and
  registers the loss path's hook on its ``lm_head``; every model of the family built afterwards
  uses them.
- **on a built model** (``model=...``): each norm and MLP instance of the model, and of its
  sub-models of other families, changes class in place (``module.__class__``), keeping its
  parameters, device and dtype, and the model gets the wrapped ``forward`` as an instance
  attribute. The attention layers call the rotary function through their modeling module's
  global name: each attention instance of the model changes class too, to one whose methods run
  with the module's globals but for tigon's rotary function (:func:`rotary_class`). Nothing of
  the process changes: a model never patched, of the same family, stays Hugging Face's.

Either way, each mixture-of-experts experts module that a row names is checked and its config's
``experts_implementation`` becomes ``"tigon"`` (:mod:`tigon.transformers.moe`): on a built model
at once, and on each model built after a module is patched by its head's ``post_init``.

Every transformers of :data:`~tigon.transformers.families.SUPPORTED_RANGE` is patched from the
same table: a piece of a row that the installed version lacks (the whole modeling module of a
family newer than it, a class, a rotary function, or one whose signature differs from tigon's
drop-in, a head ``forward`` without ``labels``) stays Hugging Face's, with a
:class:`MissingInTransformersWarning` naming the family, the piece and the version; the rest of
the row is patched.

Patches accumulate and are idempotent, and each has its inverse: :func:`unapply_tigon` gives a
model back its own classes, forward, hooks and experts implementation; ``unapply_tigon_to_<family>()``
gives a modeling module back its names and its head class its methods. What is shared by the whole
process (a patched modeling module's rotary function, PEFT's ``lora.Linear.forward``) goes back
once no patched model still alive and no patched module needs it.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import transformers
from packaging.version import Version
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from tigon.transformers import float8, layers, moe
from tigon.transformers.causal_lm import (
    hook_head_loss,
    output_embeddings,
    unhook_head_loss,
    unwrappable_forward,
    wrap_causal_lm_forward,
)
from tigon.transformers.families import FAMILIES, SUPPORTED_RANGE, Family, Norm, Rope
from tigon.transformers.lora import patch_peft, unpatch_peft
from tigon.transformers.registry import tigon_class

_NORM_MIXINS = {"rms": layers.TigonRMSNorm, "rms_gated": layers.TigonGatedRMSNorm, "layer": layers.TigonLayerNorm}
# The layer flags every patcher takes; a sub-row is applied when its flag is true.
LAYER_FLAGS = ("rope", "rms_norm", "layer_norm", "swiglu", "geglu", "relu2", "experts")
# Every flag a patcher takes, with its default.
FLAG_DEFAULTS = {
    **dict.fromkeys(LAYER_FLAGS, True), "cross_entropy": False, "fused_linear_cross_entropy": True, "lora": True,
}


@dataclass
class ModelPatch:
    """What a patched model needs of the process: whether PEFT's LoRA layers go through tigon for
    it."""

    lora: bool = False


@dataclass
class ModulePatch:
    """What ``apply_tigon_to_<family>()`` replaced: the modeling module's names and the head class's
    methods as they were (``None``: the head class had none of its own), the modeling modules whose
    rotary function it replaced (shared with the families of the same module), and what it needs of
    the process, as :class:`ModelPatch`."""

    names: dict[str, Any] = field(default_factory=dict)
    head_methods: dict[str, Callable | None] = field(default_factory=dict)
    rope_modules: set[str] = field(default_factory=set)
    needs: ModelPatch = field(default_factory=ModelPatch)


ModelT = TypeVar("ModelT", bound=nn.Module)

# Patched models alive (each holds its ModelPatch as ``tigon_patch``), patched modules by model
# type, and the rotary functions tigon replaced in modeling modules, by (module name, function name).
_PATCHED_MODELS: weakref.WeakSet = weakref.WeakSet()
_MODULE_PATCHES: dict[str, ModulePatch] = {}
_ORIGINAL_ROPES: dict[tuple[str, str], Callable] = {}
# The globals a patched model's code of a modeling module runs with, and the classes running with
# them, by the module's name and tigon's rotary functions (rotary_globals, rotary_class).
_ROTARY_GLOBALS: dict[tuple[str, tuple], tuple[dict[str, Any], frozenset[str]]] = {}
_ROTARY_CLASSES: dict[tuple[type, tuple], type | None] = {}


class MissingInTransformersWarning(UserWarning):
    """A piece of a family's row (its modeling module, a class, a function or a signature) that the
    installed transformers lacks or has changed: that piece is left as Hugging Face wrote it, the
    rest of the row is patched."""


def _warn_missing(family: Family, piece: str, unpatched: str, flag: str | None) -> None:
    silence = f"; pass {flag}=False to patch without it" if flag else ""
    warnings.warn(
        f"tigon: {family.model_type!r} models keep Hugging Face's {unpatched}: transformers "
        f"{transformers.__version__} {piece} (tigon is tested with transformers {SUPPORTED_RANGE}){silence}",
        MissingInTransformersWarning,
        stacklevel=3,
    )


def modeling_module(family: Family):
    """``family``'s modeling module, or ``None`` where the installed transformers has no such
    module (a family newer than it)."""
    try:
        return importlib.import_module(family.module)
    except ModuleNotFoundError as error:
        if error.name is not None and family.module.startswith(error.name):
            return None
        raise ImportError(
            f"tigon: cannot import {family.module} for {family.model_type!r} models "
            f"(transformers {transformers.__version__}): {error}"
        ) from error


def _lookup(family: Family, module, names: tuple[str, ...], what: str, flag: str | None):
    """The first of ``names`` (a class or function, the current name first, then former ones) in
    ``module``, or ``None`` with a :class:`MissingInTransformersWarning`. A dotted name is a class
    of another library (``torch.nn.LayerNorm``)."""
    for name in names:
        owner, dot, attribute = name.rpartition(".")
        found = getattr(importlib.import_module(owner) if dot else module, attribute, None)
        if found is not None:
            return found
    _warn_missing(family, f"has no {' or '.join(names)} in {module.__name__}", f"{what} ({names[0]})", flag)
    return None


def _parameter_names(function) -> list[str]:
    """The parameters of a rotary function; the kernels hub wraps one in a weightless module whose
    ``forward`` carries its signature."""
    return list(inspect.signature(function.forward if isinstance(function, nn.Module) else function).parameters)


def _class_patches(family: Family, module, flags: dict[str, bool]):
    """``(sub-row, original class, tigon class)`` for each enabled norm and MLP of ``family`` that
    the installed transformers has."""
    patches = []
    for row in (*family.norms, *family.mlps):
        if not flags[row.flag]:
            continue
        if isinstance(row, Norm):
            mixin = _NORM_MIXINS[row.kind]
            settings = dict(eps_attribute=row.eps, offset=row.offset, casting_mode=row.casting)
        else:
            mixin, settings = layers.MLP_LAYOUTS[row.layout], dict(gate=row.gate)
        found = _lookup(family, module, (row.name,), f"{type(row).__name__.lower()} class", row.flag)
        if found is None:
            continue
        original = getattr(found, "tigon_replaces", found)  # the module may hold tigon's class already
        patches.append((row, original, tigon_class(original, mixin, **settings)))
    return patches


def rope_drop_in(row: Rope, version: str | None = None) -> Callable:
    """tigon's function replacing ``row``'s in transformers ``version`` (default: the installed
    one): its form's, or a former form's up to the release that computed it so."""
    release = Version(version or transformers.__version__).release[:2]
    return layers.ROPE_FORMS[next((form for last, form in row.former_forms if release <= last), row.form)]


def _rope_patches(family: Family, module, flags: dict[str, bool]):
    """``(name in module, tigon's drop-in)`` for each rotary function of ``family`` that the
    installed transformers has with the signature of tigon's drop-in."""
    if not flags["rope"]:
        return []
    patches = []
    for row in family.ropes:
        function = _lookup(family, module, (row.name,), "rotary function", "rope")
        if function is None:
            continue
        drop_in = rope_drop_in(row)
        if function is not drop_in:
            expected, parameters = _parameter_names(drop_in), _parameter_names(function)
            if parameters != expected:
                _warn_missing(
                    family, f"declares {module.__name__}.{row.name}({', '.join(parameters)})",
                    f"rotary function ({row.name}), as tigon's takes ({', '.join(expected)})", "rope",
                )
                continue
        patches.append((row.name, drop_in))
    return patches


def _experts_classes(family: Family, module, flags: dict[str, bool]) -> list[type]:
    """The experts classes of ``family`` (as Hugging Face wrote them) that the installed
    transformers has, where the flag is on."""
    if not flags["experts"]:
        return []
    found = [
        _lookup(family, module, (row.name, *row.former_names), "experts class", row.flag) for row in family.experts
    ]
    return [getattr(experts_class, "tigon_replaces", experts_class) for experts_class in found if experts_class]


def _reads(code: types.CodeType, names: frozenset[str]) -> bool:
    """Whether ``code``, or code nested in it (a comprehension, a local function), names one of
    ``names`` (a global read; an attribute of that name counts too, which costs a needless copy at
    most)."""
    return not names.isdisjoint(code.co_names) or any(
        isinstance(const, types.CodeType) and _reads(const, names) for const in code.co_consts
    )


def _copy(function: types.FunctionType, scope: dict[str, Any], closure: tuple | None) -> types.FunctionType:
    """A copy of ``function`` that reads its globals from ``scope`` and closes over ``closure``."""
    copy = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__, copy.__doc__ = function.__qualname__, function.__doc__
    copy.__module__, copy.__annotations__ = function.__module__, function.__annotations__
    copy.__dict__.update(function.__dict__)
    return copy


def _rebound(value: Any, module_globals: dict[str, Any], scope: dict[str, Any], names: frozenset[str], depth: int = 0):
    """``value`` reading ``scope`` in place of ``module_globals`` where it reads one of ``names``,
    or ``None`` where it reads none: a function of the module is copied; a decorator's wrapper (up
    to a few deep) is rebuilt around the rebound function it closes over."""
    if not isinstance(value, types.FunctionType):
        return None
    if value.__globals__ is module_globals and _reads(value.__code__, names):
        return _copy(value, scope, value.__closure__)
    cells = value.__closure__ or ()
    if depth == 3 or not cells:
        return None
    rebound = [
        _rebound(cell.cell_contents, module_globals, scope, names, depth + 1) if _filled(cell) else None
        for cell in cells
    ]
    if all(new is None for new in rebound):
        return None
    closure = tuple(cell if new is None else types.CellType(new) for cell, new in zip(cells, rebound))
    return _copy(value, value.__globals__, closure)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def rotary_globals(module, replacements: tuple[tuple[str, Callable], ...]) -> tuple[dict[str, Any], frozenset[str]]:
    """``(globals, names)``: the globals that a patched model's code of modeling module ``module``
    runs with, and the names in them that differ from the module's own. They are the module's names
    (as they are when its first model is patched) with ``replacements`` (rotary function name,
    tigon's drop-in) in place, and each function of the module that reaches one of them (Gemma 4's
    ``apply_multidimensional_rope``) copied to read these globals."""
    key = (module.__name__, replacements)
    if key not in _ROTARY_GLOBALS:
        module_globals = vars(module)
        scope = {**module_globals, **dict(replacements)}
        # Without a module name: torch.compile reads the globals of a function whose globals name
        # a module from that module (Hugging Face's rotary function), and from the dict itself
        # only when they name none.
        del scope["__name__"]
        names = frozenset(name for name, _ in replacements)
        grown = True
        while grown:
            grown = False
            for name, value in module_globals.items():
                copy = None if name in names else _rebound(value, module_globals, scope, names)
                if copy is not None:
                    scope[name], names, grown = copy, names | {name}, True
        _ROTARY_GLOBALS[key] = scope, names
    return _ROTARY_GLOBALS[key]


def rotary_class(original: type, module, replacements: tuple[tuple[str, Callable], ...]) -> type | None:
    """``Tigon<Original>``, ``original`` (an attention class, say) with each of its methods that
    reaches a rotary function of ``module`` copied to run with :func:`rotary_globals`; ``None``
    where ``original`` has no such method. Made once per class and replacements."""
    key = (original, (module.__name__, replacements))
    if key not in _ROTARY_CLASSES:
        scope, names = rotary_globals(module, replacements)
        methods, seen = {}, set()
        for owner in original.__mro__:  # each name as the class resolves it
            for name, value in vars(owner).items():
                if name in seen:
                    continue
                seen.add(name)
                copy = _rebound(value, vars(module), scope, names) if owner.__module__ == module.__name__ else None
                if copy is not None:
                    methods[name] = copy
        attributes = {**methods, "tigon_replaces": original, "__module__": __name__}
        _ROTARY_CLASSES[key] = type(f"Tigon{original.__name__}", (original,), attributes) if methods else None
    return _ROTARY_CLASSES[key]


def _replace_rope(module, name: str, function: Callable) -> None:
    """``module.<name> = function``, keeping Hugging Face's function the first time."""
    current = getattr(module, name)
    if current not in layers.ROPE_FORMS.values():
        _ORIGINAL_ROPES.setdefault((module.__name__, name), current)
    setattr(module, name, function)


def _release_shared() -> None:
    """Put back each rotary function that no patched module needs any more, and PEFT's LoRA forward
    once no patched model alive and no patched module needs it."""
    needs = [patch.needs for patch in _MODULE_PATCHES.values()]
    needs += [model.tigon_patch for model in _PATCHED_MODELS]
    in_use = set().union(*(patch.rope_modules for patch in _MODULE_PATCHES.values()))
    for (module_name, name), original in list(_ORIGINAL_ROPES.items()):
        if module_name not in in_use:
            setattr(sys.modules[module_name], name, original)
            del _ORIGINAL_ROPES[module_name, name]
    if not any(need.lora for need in needs):
        unpatch_peft()


def _register_model(model, lora: bool) -> None:
    patch = vars(model).setdefault("tigon_patch", ModelPatch())
    patch.lora |= lora
    _PATCHED_MODELS.add(model)


def base_model(model):
    """The Hugging Face model inside ``model`` (itself, or the model a PEFT wrapper adapts)."""
    while hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def families_in(model, family: Family) -> list[Family]:
    """``family`` and the rows of the sub-models ``model`` holds (a vision-language model's
    language model and vision tower), found by their ``config.model_type``."""
    found = {family.model_type: family}
    for module in model.modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if isinstance(module, transformers.PreTrainedModel) and model_type in FAMILIES:
            found.setdefault(model_type, FAMILIES[model_type])
    return list(found.values())


def patch_layers(model, family: Family, flags: dict[str, bool]) -> None:
    """Patch in place the layers of ``model`` that ``family`` and its sub-models' rows name: each
    norm and MLP instance changes class (``module.__class__``), keeping its parameters, device and
    dtype, as does each torchao ``Float8Linear`` (:func:`~tigon.transformers.float8.adopt_float8_linears`)
    and each module calling a rotary function of the rows (:func:`rotary_class`); each experts
    module runs on tigon's experts kernel (its config's ``experts_implementation``)."""
    tigon_of = {}
    rotary = []
    experts_classes = []
    norm_inputs = []
    for row_family in families_in(model, family):
        module = modeling_module(row_family)
        class_patches = _class_patches(row_family, module, flags)
        tigon_of.update((original, tigon) for _, original, tigon in class_patches)
        norm_inputs.append(({tigon for _, _, tigon in class_patches}, row_family.norm_inputs))
        replacements = tuple(_rope_patches(row_family, module, flags))
        if replacements:
            rotary.append((module, replacements))
        experts_classes += _experts_classes(row_family, module, flags)
    changes = [(layer, tigon_of[type(layer)]) for layer in model.modules() if type(layer) in tigon_of]
    for layer in model.modules():
        original = getattr(type(layer), "tigon_replaces", type(layer))
        changes += [
            (layer, tigon) for module, replacements in rotary
            if original.__module__ == module.__name__ and (tigon := rotary_class(original, module, replacements))
        ]
    experts = [layer for layer in model.modules() if isinstance(layer, tuple(experts_classes))]
    # Every MLP and experts module is checked before any layer changes: a refused model is left as it was.
    for layer, tigon in changes:
        if issubclass(tigon, layers.TigonMLP):
            layers.check_activation(layer, tigon)
    for layer in experts:
        moe.experts_kernel(layer)
    for layer, tigon in changes:
        layer.__class__ = tigon
    for layer in experts:
        moe.use_tigon_experts(layer)
    float8.adopt_float8_linears(model)
    layers.follow_gradient_checkpointing(model)
    layers.link_norm_inputs(model, norm_inputs)


def unpatch_layers(model: nn.Module) -> None:
    """Give back to each module of ``model`` what :func:`patch_layers` and the loss path changed:
    its Hugging Face class (without the checkpointing and tiling attributes tigon gave a patched MLP), its
    experts implementation, and its head without the fused loss's hook."""
    for layer in model.modules():
        original = getattr(type(layer), "tigon_replaces", None)
        if original is not None:
            layer.__class__ = original
            if not isinstance(layer, GradientCheckpointingLayer):
                vars(layer).pop("gradient_checkpointing", None)
                vars(layer).pop("_gradient_checkpointing_func", None)
                vars(layer).pop("tile_tokens", None)
                vars(layer).pop("norm_input_of", None)
        moe.restore_experts(layer)
        unhook_head_loss(layer)


def apply_family(
    family: Family, *, cross_entropy: bool, fused_linear_cross_entropy: bool, lora: bool, model=None, **flags
):
    """Patch ``family``'s modeling module (``model=None``) or ``model`` in place; see the module
    docstring. ``flags`` are :data:`LAYER_FLAGS`; ``lora`` routes PEFT's LoRA layers through tigon
    (:mod:`tigon.transformers.lora`). Returns ``model``."""
    if cross_entropy and fused_linear_cross_entropy:
        raise ValueError(
            "pass at most one of cross_entropy=True and fused_linear_cross_entropy=True: "
            "the fused loss already computes the cross entropy"
        )
    loss = "fused_linear_cross_entropy" if fused_linear_cross_entropy else "cross_entropy" if cross_entropy else None
    module = modeling_module(family)
    if module is None:
        _warn_missing(family, f"has no {family.module}", "classes (nothing to patch)", None)
        return model
    head = _lookup(family, module, (family.head,), "head class and loss", loss) if family.head else None
    if head is not None and loss is not None:
        problem = unwrappable_forward(head.forward)
        if problem is not None:
            _warn_missing(family, problem, "loss", loss)
            loss = None

    if model is not None:
        hf_model = base_model(model)
        model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
        if model_type != family.model_type:
            raise ValueError(f"tigon: model has model_type {model_type!r}, not {family.model_type!r}")
        if lora:
            patch_peft()
        patch_layers(hf_model, family, flags)
        _register_model(hf_model, lora)
        if loss is not None and head is not None and isinstance(hf_model, head):
            forward = wrap_causal_lm_forward(type(hf_model).forward, family, loss)
            hf_model.forward = types.MethodType(forward, hf_model)
            if loss == "fused_linear_cross_entropy":
                hook_head_loss(output_embeddings(hf_model, family))
        return model

    class_patches = _class_patches(family, module, flags)
    rope_patches = _rope_patches(family, module, flags)
    _experts_classes(family, module, flags)  # a missing one is said now, not when a model is built
    if lora:
        patch_peft()
    patch = _MODULE_PATCHES.setdefault(family.model_type, ModulePatch())
    patch.needs.lora |= lora
    for row, original, tigon in class_patches:
        if "." not in row.name:
            patch.names.setdefault(row.name, original)
            setattr(module, row.name, tigon)
    for name, function in rope_patches:
        _replace_rope(module, name, function)
        patch.rope_modules.add(module.__name__)
    if head is not None:
        for name in ("forward", "post_init"):
            patch.head_methods.setdefault(name, vars(head).get(name))
        if loss is not None:
            head.forward = wrap_causal_lm_forward(head.forward, family, loss)
        # Sub-models of other families and layers of other libraries are patched once built.
        head.post_init = patch_after_init(head.post_init, family, flags, loss)
    return model


def revert_family(family: Family) -> None:
    """Undo ``apply_tigon_to_<family>()`` (``model=None``): the modeling module's names and the
    head class's methods as they were before it. Models built meanwhile stay patched (undo each
    with :func:`unapply_tigon`)."""
    patch = _MODULE_PATCHES.pop(family.model_type, None)
    if patch is None:
        return
    module = modeling_module(family)
    for name, original in patch.names.items():
        setattr(module, name, original)
    head = getattr(module, family.head, None) if family.head else None
    for name, method in patch.head_methods.items():
        if method is not None:
            setattr(head, name, method)
        elif name in vars(head):
            delattr(head, name)
    _release_shared()


def unapply_tigon(model: ModelT) -> ModelT:
    """Undo every tigon patch of ``model`` (a Hugging Face model, or a PEFT model wrapping one), in
    place, and return it: its layers get back their Hugging Face classes, its forward and head
    their own, its experts the implementation they had. A rotary function or PEFT's LoRA forward,
    shared by the process, goes back once no other patched model alive and no patched modeling
    module needs it. A model built after ``apply_tigon_to_<family>()`` gets its class's forward as
    Hugging Face wrote it. Weights, gradients and optimizer state are untouched; a model tigon
    never patched is returned unchanged."""
    hf_model = base_model(model)
    unpatch_layers(hf_model)
    forward = vars(hf_model).get("forward")
    if hasattr(getattr(forward, "__func__", None), "tigon_wraps"):
        del hf_model.forward
    class_forward = getattr(type(hf_model), "forward", None)
    if hasattr(class_forward, "tigon_wraps"):
        hf_model.forward = types.MethodType(class_forward.tigon_wraps, hf_model)
    vars(hf_model).pop("tigon_patch", None)
    _PATCHED_MODELS.discard(hf_model)
    _release_shared()
    return model


def patch_after_init(post_init, family: Family, flags: dict[str, bool], loss: str | None):
    """``post_init`` (which every Hugging Face model calls at the end of ``__init__``) followed by
    :func:`patch_layers` on the new model, and the fused loss's hook on its ``lm_head``."""
    post_init = getattr(post_init, "tigon_wraps", post_init)

    @functools.wraps(post_init)
    def post_init_then_patch(self):
        post_init(self)
        patch_layers(self, family, flags)
        _register_model(self, lora=False)
        if loss == "fused_linear_cross_entropy":
            hook_head_loss(output_embeddings(self, family))

    post_init_then_patch.tigon_wraps = post_init
    return post_init_then_patch


def check_flags(caller: str, flags: dict[str, Any]) -> None:
    """Raise unless every key of ``flags`` is a patcher flag (naming the closest one for a typo)
    and every value a ``bool``."""
    for name, value in flags.items():
        if name not in FLAG_DEFAULTS:
            close = difflib.get_close_matches(name, FLAG_DEFAULTS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(f"{caller}: no flag {name!r}; {hint}the flags are {', '.join(FLAG_DEFAULTS)}")
        if not isinstance(value, bool):
            raise TypeError(f"{caller}: {name} must be True or False, got {value!r} ({type(value).__name__})")


def family_patcher(model_type: str):
    """``apply_tigon_to_<family>(*, rope=True, rms_norm=True, layer_norm=True, swiglu=True,
    geglu=True, relu2=True, experts=True, cross_entropy=False, fused_linear_cross_entropy=True,
    lora=True, model=None)`` for one row of the table; its flags are keyword-only booleans."""
    family = FAMILIES[model_type]
    name = f"apply_tigon_to_{model_type}"
    signature = inspect.Signature(
        [
            inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=bool)
            for flag, default in FLAG_DEFAULTS.items()
        ]
        + [inspect.Parameter("model", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="nn.Module | None")],
        return_annotation="nn.Module | None",
    )

    def patch(*args, **kwargs):
        if args:
            raise TypeError(f"{name} takes keyword arguments only (e.g. {name}(rope=False, model=model)); got {args!r}")
        model = kwargs.pop("model", None)
        check_flags(name, kwargs)
        return apply_family(family, **{**FLAG_DEFAULTS, **kwargs}, model=model)

    what = ", ".join(row.name.rpartition(".")[2] for row in family.sub_rows()) or "no layers of its own"
    patch.__signature__ = signature
    patch.__name__ = patch.__qualname__ = name
    patch.__module__ = "tigon.transformers"
    patch.__doc__ = f"""Use tigon's kernels in {family.head or family.module} and its layers ({what}).

    Called before the model is built, patches {family.module} so that models built afterwards use
    tigon; given ``model=`` (also on GPU, in bf16, or wrapped by PEFT), patches that model in place,
    keeping its weights, and returns it. Sub-models of other families (a vision-language model's
    language model and vision tower) are patched by their own rows.

    Args:
        rope: tigon's rotary embedding kernel in place of the rotary functions.
        rms_norm, layer_norm: tigon's norms in place of the RMSNorm and LayerNorm classes.
        swiglu, geglu, relu2: the MLP activations, fused, where the MLP uses that activation.
        experts: the mixture-of-experts experts by tigon's fused kernel (transformers'
            ``experts_implementation="tigon"``); ``False`` keeps the model's own.
        cross_entropy: in training with labels, tigon's cross entropy on the logits.
        fused_linear_cross_entropy: in training with labels, the loss straight from the hidden
            states and lm_head's weight, never building the logits (``logits=None`` is returned).
        lora: PEFT's LoRA layers through tigon's fused LoRA kernels.
        model: a built model to patch in place, or ``None``.

    ``unapply_tigon_to_{model_type}()`` undoes the call without ``model``; ``unapply_tigon(model)``
    undoes it on a model.
    """
    return patch


def family_unpatcher(model_type: str):
    """``unapply_tigon_to_<family>()``: :func:`revert_family` for one row of the table."""
    family = FAMILIES[model_type]

    def unpatch() -> None:
        revert_family(family)

    unpatch.__name__ = unpatch.__qualname__ = f"unapply_tigon_to_{model_type}"
    unpatch.__module__ = "tigon.transformers"
    unpatch.__doc__ = f"""Undo ``apply_tigon_to_{model_type}()``: {family.module} gets back its classes and
    functions, and {family.head or 'its head'} its methods, as they were before it. Models built
    meanwhile stay patched: undo each with ``unapply_tigon(model)``."""
    return unpatch
