"""``torch.nn`` modules over :mod:`tigon.functional`, drop-in for the Hugging Face modules they
replace: same constructor arguments, parameter names and ``state_dict`` keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules import module as _module

from tigon import functional as F
from tigon.functional import CastingMode, Reduction

__all__ = [
    "RMSNorm",
    "RMSNormGated",
    "LayerNorm",
    "SwiGLUMLP",
    "GeGLUMLP",
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
]


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; ``weight [hidden_size]`` starts at ones (zeros when
    ``offset=1``, Gemma's ``(1 + weight)`` parametrisation)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: CastingMode = "llama",
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, offset={self.offset}, casting_mode={self.casting_mode!r}"


class RMSNormGated(nn.Module):
    """RMSNorm gated by ``silu(gate)``, :func:`tigon.functional.rms_norm_gated`; ``weight
    [hidden_size]`` starts at ones. ``forward(hidden_states, gate=None)``, as the Hugging Face
    modules: ``Qwen3NextRMSNormGated(H, eps)`` is ``RMSNormGated(H, eps)``,
    ``FalconH1RMSNormGated(H, eps, n_groups, norm_before_gate)`` is ``RMSNormGated(H, eps,
    group_size=H // n_groups, norm_before_gate=norm_before_gate, casting_mode="gemma")``, Mamba2's
    is ``RMSNormGated(H, eps, norm_before_gate=False)``."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, group_size: int | None = None, norm_before_gate: bool = True,
        casting_mode: CastingMode = "llama", device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.casting_mode = casting_mode

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return F.rms_norm_gated(
            hidden_states, gate, self.weight, self.variance_epsilon, group_size=self.group_size,
            norm_before_gate=self.norm_before_gate, casting_mode=self.casting_mode,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.weight.shape[0]}, eps={self.variance_epsilon}, group_size={self.group_size}, "
            f"norm_before_gate={self.norm_before_gate}, casting_mode={self.casting_mode!r}"
        )


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension with ``weight`` and ``bias [hidden_size]``; ``offset=1``
    is Nemotron's ``NemotronLayerNorm1P`` (``weight + 1``; its weight too starts at ones)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, bias: bool = True, offset: float = 0.0,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None
        self.eps = eps
        self.offset = offset

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden_states, self.weight, self.bias, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}"


