"""tigon in LLaMA-Factory 0.9.5: a kernel plugin for its v1 trainer and a launcher for both.

LLaMA-Factory's v1 (``USE_V1=1``) applies kernels named in the model section of its YAML after it
has built the model (and wrapped it with PEFT)::

    kernel_config:
      name: tigon
      include_kernels: auto          # or a comma list of tigon flags: rope,rms_norm,swiglu

Importing this module registers :func:`apply_tigon_kernels` as that ``tigon`` kernel plugin
(where LLaMA-Factory's v1 is importable). A run of ``llamafactory-cli`` never imports tigon, so
training goes through this module's launcher, which takes ``llamafactory-cli``'s arguments::

    python -m tigon.integrations.llamafactory train config.yaml                    # one process
    torchrun --nproc-per-node 8 -m tigon.integrations.llamafactory train config.yaml

LLaMA-Factory's v0 (the default ``llamafactory-cli train``) has no kernel plugins, only
``enable_liger_kernel``; under the launcher, the v0 model loader patches the modeling module of
the model's ``config.model_type`` with tigon's family patcher (``tigon.transformers.PATCHERS``)
just before it builds a trainable model, where it would apply Liger's kernels. ``--kernels``
(before the command) picks the flags there, as ``include_kernels`` does in v1.

Which loss tigon computes follows what the trainer reads of the model's output:

- v0 pre-training and SFT take the model's loss: tigon's fused linear cross entropy, which builds
  no logits, is on by default. The other v0 stages read logits; LLaMA-Factory says so to its
  loader (``require_logits``), and the fused loss is off there.
- v1's trainers (SFT, reward modelling) compute their losses from the logits, and v1 tells only
  its Liger plugin so: the ``tigon`` plugin takes ``require_logits=True`` unless told otherwise,
  so the fused loss is off in v1.

Importing ``tigon`` does not import this module, nor LLaMA-Factory.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from typing import Any

import torch

from tigon.integrations import tigon_layer_counts
from tigon.transformers import FAMILIES, FLAGS, PATCHERS, apply_tigon
from tigon.transformers.patching import FLAG_DEFAULTS

LOG = logging.getLogger(__name__)

# The kernel plugin's name in LLaMA-Factory's v1 ``kernel_config``.
PLUGIN_NAME = "tigon"
# The commands of each LLaMA-Factory version's launcher that build a model for training.
V0_TRAIN_COMMANDS = ("train",)
V1_TRAIN_COMMANDS = ("train", "sft", "rm")


def kernel_flags(
    include_kernels: str | bool | None, *, require_logits: bool
) -> dict[str, bool] | None:
    """The patcher flags that ``include_kernels`` asks for; ``None`` when it asks for none.

    ``include_kernels``: ``"auto"`` or ``True`` for tigon's defaults (``FLAG_DEFAULTS``), a comma
    list of flag names (``"rope,rms_norm,swiglu"``) for those alone, or ``None``, ``False`` or
    ``""`` for none. With ``require_logits`` the fused linear cross entropy, which returns no
    logits in training, is off whatever was asked. Raises ``ValueError`` for an unknown flag name.
    """
    if include_kernels in (None, False, ""):
        return None
    if include_kernels is True or include_kernels == "auto":
        flags = dict(FLAG_DEFAULTS)
    else:
        asked = {
            name.strip() for name in str(include_kernels).split(",") if name.strip()
        }
        unknown = sorted(asked.difference(FLAGS))
        if unknown:
            raise ValueError(
                f"tigon: include_kernels names {', '.join(unknown)}, which are not tigon flags; "
                f"use 'auto' or a comma list of {', '.join(FLAGS)}"
            )
        flags = {flag: flag in asked for flag in FLAGS}
    if require_logits and flags["fused_linear_cross_entropy"]:
        LOG.info(
            "tigon: the trainer reads the logits, so the fused linear cross entropy is off"
        )
        flags["fused_linear_cross_entropy"] = False
    return flags


def apply_tigon_kernels(
    model: torch.nn.Module,
    include_kernels: str | bool | None = None,
    require_logits: bool = True,
) -> torch.nn.Module:
    """LLaMA-Factory v1's ``tigon`` kernel plugin: :func:`tigon.transformers.apply_tigon` on
    ``model`` (a Hugging Face model or a PEFT model wrapping one) with the flags of
    :func:`kernel_flags`. Returns ``model``, patched in place."""
    flags = kernel_flags(include_kernels, require_logits=require_logits)
    if flags is None:
        return model
    apply_tigon(model, **flags)
    LOG.info(f"tigon: layers on tigon's kernels: {tigon_layer_counts(model)}")
    return model


def register_kernel_plugin() -> None:
    """Register :func:`apply_tigon_kernels` as LLaMA-Factory v1's kernel plugin ``tigon``."""
    from llamafactory.v1.plugins.model_plugins.kernels.interface import KernelPlugin

    KernelPlugin(PLUGIN_NAME).register()(apply_tigon_kernels)


