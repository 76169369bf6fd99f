"""tigon in Hugging Face models, in one line.

Three levels, as fine as you need::

    model = AutoTigonForCausalLM.from_pretrained("path/or/id", dtype=torch.bfloat16)

    apply_tigon(model)                        # a built model, family from config.model_type

    apply_tigon_to_llama()                    # before building: every Llama built afterwards
    model = LlamaForCausalLM(config)

Each family is a row of :data:`tigon.transformers.families.FAMILIES`; the loss path shared by all
causal LMs is :mod:`tigon.transformers.causal_lm`. Tested with transformers 5.17.
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from tigon.transformers.families import FAMILIES, Family
from tigon.transformers.kernel_hub import export_kernels, kernel_config
from tigon.transformers.patching import base_model, family_patcher

__all__ = [
    "AutoTigonForCausalLM",
    "FAMILIES",
    "Family",
    "PATCHERS",
    "apply_tigon",
    "apply_tigon_to_gemma",
    "apply_tigon_to_gemma2",
    "apply_tigon_to_gemma3_text",
    "apply_tigon_to_granite",
    "apply_tigon_to_llama",
    "apply_tigon_to_mistral",
    "apply_tigon_to_mixtral",
    "apply_tigon_to_olmo2",
    "apply_tigon_to_phi3",
    "apply_tigon_to_qwen2",
    "apply_tigon_to_qwen3",
    "apply_tigon_to_qwen3_moe",
    "export_kernels",
    "kernel_config",
]

apply_tigon_to_llama = family_patcher("llama")
apply_tigon_to_mistral = family_patcher("mistral")
apply_tigon_to_mixtral = family_patcher("mixtral")
apply_tigon_to_qwen2 = family_patcher("qwen2")
apply_tigon_to_qwen3 = family_patcher("qwen3")
apply_tigon_to_qwen3_moe = family_patcher("qwen3_moe")
apply_tigon_to_gemma = family_patcher("gemma")
apply_tigon_to_gemma2 = family_patcher("gemma2")
apply_tigon_to_gemma3_text = family_patcher("gemma3_text")
apply_tigon_to_phi3 = family_patcher("phi3")
apply_tigon_to_olmo2 = family_patcher("olmo2")
apply_tigon_to_granite = family_patcher("granite")

PATCHERS = {model_type: globals()[f"apply_tigon_to_{model_type}"] for model_type in FAMILIES}
# Every flag some patcher takes; AutoTigonForCausalLM tells them from from_pretrained's arguments.
FLAGS = ("rope", "rms_norm", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy", "layer_norm")


def apply_tigon(model, **flags):
    """Patch ``model`` in place with its family's patcher, chosen by ``model.config.model_type``.

    ``flags`` are that patcher's (e.g. ``swiglu=False``, or ``geglu=False`` for Gemma models).
    Returns ``model``. Raises ``ValueError`` for a family tigon does not support.
    """
    model_type = getattr(getattr(base_model(model), "config", None), "model_type", None)
    if model_type not in PATCHERS:
        raise ValueError(
            f"tigon does not support model_type {model_type!r}; supported: {', '.join(sorted(PATCHERS))}"
        )
    patcher = PATCHERS[model_type]
    accepted = [name for name in patcher.__signature__.parameters if name != "model"]
    unknown = sorted(set(flags) - set(accepted))
    if unknown:
        raise TypeError(
            f"apply_tigon: {model_type!r} models take the flags {', '.join(accepted)}; got {', '.join(unknown)}"
        )
    return patcher(model=model, **flags)


class AutoTigonForCausalLM:
    """``AutoModelForCausalLM`` whose models come patched by :func:`apply_tigon`."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``AutoModelForCausalLM.from_pretrained(...)`` then ``apply_tigon(model, **flags)``,
        where ``flags`` are the keyword arguments named in :data:`FLAGS` (``swiglu=False``...)."""
        flags = {name: kwargs.pop(name) for name in FLAGS if name in kwargs}
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return apply_tigon(model, **flags)
