"""tigon in Hugging Face models, in one line.

Three levels, as fine as you need::

    model = AutoTigonForCausalLM.from_pretrained("path/or/id", dtype=torch.bfloat16)

    apply_tigon(model)                        # a built model, family from config.model_type

    apply_tigon_to_llama()                    # before building: every Llama built afterwards
    model = LlamaForCausalLM(config)

Each family is a row of :data:`tigon.transformers.families.FAMILIES`; the loss path shared by all
causal LMs is :mod:`tigon.transformers.causal_lm`. Importing this package registers tigon's fused
MoE experts as transformers' ``experts_implementation="tigon"`` (:mod:`tigon.transformers.moe`),
which the patchers set on the MoE families' models. :func:`fit_checkpointing` spends the memory
tigon frees on less recomputation (:mod:`tigon.transformers.checkpointing`). Tested with
transformers 5.17.
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tigon.transformers import moe
from tigon.transformers.checkpointing import CheckpointingPlan, fit_checkpointing, measure_step_peak, set_checkpointing
from tigon.transformers.families import FAMILIES, Experts, Family, Mlp, Norm, Rope
from tigon.transformers.kernel_hub import export_kernels, kernel_config
from tigon.transformers.patching import LAYER_FLAGS, base_model, family_patcher

moe.register()

# apply_tigon_to_llama, apply_tigon_to_qwen2_vl, ...: one patcher per row of the table.
PATCHERS = {model_type: family_patcher(model_type) for model_type in FAMILIES}
globals().update({patcher.__name__: patcher for patcher in PATCHERS.values()})

__all__ = [
    "AutoTigonForCausalLM",
    "AutoTigonForImageTextToText",
    "CheckpointingPlan",
    "Experts",
    "FAMILIES",
    "Family",
    "Mlp",
    "Norm",
    "PATCHERS",
    "Rope",
    "apply_tigon",
    "export_kernels",
    "fit_checkpointing",
    "kernel_config",
    "measure_step_peak",
    "set_checkpointing",
    *(patcher.__name__ for patcher in PATCHERS.values()),
]
# Every flag a patcher takes; the auto classes tell them from from_pretrained's arguments.
FLAGS = (*LAYER_FLAGS, "cross_entropy", "fused_linear_cross_entropy", "lora")


def apply_tigon(model, **flags):
    """Patch ``model`` in place with its family's patcher, chosen by ``model.config.model_type``.

    ``flags`` are the patcher's (e.g. ``swiglu=False``, ``rope=False``, ``experts=False``).
    Returns ``model``. Raises ``ValueError`` for a family tigon does not support.
    """
    model_type = getattr(getattr(base_model(model), "config", None), "model_type", None)
    if model_type not in PATCHERS:
        raise ValueError(
            f"tigon does not support model_type {model_type!r}; supported: {', '.join(sorted(PATCHERS))}"
        )
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
        raise TypeError(f"apply_tigon: the flags are {', '.join(FLAGS)}; got {', '.join(unknown)}")
    return PATCHERS[model_type](model=model, **flags)


class _AutoTigon:
    auto_class = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        flags = {name: kwargs.pop(name) for name in FLAGS if name in kwargs}
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