def patch_v0_model_loader(include_kernels: str) -> None:
    """Have LLaMA-Factory v0's model loader patch the family of each trainable model it builds.

    v0's ``load_model`` calls ``apply_liger_kernel(config, model_args, is_trainable,
    require_logits)`` once the model's config is read and before the model is built; that name
    in ``llamafactory.model.loader`` is replaced by a function that first runs the family patcher
    of ``config.model_type`` with the flags of :func:`kernel_flags`, then LLaMA-Factory's own
    (which applies Liger's kernels only with ``enable_liger_kernel``, refused beside tigon's).
    """
    from llamafactory.model import loader

    apply_liger_kernel = loader.apply_liger_kernel

    def apply_tigon_then_liger(
        config: Any, model_args: Any, is_trainable: bool, require_logits: bool
    ) -> None:
        if is_trainable:
            if model_args.enable_liger_kernel:
                raise ValueError(
                    "tigon: enable_liger_kernel is set; tigon's and Liger's kernels replace the same layers, "
                    "so train with one of them: drop enable_liger_kernel, or run llamafactory-cli without tigon"
                )
            patch_family(
                config.model_type,
                kernel_flags(include_kernels, require_logits=require_logits),
            )
        apply_liger_kernel(config, model_args, is_trainable, require_logits)

    loader.apply_liger_kernel = apply_tigon_then_liger


def patch_family(model_type: str, flags: dict[str, bool] | None) -> None:
    """Run the family patcher of ``model_type`` with ``flags`` (``None``: none) and log which
    names of its modeling module are tigon's now."""
    if flags is None:
        return
    if model_type not in PATCHERS:
        raise ValueError(
            f"tigon has no patcher for model_type {model_type!r}; supported: {', '.join(sorted(PATCHERS))}"
        )
    PATCHERS[model_type](**flags)
    module = sys.modules[FAMILIES[model_type].module]
    replaced = sorted(
        name
        for name, value in vars(module).items()
        if getattr(value, "__module__", "").startswith("tigon.")
    )
    LOG.info(f"tigon: patched {module.__name__} ({', '.join(replaced)}) with {flags}")


def main(argv: list[str] | None = None) -> None:
    """``python -m tigon.integrations.llamafactory [--kernels FLAGS] COMMAND ARGS...``: LLaMA-Factory's
    training for ``COMMAND ARGS`` (``llamafactory-cli``'s), in this process, with tigon's kernels.

    One process trains, as ``llamafactory-cli`` does on one device; for several, start this module
    under ``torchrun``, each of whose processes trains as LLaMA-Factory's would.
    """
    from llamafactory.extras.misc import is_env_enabled

    v1 = is_env_enabled("USE_V1")
    commands = V1_TRAIN_COMMANDS if v1 else V0_TRAIN_COMMANDS
    parser = argparse.ArgumentParser(
        prog="python -m tigon.integrations.llamafactory",
        description="LLaMA-Factory's training (llamafactory-cli's arguments) with tigon's kernels.",
    )
    parser.add_argument(
        "--kernels",
        help="LLaMA-Factory v0: 'auto' (tigon's defaults, the default) or a comma list of tigon flags "
        f"({', '.join(FLAGS)}); v1 reads kernel_config.include_kernels instead",
    )
    parser.add_argument(
        "command", choices=commands, help="the llamafactory-cli command"
    )
    parser.add_argument(
        "arguments",
        nargs=argparse.REMAINDER,
        help="its arguments: a YAML file, key=value overrides",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="[%(levelname)s|%(name)s] %(message)s"
    )

    if v1:
        if args.kernels is not None:
            parser.error(
                "with USE_V1=1 the kernels are the YAML's kernel_config (name: tigon, include_kernels: ...)"
            )
        from llamafactory.v1 import launcher

        sys.argv = [parser.prog, args.command, *args.arguments]
        launcher.main()
    else:
        from llamafactory.train.tuner import run_exp

        patch_v0_model_loader(args.kernels or "auto")
        sys.argv = [parser.prog, *args.arguments]
        run_exp()


if (
    importlib.util.find_spec("llamafactory") is not None
    and importlib.util.find_spec("llamafactory.v1") is not None
):
    register_kernel_plugin()

if __name__ == "__main__":
    main()
