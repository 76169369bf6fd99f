"""What replaces a Hugging Face layer: forwards by tigon over the layer's own parameters.

Each replacement is a mixin placed in front of the Hugging Face class (see
:func:`tigon.transformers.patching.tigon_class`), so the patched layer keeps the original
``__init__``, parameter names, weight initialisation and ``isinstance`` checks; only ``forward``
changes. Settings that differ between families (the RMSNorm offset, which gate kernel) are class
attributes filled in from the family's row of :data:`tigon.transformers.families.FAMILIES`.
"""

from __future__ import annotations

import torch

from tigon import functional as F
from tigon.nn import linear_weight_usable

# Hugging Face activation names (``ACT2FN`` keys) that each gate kernel computes exactly.
GATE_ACTIVATIONS = {
    "swiglu": ("silu", "swish"),
    # The tanh approximation of GELU, whichever formula Hugging Face spells it with.
    "geglu": ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh"),
}


class TigonRMSNorm:
    """``forward`` of a Hugging Face RMSNorm (``weight [H]``) by :func:`tigon.functional.rms_norm`.

    ``eps_attribute`` names where the layer keeps its epsilon (``variance_epsilon`` in Llama's
    family, ``eps`` in Gemma's); ``offset = 1`` is Gemma's ``(1 + weight)``; ``casting_mode`` is
    where the result is rounded to the input dtype (see :func:`tigon.functional.rms_norm`).
    """

    eps_attribute = "variance_epsilon"
    offset = 0.0
    casting_mode = "llama"

    def forward(self, hidden_states):
        eps = getattr(self, self.eps_attribute)
        return F.rms_norm(hidden_states, self.weight, eps, self.offset, self.casting_mode)


class TigonMLP:
    """Shared by the two MLP layouts: which gate kernel, and the check that it matches the model's
    activation. ``gate`` is ``"swiglu"`` or ``"geglu"``; ``activation_attribute`` names the config
    field holding the activation (``hidden_act``, or ``hidden_activation`` for Gemma 2 and 3)."""

    gate = "swiglu"  # also the name of the tigon.functional kernel
    activation_attribute = "hidden_act"
    # Hugging Face's gradient_checkpointing_enable() sets these on every module that has the
    # attribute, as on its decoder layers (the MLP's layer among them).
    gradient_checkpointing = False
    _gradient_checkpointing_func = None

    def __init__(self, config, *args, **kwargs):
        check_activation(type(self), config)
        super().__init__(config, *args, **kwargs)

    def _gated(self, gate, up):
        # The projections' outputs feed nothing but the gate, so its backward may overwrite them.
        return getattr(F, self.gate)(gate, up, inplace_backward=True)

    def _recomputed_by_checkpointing(self, x) -> bool:
        """Whether this forward runs in a layer under non-reentrant checkpointing (Hugging Face's
        default), which recomputes the layer before its backward."""
        checkpoint_options = getattr(self._gradient_checkpointing_func, "keywords", {})
        return (
            self.gradient_checkpointing and self.training and torch.is_grad_enabled()
            and checkpoint_options.get("use_reentrant") is False
            and not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling()
        )


class TigonGatedMLP(TigonMLP):
    """``down_proj(act(gate_proj(x)) · up_proj(x))`` with the gate fused (Llama, Gemma, Qwen...).

    Under non-reentrant checkpointing, plain bias-free projections go through
    :func:`tigon.functional.swiglu_mlp` (or ``geglu_mlp``): the recomputation stops at the MLP's
    input and the backward recomputes the projections slice by slice, the same matmuls in a
    fraction of the memory. Otherwise (and for wrapped or hooked projections, e.g. LoRA) the
    projections are called as modules.
    """

    def forward(self, x):
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if self._recomputed_by_checkpointing(x) and all(
            linear_weight_usable(linear, x) and linear.bias is None for linear in projections
        ):
            return getattr(F, f"{self.gate}_mlp")(x, *(linear.weight for linear in projections))
        return self.down_proj(self._gated(self.gate_proj(x), self.up_proj(x)))


class TigonFusedGateUpMLP(TigonMLP):
    """The same with one ``gate_up_proj`` producing ``[gate | up]`` (Phi-3); the kernel reads both
    halves in place through their row stride."""

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self._gated(gate, up))


def follow_gradient_checkpointing(model) -> None:
    """Give the patched MLPs of ``model`` the checkpointing settings of its layers, which Hugging
    Face set before they were patched (nothing to do when checkpointing is off)."""
    checkpoint = next(
        (
            getattr(module, "_gradient_checkpointing_func", None) for module in model.modules()
            if getattr(module, "gradient_checkpointing", False) and not isinstance(module, TigonMLP)
        ),
        None,
    )
    if checkpoint is None:
        return
    for module in model.modules():
        if isinstance(module, TigonMLP):
            module.gradient_checkpointing, module._gradient_checkpointing_func = True, checkpoint


def check_activation(mlp_class, config) -> None:
    """Raise unless ``config``'s MLP activation is the one ``mlp_class``'s gate kernel computes."""
    activation = getattr(config, mlp_class.activation_attribute, None)
    expected = GATE_ACTIVATIONS[mlp_class.gate]
    if activation not in expected:
        raise ValueError(
            f"tigon's {mlp_class.gate} kernel computes {' / '.join(expected)}, but this model's "
            f"config.{mlp_class.activation_attribute} is {activation!r}: patch with {mlp_class.gate}=False"
        )


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for the ``apply_rotary_pos_emb`` of Hugging Face's modeling modules.

    Args:
        q: ``[B, Hq, T, D]``, k: ``[B, Hk, T, D]`` (``unsqueeze_dim=1``), or ``[B, T, H, D]``
            (``unsqueeze_dim=2``); any strides.
        cos, sin: ``[B, T, R]`` from the model's rotary embedding. ``R < D`` is partial rotary
            (Phi-3): the first ``R`` features of each head rotate, the rest pass through.
    Returns: ``(q_rot, k_rot)`` shaped as ``q`` and ``k``.
    """
    if unsqueeze_dim == 1:
        return F.rope(q, k, cos, sin, rotary_dim=cos.shape[-1])
    if unsqueeze_dim == 2:
        q_rot, k_rot = F.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, rotary_dim=cos.shape[-1])
        return q_rot.transpose(1, 2), k_rot.transpose(1, 2)
    raise ValueError(f"unsqueeze_dim must be 1 ([B, H, T, D] inputs) or 2 ([B, T, H, D]), got {unsqueeze_dim!r}")
