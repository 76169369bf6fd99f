"""tigon in Hugging Face models, in one line.

Three levels, as fine as you need::

    model = AutoTigonForCausalLM.from_pretrained("path/or/id", dtype=torch.bfloat16)

    apply_tigon(model)                        # a built model, family from config.model_type

    apply_tigon_to_llama()                    # before building: every Llama built afterwards
    model = LlamaForCausalLM(config)

    unapply_tigon(model)                      # each has its inverse
    unapply_tigon_to_llama()

Each family is a row of :data:`tigon.transformers.families.FAMILIES`; the loss path shared by all
causal LMs is :mod:`tigon.transformers.causal_lm`. Importing this package registers tigon's fused
MoE experts as transformers' ``experts_implementation="tigon"`` (:mod:`tigon.transformers.moe`),
which the patchers set on the MoE families' models. :func:`fit_checkpointing` spends the memory
tigon frees on less recomputation (:mod:`tigon.transformers.checkpointing`).

Supported: transformers 5.6 and newer; tested: 5.6 to 5.24 (:data:`~tigon.transformers.families.SUPPORTED_RANGE`,
:data:`tigon._versions.TESTED`). Importing this package with an older transformers raises
``ImportError``; a newer one gets an :class:`~tigon.UntestedVersionWarning` and is patched from the
same table, as are PEFT and TRL newer than those tested. Where a version lacks a piece of a
family's row, patching leaves that piece to Hugging Face and says so
(:class:`~tigon.transformers.patching.MissingInTransformersWarning`).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Protocol, overload

import transformers

from tigon._versions import TESTED, release, tested_range, warn_if_newer


def check_transformers_version(version: str) -> None:
    """Raise ``ImportError`` if ``version`` (a transformers release) is older than the oldest
    release of :data:`~tigon.transformers.families.SUPPORTED_RANGE`, whose classes and functions
    the families table names; warn (:class:`~tigon.UntestedVersionWarning`) if it is newer than
    the newest tested. A pre-release counts as its release."""
    if release(version) < TESTED["transformers"][0]:
        oldest = ".".join(map(str, TESTED["transformers"][0]))
        raise ImportError(
            f"tigon.transformers needs transformers {oldest} or newer (tested: {tested_range('transformers')}), "
            f'but transformers {version} is installed: pip install "transformers>={oldest}"'
        )
    warn_if_newer("transformers", version, stacklevel=3)


# Before anything of transformers' internals is imported: an older one lacks some of them.
check_transformers_version(transformers.__version__)
warn_if_newer("peft")
warn_if_newer("trl")

from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

from tigon.transformers import moe
from tigon.transformers.causal_lm import ShardedHeadWarning
from tigon.transformers.checkpointing import (
    CheckpointingPlan,
    fit_checkpointing,
    measure_step_peak,
    offload_host_bytes,
    set_checkpointing,
)
from tigon.transformers.families import FAMILIES, Experts, Family, Mlp, Norm, Rope
from tigon.transformers.kernel_hub import export_kernels, kernel_config
from tigon.transformers.layers import check_tile_tokens, set_mlp_tiling
from tigon.transformers.patching import (
    FLAG_DEFAULTS,
    MissingInTransformersWarning,
    ModelT,
    base_model,
    check_flags,
    family_patcher,
    family_unpatcher,
    unapply_tigon,
)

moe.register()

# apply_tigon_to_llama, apply_tigon_to_qwen2_vl, ... and their inverses unapply_tigon_to_llama, ...:
# one of each per row of the table.
PATCHERS = {model_type: family_patcher(model_type) for model_type in FAMILIES}
UNPATCHERS = {model_type: family_unpatcher(model_type) for model_type in FAMILIES}
globals().update({function.__name__: function for function in (*PATCHERS.values(), *UNPATCHERS.values())})

class FamilyPatcher(Protocol):
    """The type of ``apply_tigon_to_<family>`` (and of ``unapply_tigon_to_<family>``, called with
    no arguments), made at import from the families table."""

    @overload
    def __call__(
        self, *, rope: bool = ..., rms_norm: bool = ..., layer_norm: bool = ..., swiglu: bool = ...,
        geglu: bool = ..., relu2: bool = ..., experts: bool = ..., cross_entropy: bool = ...,
        fused_linear_cross_entropy: bool = ..., lora: bool = ..., model: None = None,
    ) -> None: ...

    @overload
    def __call__(
        self, *, rope: bool = ..., rms_norm: bool = ..., layer_norm: bool = ..., swiglu: bool = ...,
        geglu: bool = ..., relu2: bool = ..., experts: bool = ..., cross_entropy: bool = ...,
        fused_linear_cross_entropy: bool = ..., lora: bool = ..., model: ModelT,
    ) -> ModelT: ...


if TYPE_CHECKING:

    def __getattr__(name: str) -> FamilyPatcher: ...

__all__ = [
    "AutoTigonForCausalLM",
    "AutoTigonForImageTextToText",
    "CheckpointingPlan",
    "Experts",
    "FAMILIES",
    "Family",
    "MissingInTransformersWarning",
    "Mlp",
    "Norm",
    "PATCHERS",
    "Rope",
    "ShardedHeadWarning",
    "UNPATCHERS",
    "apply_tigon",
    "export_kernels",
    "fit_checkpointing",
    "kernel_config",
    "measure_step_peak",
    "offload_host_bytes",
    "set_checkpointing",
    "set_mlp_tiling",
    "unapply_tigon",
    *(patcher.__name__ for patcher in PATCHERS.values()),
    *(unpatcher.__name__ for unpatcher in UNPATCHERS.values()),
]
# Every flag a patcher takes; the auto classes tell them from from_pretrained's arguments.
FLAGS = tuple(FLAG_DEFAULTS)


def apply_tigon(model: ModelT, *, mlp_tile_tokens: int | str | None = None, **flags: bool) -> ModelT:
    """Patch ``model`` in place with its family's patcher, chosen by ``model.config.model_type``.

    ``model`` is a Hugging Face ``PreTrainedModel`` or a PEFT model wrapping one. ``flags`` are
    the patcher's, each ``True`` or ``False`` (e.g. ``swiglu=False``, ``rope=False``,
    ``experts=False``; all are listed by :data:`FLAGS`). ``mlp_tile_tokens`` (an int, ``"auto"``)
    runs the gated MLPs over tiles of the sequence, for long contexts (:func:`set_mlp_tiling`;
    ``None``: one tile). Returns ``model``;
    :func:`unapply_tigon` undoes it. Raises ``TypeError`` for a model that is not a Hugging Face
    model and for an unknown or non-boolean flag, ``ValueError`` for a family tigon does not support.
    """
    hf_model = base_model(model)
    if not isinstance(hf_model, PreTrainedModel):
        raise TypeError(
            f"apply_tigon: model must be a Hugging Face PreTrainedModel (or a PEFT model wrapping one), "
            f"got {type(model).__module__}.{type(model).__qualname__}; for single layers use tigon.nn or "
            "tigon.functional"
        )
    model_type = hf_model.config.model_type
    if model_type not in PATCHERS:
        raise ValueError(
            f"apply_tigon: tigon does not support model_type {model_type!r} ({type(hf_model).__name__}); "
            f"supported: {', '.join(sorted(PATCHERS))}"
        )
    check_flags("apply_tigon", flags)
    check_tile_tokens(mlp_tile_tokens)
    PATCHERS[model_type](model=model, **flags)
    if mlp_tile_tokens is not None:
        try:
            set_mlp_tiling(model, mlp_tile_tokens)
        except ValueError:
            unapply_tigon(model)  # refused: the model is left as it was
            raise
    return model


class _AutoTigon:
    auto_class: Any = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> PreTrainedModel:
        flags = {name: kwargs.pop(name) for name in FLAGS if name in kwargs}
        check_flags(f"{cls.__name__}.from_pretrained", flags)
        # Anything else goes to transformers, which would take a misspelt flag for a config
        # attribute (or fail deep inside): refuse one that is one or two letters from a flag.
        for name in kwargs:
            close = difflib.get_close_matches(name, FLAGS, n=1, cutoff=0.8)
            if close:
                raise TypeError(
                    f"{cls.__name__}.from_pretrained: {name!r} is not a tigon flag; did you mean {close[0]!r}? "
                    f"The flags are {', '.join(FLAGS)}"
                )
        model = cls.auto_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return apply_tigon(model, **flags)


class AutoTigonForCausalLM(_AutoTigon):
    """``AutoModelForCausalLM`` whose models come patched by :func:`apply_tigon`:
    ``from_pretrained(...)`` takes its arguments and the flags of :data:`FLAGS`."""

    auto_class = AutoModelForCausalLM


class AutoTigonForImageTextToText(_AutoTigon):
    """``AutoModelForImageTextToText`` (vision-language models) whose models come patched by
    :func:`apply_tigon`: ``from_pretrained(...)`` takes its arguments and the flags of :data:`FLAGS`."""

    auto_class = AutoModelForImageTextToText
