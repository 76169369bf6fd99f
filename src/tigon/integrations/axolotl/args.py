"""The YAML keys of tigon's Axolotl plugin, as a pydantic model that Axolotl merges into its config.

Axolotl builds its config class at run time from its own and each plugin's ``get_input_args()``
(a dotted path to a pydantic model, here ``tigon.integrations.axolotl.TigonArgs``), so these keys
are validated with the rest of the YAML and read in the hooks as ``cfg.tigon_rope`` and so on.
Every kernel key is off unless set to ``true``, as with Axolotl's other kernel plugins.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

# Each kernel key and the patcher flags of tigon.transformers.PATCHERS it turns on.
KERNEL_FLAGS: dict[str, tuple[str, ...]] = {
    "tigon_rope": ("rope",),
    "tigon_rms_norm": ("rms_norm",),
    "tigon_layer_norm": ("layer_norm",),
    "tigon_glu_activation": ("swiglu", "geglu", "relu2"),
    "tigon_moe_experts": ("experts",),
    "tigon_cross_entropy": ("cross_entropy",),
    "tigon_fused_linear_cross_entropy": ("fused_linear_cross_entropy",),
    "tigon_lora": ("lora",),
}

# Liger's keys that replace the same layers as tigon's: both plugins on one layer would leave it to
# whichever patched last, so a config asking for both is refused.
LIGER_OVERLAP: dict[str, tuple[str, ...]] = {
    "tigon_rope": ("liger_rope",),
    "tigon_rms_norm": ("liger_rms_norm",),
    "tigon_layer_norm": ("liger_layer_norm",),
    "tigon_glu_activation": ("liger_glu_activation", "liger_swiglu"),
    "tigon_cross_entropy": ("liger_cross_entropy", "liger_fused_linear_cross_entropy"),
    "tigon_fused_linear_cross_entropy": ("liger_cross_entropy", "liger_fused_linear_cross_entropy"),
}

# Axolotl's own fused LoRA kernels: with a LoRA adapter, Axolotl turns them all on while none is set.
AXOLOTL_LORA_KERNEL_KEYS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")
# Those that replace the forward of layers a tigon key gives to tigon.
AXOLOTL_LORA_KERNELS: dict[str, tuple[str, ...]] = {
    "tigon_lora": ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"),
    "tigon_glu_activation": ("lora_mlp_kernel",),
}


def clashing_axolotl_lora_kernels(cfg: Any) -> set[str]:
    """Axolotl's LoRA kernel keys that would replace layers the tigon keys of ``cfg`` (a mapping)
    ask for."""
    if cfg.get("adapter") not in ("lora", "qlora"):
        return set()
    return {kernel for key, kernels in AXOLOTL_LORA_KERNELS.items() if cfg.get(key) for kernel in kernels}


def patcher_flags(cfg: Any) -> dict[str, bool]:
    """The keyword flags of ``tigon.transformers.PATCHERS[model_type]`` that ``cfg`` (Axolotl's
    parsed config, read by attribute) asks for: each flag ``True`` when its key is ``true``."""
    return {
        flag: bool(getattr(cfg, key, None))
        for key, flags in KERNEL_FLAGS.items()
        for flag in flags
    }


class TigonArgs(BaseModel):
    """tigon's keys in an Axolotl YAML config (all optional)."""

    tigon_rope: bool | None = Field(default=None, description="tigon's rotary embedding kernel.")
    tigon_rms_norm: bool | None = Field(default=None, description="tigon's RMSNorm (and gated RMSNorm) kernels.")
    tigon_layer_norm: bool | None = Field(default=None, description="tigon's LayerNorm kernel.")
    tigon_glu_activation: bool | None = Field(
        default=None,
        description="The MLP's activation fused with its gate: SwiGLU or GeGLU, or the squared ReLU, "
        "whichever the model family's MLP uses.",
    )
    tigon_moe_experts: bool | None = Field(
        default=None,
        description="Mixture-of-experts layers through tigon's fused experts kernel "
        "(transformers' experts_implementation='tigon').",
    )
    tigon_cross_entropy: bool | None = Field(
        default=None, description="tigon's cross entropy on the logits in training."
    )
    tigon_fused_linear_cross_entropy: bool | None = Field(
        default=None,
        description="The training loss straight from the last hidden states and the LM head's weight, "
        "never building the logits.",
    )
    tigon_lora: bool | None = Field(
        default=None, description="PEFT's LoRA layers (adapter: lora or qlora) through tigon's fused LoRA kernels."
    )
    tigon_memory_budget_gib: float | None = Field(
        default=None,
        gt=0,
        description="Peak GPU memory of a training step, in GiB: at the start of training tigon's memory "
        "planner probes steps of micro_batch_size x sequence_len tokens and recomputes only as many "
        "decoder layers in backward as the budget forces (tigon.transformers.fit_checkpointing).",
    )
    tigon_offload: bool | Literal["auto"] = Field(
        default="auto",
        description="With tigon_memory_budget_gib: whether the recomputed layers' inputs wait in pinned "
        "host memory (true, false, or auto: the faster plan that fits).",
    )

    @model_validator(mode="before")
    @classmethod
    def check_combinations(cls, data: Any) -> Any:
        """Refuse keys that cannot work together, naming them."""
        if not isinstance(data, dict):
            return data
        if data.get("tigon_cross_entropy") and data.get("tigon_fused_linear_cross_entropy"):
            raise ValueError(
                "set at most one of tigon_cross_entropy and tigon_fused_linear_cross_entropy: "
                "the fused loss already computes the cross entropy"
            )
        for key, liger_keys in LIGER_OVERLAP.items():
            clashing = [liger_key for liger_key in liger_keys if data.get(key) and data.get(liger_key)]
            if clashing:
                raise ValueError(
                    f"{key} and {clashing[0]} replace the same layers; keep one of the two plugins' keys"
                )
        explicit = sorted(kernel for kernel in clashing_axolotl_lora_kernels(data) if data.get(kernel))
        if explicit:
            raise ValueError(
                f"{', '.join(explicit)} replace the LoRA layers that tigon_lora or tigon_glu_activation ask "
                "tigon for; set them to false or leave them unset"
            )
        if data.get("tigon_memory_budget_gib") is not None and data.get("gradient_checkpointing") in (
            "offload",
            "offload_disk",
        ):
            raise ValueError(
                "tigon_memory_budget_gib chooses which layers recompute and offloads their inputs itself "
                f"(tigon_offload); set gradient_checkpointing to true or false, not {data['gradient_checkpointing']!r}"
            )
        return data