def linear_weight_usable(linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``linear``'s weight may be used directly instead of calling ``linear``: it is a plain
    ``nn.Linear`` (not a PEFT or quantised wrapper) with no hooks to skip (DeepSpeed ZeRO-3, a
    per-layer FSDP2 unit, user hooks), its weight is whole (not a DTensor shard) and of ``x``'s
    dtype (no autocast between them), and ``x`` is a plain tensor (a tensor-parallel plan's DTensor
    goes through the module, which computes on it as the plan says)."""
    if (
        type(linear) is not nn.Linear or isinstance(linear.weight, DTensor) or isinstance(x, DTensor)
        or linear.weight.dtype != x.dtype
    ):
        return False
    return not (linear._forward_pre_hooks or linear._forward_hooks
                or _module._global_forward_pre_hooks or _module._global_forward_hooks)


class _GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) · up_proj(x))`` with the gate and the down projection fused
    by :func:`tigon.functional.swiglu_linear` (or ``geglu_linear``): the gate's product is not
    kept for backward. A ``down_proj`` that is wrapped or hooked is called as a module instead.

    Under non-reentrant activation checkpointing this costs time: the recomputation stops once
    the last tensor the original forward saved is saved again, which for a plain ``down_proj``
    happens before its matmul (built-in ops save their inputs first) but for the fused function
    after it, so the down projection is recomputed. The patched Hugging Face MLPs, usually
    checkpointed, therefore keep ``down_proj`` separate.
    """

    _gate: Callable[..., torch.Tensor]
    _gate_linear: Callable[..., torch.Tensor]
    # The Hugging Face activation names (``ACT2FN`` keys) that the gate computes exactly.
    activations: tuple[str, ...]

    def __init__(
        self, hidden_size: int | Any, intermediate_size: int | None = None, bias: bool | None = None,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        """``(hidden_size, intermediate_size, bias=False)``, or a Hugging Face config as the Hugging
        Face MLPs (and Liger-Kernel's) take it: its ``hidden_size``, ``intermediate_size``,
        ``mlp_bias`` (``False`` if absent; ``bias`` overrides it) and activation
        (``hidden_activation`` or ``hidden_act``), which must be one the gate computes."""
        if not isinstance(hidden_size, int):
            hidden_size, intermediate_size, bias = self._from_config(hidden_size, intermediate_size, bias)
        elif intermediate_size is None:
            raise TypeError(
                f"{type(self).__name__} takes (hidden_size, intermediate_size) or a Hugging Face config; "
                f"got hidden_size={hidden_size} and no intermediate_size"
            )
        bias = bool(bias)
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias, device, dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias, device, dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias, device, dtype)

    @classmethod
    def _from_config(cls, config: Any, intermediate_size: int | None, bias: bool | None) -> tuple[int, int, bool]:
        """``(hidden_size, intermediate_size, bias)`` read from a Hugging Face config."""
        name = cls.__name__
        hidden, intermediate = getattr(config, "hidden_size", None), getattr(config, "intermediate_size", None)
        if intermediate_size is not None:
            raise TypeError(f"{name}(config) reads intermediate_size from the config; got intermediate_size too")
        if not (isinstance(hidden, int) and isinstance(intermediate, int)):
            got = f"hidden_size={hidden!r}, intermediate_size={intermediate!r}"
            raise TypeError(
                f"{name} takes (hidden_size, intermediate_size) as ints or a Hugging Face config whose hidden_size "
                f"and intermediate_size are ints; got a {type(config).__name__} with {got}"
            )
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if activation is not None and activation not in cls.activations:
            raise ValueError(
                f"{name} computes {' / '.join(cls.activations)}, but the config's activation is {activation!r}"
            )
        return hidden, intermediate, bool(getattr(config, "mlp_bias", False) if bias is None else bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The projections' outputs are seen by nothing else, so their gradients may overwrite them.
        gate, up = self.gate_proj(x), self.up_proj(x)
        if linear_weight_usable(self.down_proj, gate):
            return type(self)._gate_linear(gate, up, self.down_proj.weight, self.down_proj.bias, inplace_backward=True)
        return self.down_proj(type(self)._gate(gate, up, inplace_backward=True))


class SwiGLUMLP(_GatedMLP):
    """Llama-style MLP: ``down_proj(silu(gate_proj(x)) · up_proj(x))``; ``SwiGLUMLP(config)`` takes
    a Hugging Face config as ``LlamaMLP(config)`` does."""

    activations = ("silu", "swish")
    _gate = staticmethod(F.swiglu)
    _gate_linear = staticmethod(F.swiglu_linear)


class GeGLUMLP(_GatedMLP):
    """Gemma-style MLP: ``down_proj(gelu_tanh(gate_proj(x)) · up_proj(x))``; ``GeGLUMLP(config)``
    takes a Hugging Face config as ``GemmaMLP(config)`` does."""

    activations = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh")
    _gate = staticmethod(F.geglu)
    _gate_linear = staticmethod(F.geglu_linear)


class CrossEntropyLoss(nn.Module):
    """``loss(logits, target)`` with the options of :func:`tigon.functional.cross_entropy`.

    Like ``torch.nn.CrossEntropyLoss`` it leaves ``logits`` as they were. ``inplace_backward=True``
    is the faster opt-in: the gradient overwrites the logits during the forward pass, so the loss
    costs no extra ``[N, V]`` memory, but the logits must then not be used after the call (nor be
    needed by another op's backward). The options are keyword-only (``torch.nn.CrossEntropyLoss``'s
    first positional argument is a class ``weight``, which tigon does not take).
    """

    def __init__(
        self, *, ignore_index: int = -100, reduction: Reduction = "mean", label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
        inplace_backward: bool = False,
    ) -> None:
        super().__init__()
        self.options: dict[str, Any] = dict(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
            inplace_backward=inplace_backward,
        )

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The loss, and the z-loss when ``return_z_loss``."""
        return F.cross_entropy(logits, target, **self.options)


class FusedLinearCrossEntropyLoss(nn.Module):
    """``loss(input, weight, target, bias=None)``: the cross entropy of ``input @ weight.T + bias``
    without materialising the logits; options (keyword-only) of
    :func:`tigon.functional.fused_linear_cross_entropy`. Liger's module takes ``(lin_weight, _input,
    target)``: that order is refused with an error naming the swap."""

    def __init__(
        self, *, ignore_index: int = -100, reduction: Reduction = "mean", label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
        chunk_memory_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.options: dict[str, Any] = dict(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
            chunk_memory_bytes=chunk_memory_bytes,
        )

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The loss, and the z-loss when ``return_z_loss``."""
        return F.fused_linear_cross_entropy(input, weight, target, bias, **self.options)
