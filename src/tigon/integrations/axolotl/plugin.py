"""tigon's Axolotl plugin: the hooks of Axolotl's ``BasePlugin`` that tigon uses.

- ``get_input_args``: the YAML keys, :class:`tigon.integrations.axolotl.TigonArgs`.
- ``register``: before the config is validated, Axolotl's own fused LoRA kernels
  (``lora_mlp_kernel``, ``lora_qkv_kernel``, ``lora_o_kernel``), which Axolotl turns on for a LoRA
  adapter unless they are set, are set off where they would replace the layers that ``tigon_lora``
  or ``tigon_glu_activation`` give to tigon; those tigon leaves alone keep Axolotl's choice. A
  clashing kernel set to ``true`` by hand is refused by the validation.
- ``pre_model_load``: the family patcher of the model's ``model_type``
  (``tigon.transformers.PATCHERS``) with the flags the keys ask for. It patches the family's
  modeling module before Axolotl builds the model, so every model Axolotl builds afterwards (its
  PEFT-wrapped model, an RL trainer's reference model) has tigon's layers and loss, whatever path
  Axolotl loads it by.
- ``post_model_load``: logs how many of the loaded model's layers are tigon's, by class
  (``LOG_LEVEL=INFO`` shows the logs of plugins outside Axolotl's package).
- ``add_callbacks_post_trainer``: with ``tigon_memory_budget_gib``, a trainer callback that runs
  the memory planner (``tigon.transformers.fit_checkpointing``) when training begins: the first
  moment at which the trainer's optimizer exists, so that its state counts in the probed peak.
"""

from __future__ import annotations

from typing import Any

import torch
from axolotl.integrations.base import BasePlugin
from axolotl.utils.logging import get_logger
from axolotl.utils.schemas.validation import lora_kernels_auto_enable
from transformers import TrainerCallback

from tigon.integrations import tigon_layer_counts
from tigon.integrations.axolotl.args import (
    AXOLOTL_LORA_KERNEL_KEYS,
    clashing_axolotl_lora_kernels,
    patcher_flags,
)
from tigon.transformers import PATCHERS, fit_checkpointing

LOG = get_logger(__name__)


class TigonPlugin(BasePlugin):
    """Axolotl's ``plugins:`` entry ``tigon.integrations.axolotl.TigonPlugin``."""

    def get_input_args(self) -> str:
        return "tigon.integrations.axolotl.TigonArgs"

    def register(self, cfg: dict) -> None:
        """Set Axolotl's LoRA kernels that clash with tigon's keys off in the unparsed ``cfg``."""
        clashing = clashing_axolotl_lora_kernels(cfg)
        unset = [kernel for kernel in AXOLOTL_LORA_KERNEL_KEYS if cfg.get(kernel) is None]
        turned_off = sorted(clashing.intersection(unset))
        if not turned_off:
            return
        # Axolotl turns all of its LoRA kernels on only while none is set: setting the clashing ones
        # off would leave the others off too, so those get the value Axolotl would have given them.
        auto_enabled = lora_kernels_auto_enable(cfg.get)
        for kernel in unset:
            cfg[kernel] = auto_enabled and kernel not in clashing
        LOG.info(f"tigon: Axolotl's {', '.join(turned_off)} off (tigon computes those layers)")

    def pre_model_load(self, cfg: Any) -> None:
        """Patch the modeling module of ``cfg.model_config_type`` with the kernels the keys ask for."""
        flags = patcher_flags(cfg)
        if not any(flags.values()):
            return
        model_type = cfg.model_config_type
        if model_type not in PATCHERS:
            asked = ", ".join(flag for flag, on in flags.items() if on)
            raise ValueError(
                f"tigon has no patcher for model_type {model_type!r} (asked for: {asked}); "
                f"supported: {', '.join(sorted(PATCHERS))}"
            )
        LOG.info(f"tigon: patching {model_type} with {flags}")
        PATCHERS[model_type](**flags)

    def post_model_load(self, cfg: Any, model: torch.nn.Module) -> None:
        """Log the layers of the loaded model (adapters included) that run on tigon's kernels."""
        if any(patcher_flags(cfg).values()):
            LOG.info(f"tigon: layers on tigon's kernels: {tigon_layer_counts(model)}")

    def add_callbacks_post_trainer(self, cfg: Any, trainer: Any) -> list[TrainerCallback]:
        """The memory planner's callback when ``tigon_memory_budget_gib`` is set."""
        if cfg.tigon_memory_budget_gib is None:
            return []
        return [
            CheckpointingPlanCallback(
                cfg.tigon_memory_budget_gib,
                offload=cfg.tigon_offload,
                micro_batch_size=cfg.micro_batch_size,
                sequence_len=cfg.sequence_len,
            )
        ]


class CheckpointingPlanCallback(TrainerCallback):
    """Fits the model's gradient checkpointing to a memory budget when training begins.

    The probed batch is the largest Axolotl forms, ``micro_batch_size`` rows of ``sequence_len``
    tokens (packed or padded batches are no larger), made of random token ids rather than drawn
    from the training data loader, so that the data order of training is untouched.
    """

    def __init__(self, memory_budget_gib: float, *, offload: bool | str, micro_batch_size: int, sequence_len: int):
        self.memory_budget_gib = memory_budget_gib
        self.offload = offload
        self.batch_shape = (micro_batch_size, sequence_len)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        model.train()
        plan = fit_checkpointing(
            model, self.planning_batch(model), self.memory_budget_gib, optimizer=optimizer, offload=self.offload
        )
        LOG.info(
            f"tigon: {plan.recomputed} of {plan.n_layers} layers recompute in backward; a step peaks at "
            f"{plan.peak_gib:.2f} GiB of the {plan.budget_gib:.2f} GiB budget"
            + (f", with {plan.host_gib:.2f} GiB of inputs offloaded to host memory" if plan.offload else "")
        )

    def planning_batch(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``input_ids`` [micro_batch_size, sequence_len] on the model's device, ``labels`` the same
        and an all-ones ``attention_mask``."""
        vocab_size = model.get_input_embeddings().num_embeddings
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(vocab_size, self.batch_shape, generator=generator)
        input_ids = input_ids.to(next(model.parameters()).device)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}
