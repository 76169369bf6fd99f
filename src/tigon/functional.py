"""The functional API: argument checks, then one call into :mod:`tigon.ops`.

Every function accepts fp32, bf16 and fp16 tensors on a CUDA device (or on the CPU through
Triton's interpreter), computes in fp32 and returns the input dtype unless stated otherwise.
All gradients are exact (fp32 math, one rounding on store) and flow to every tensor input.
Options read as plain numbers (``eps``, ``offset``, ``temperature``...) get none: one given as a
tensor that requires grad is refused rather than silently left without a gradient.

The norms, the gates and RoPE also take DTensors (tensor parallelism's activations) placed where
the op is local, and run on each rank's shard (:mod:`tigon._dtensor`): the norms on activations
replicated or sharded on any dimension but the last (the weight and bias replicated), the gates on
``gate`` and ``up`` placed alike, RoPE on ``q`` and ``k`` sharded by heads (the tables replicated).
Other placements raise a ``ShardingError`` (a ``ValueError``) naming them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from tigon._checks import (
    INDEX_DTYPES,
    check_choice,
    check_input_weight_order,
    check_numbers,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    vocab_sharded_head,
)
from tigon._dtensor import GATE, NORM, ROPE, on_local_shards
from tigon.ops import cross_entropy as _cross_entropy
from tigon.ops import fp8 as _fp8
from tigon.ops import fused_linear_cross_entropy as _fused_linear_cross_entropy
from tigon.ops import fused_linear_logprobs as _fused_linear_logprobs
from tigon.ops import gated as _gated
from tigon.ops import layer_norm as _layer_norm
from tigon.ops import lora as _lora
from tigon.ops import moe as _moe
from tigon.ops import rms_norm as _rms_norm
from tigon.ops import rope as _rope
from tigon.ops import vocab_parallel as _vocab_parallel
from tigon.ops.fp8 import RecipeName as Fp8Recipe
from tigon.ops._launch import MAX_FUSED_ROW, host_sync_allowed, range_to_host, read_range

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "rms_norm_gated",
    "layer_norm",
    "rope",
    "swiglu",
    "geglu",
    "relu2",
    "swiglu_clamped",
    "swiglu_linear",
    "geglu_linear",
    "swiglu_mlp",
    "geglu_mlp",
    "lora_linear",
    "add_lora",
    "moe_experts",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "fused_linear_logprobs",
]

REDUCTIONS = ("mean", "sum", "none")

Reduction = Literal["mean", "sum", "none"]
CastingMode = Literal["llama", "gemma"]
MoEGate = Literal["swiglu", "geglu", "swiglu_clamped"]
LogprobField = Literal["log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"]
# (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1): None where not asked for.
LogprobFields = tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
]
# A LoRA adapter on a projection: (lora_a [r, in], lora_b [out, r], scaling).
LoraAdapter = tuple[torch.Tensor, torch.Tensor, float]


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> None:
    check_tensor("x", x)
    hidden = x.shape[-1]
    if hidden > MAX_FUSED_ROW:
        raise ValueError(f"x has hidden size {hidden}; tigon's norms support up to {MAX_FUSED_ROW}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            check_tensor(name, param)
            check_shape(name, param, (hidden,), "the last dimension of x")
    check_same_device(x=x, weight=weight, bias=bias)


@on_local_shards(NORM)
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, offset: float = 0.0,
    casting_mode: CastingMode = "llama",
) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension.

    Args:
        x: ``[..., H]``, any row stride.
        weight: ``[H]`` or ``None`` (no scale). Any float dtype; the output has ``x``'s dtype.
        eps: added to the mean square.
        offset: added to the weight: ``1.0`` gives Gemma's ``(1 + weight)``.
        casting_mode: ``"llama"`` normalises in fp32, rounds to ``x.dtype`` and then multiplies by
            the weight; ``"gemma"`` keeps everything in fp32 and rounds once at the end.
    Returns: ``[..., H]`` in ``x.dtype``.
    """
    _check_norm_args(x, weight)
    check_numbers(eps=eps, offset=offset)
    check_choice("casting_mode", casting_mode, _rms_norm.CASTING_MODES)
    return _rms_norm.rms_norm(x, weight, float(eps), float(offset), casting_mode)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
    offset: float = 0.0, casting_mode: CastingMode = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass over memory; ``weight``, ``eps``,
    ``offset`` and ``casting_mode`` as in :func:`rms_norm`.

    Args:
        x, residual: ``[..., H]`` of one shape and dtype. The sum is rounded to that dtype, as an
            eager ``x + residual`` would be.
    Returns: ``(normed, summed)``, both ``[..., H]`` in ``x.dtype``.
    """
    _check_norm_args(x, weight)
    check_tensor("residual", residual)
    check_shape("residual", residual, tuple(x.shape), "the shape of x")
    check_same_dtype(x=x, residual=residual)
    check_same_device(x=x, residual=residual)
    check_numbers(eps=eps, offset=offset)
    check_choice("casting_mode", casting_mode, _rms_norm.CASTING_MODES)
    return _rms_norm.fused_add_rms_norm(x, residual, weight, float(eps), float(offset), casting_mode)


@on_local_shards(NORM)
def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
    group_size: int | None = None, norm_before_gate: bool = True, casting_mode: CastingMode = "llama",
) -> torch.Tensor:
    """RMSNorm gated by ``silu(gate)``: the output norm of gated DeltaNet and Mamba2 mixers.

    Norm before gate: ``y = (weight · x̂) · silu(gate)`` with ``x̂ = x · rstd(x)``; gate before
    norm: ``y = weight · ẑ`` with ``ẑ = z · rstd(z)``, ``z = x · silu(gate)``. ``rstd`` is taken
    per group of ``group_size`` consecutive features when given (the weight stays one ``[H]``
    vector). The gate's product is always taken in fp32; ``casting_mode`` rounds as
    :func:`rms_norm` does, and in ``"llama"`` casting the norm-before-gate product ``weight · x̂``
    is rounded to ``x.dtype`` before the gate multiplies it when ``weight`` has that dtype, as
    eager PyTorch rounds the product of two bf16 tensors.

    The Hugging Face modules, with ``m`` the module (``gate=None`` gives the plain grouped norm)::

        Qwen3NextRMSNormGated, Qwen3_5RMSNormGated, OlmoHybridRMSNormGated:
            rms_norm_gated(x, gate, m.weight, m.variance_epsilon)
        FalconH1RMSNormGated:
            rms_norm_gated(x, gate, m.weight, m.variance_epsilon, group_size=H // m.n_groups,
                           norm_before_gate=m.norm_before_gate, casting_mode="gemma")
        MambaRMSNormGated (Mamba2), BambaRMSNormGated, GraniteMoeHybridRMSNormGated:
            rms_norm_gated(x, gate, m.weight, m.variance_epsilon, norm_before_gate=False)
        Zamba2RMSNormGated:
            rms_norm_gated(x, gate, m.weight, m.variance_epsilon, group_size=m.group_size,
                           norm_before_gate=False)

    (the Mamba2-style modules return ``weight``'s dtype when it is wider than ``x``'s; this
    returns ``x.dtype``).

    Args:
        x: ``[..., H]``, any row stride.
        gate: ``x``'s shape and dtype, any row stride, or ``None`` (no gate).
        weight: ``[H]`` or ``None``. Any float dtype.
        eps: added to each mean square.
        group_size: divides ``H`` and is at most 65536; ``None`` normalises the whole row.
        norm_before_gate: see above.
        casting_mode: ``"llama"`` or ``"gemma"``, as :func:`rms_norm`.
    Returns: ``[..., H]`` in ``x.dtype``. Gradients flow to ``x``, ``gate`` and ``weight``.
    """
    check_tensor("x", x)
    hidden = x.shape[-1]
    group_size = hidden if group_size is None else group_size
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0 or hidden % group_size:
        raise ValueError(f"group_size must be a positive int dividing x's last dimension {hidden}; got {group_size!r}")
    if group_size > MAX_FUSED_ROW:
        raise ValueError(f"group_size is {group_size}; tigon's norms support rows (groups) up to {MAX_FUSED_ROW}")
    if gate is not None:
        check_tensor("gate", gate)
        check_shape("gate", gate, tuple(x.shape), "the shape of x")
        check_same_dtype(x=x, gate=gate)
    if weight is not None:
        check_tensor("weight", weight)
        check_shape("weight", weight, (hidden,), "the last dimension of x")
    check_same_device(x=x, gate=gate, weight=weight)
    check_numbers(eps=eps)
    check_choice("casting_mode", casting_mode, _rms_norm.CASTING_MODES)
    return _rms_norm.rms_norm_gated(x, gate, weight, float(eps), group_size, bool(norm_before_gate), casting_mode)


@on_local_shards(NORM)
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5,
    offset: float = 0.0,
) -> torch.Tensor:
    """Layer normalisation over the last dimension (``torch.nn.functional.layer_norm`` semantics).

    Args:
        x: ``[..., H]``, any row stride.
        weight, bias: ``[H]`` or ``None``.
        offset: added to the weight, in the weight's dtype: ``1.0`` gives Nemotron's
            ``NemotronLayerNorm1P`` (``layer_norm(x, weight + 1, bias)``). Needs a weight.
    Returns: ``[..., H]`` in ``x.dtype``.
    """
    _check_norm_args(x, weight, bias)
    check_numbers(eps=eps, offset=offset)
    if offset and weight is None:
        raise ValueError(f"offset={offset!r} is added to the weight, but weight is None")
    return _layer_norm.layer_norm(x, weight, bias, float(eps), float(offset))


def _check_rope_table(
    name: str, table: torch.Tensor, batch: int, seq_len: int, rotary_dim: int, mrope: bool,
) -> None:
    """A cos/sin table's shape: ``[B or 1, T, W]`` or ``[T, W]`` (M-RoPE: ``[3, B or 1, T, W]``)
    with ``W = rotary_dim`` or ``rotary_dim/2``."""
    check_tensor(name, table)
    shape = tuple(table.shape)
    if mrope:
        table_ok = len(shape) == 4 and shape[0] == 3 and shape[1] in (1, batch) and shape[2] == seq_len
    elif len(shape) == 2:
        table_ok = shape[0] == seq_len
    else:
        table_ok = len(shape) == 3 and shape[0] in (1, batch) and shape[1] == seq_len
    if table_ok and shape[-1] in (rotary_dim, rotary_dim // 2):
        return
    if mrope:
        expected = f"[3, B or 1, T, rotary_dim] = [3, {batch} or 1, {seq_len}, {rotary_dim}] (time, height, width planes)"
    else:
        expected = f"[B or 1, T, rotary_dim] = [{batch} or 1, {seq_len}, {rotary_dim}] or [T, rotary_dim]"
    raise ValueError(
        f"{name} must be {expected}, or of width rotary_dim/2 = {rotary_dim // 2} (one angle per pair); got {shape}"
    )


def _check_rope_layout(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor) -> None:
    """Name q and k given as the projections' ``[B, T, H, D]`` rather than ``[B, H, T, D]``. The
    tables say which dimension is T (their second to last); when it is q's dimension 1 and not
    its dimension 2 (nor, where given, k's), the layout is the transposed one, and the error
    should not blame the tables. T equal to the head count cannot be told apart and is left to
    the shape checks."""
    if not isinstance(cos, torch.Tensor) or cos.dim() < 2:
        return
    seq_len = cos.shape[-2]
    tensors = {"q": q} if k is None else {"q": q, "k": k}
    if all(t.shape[1] == seq_len and t.shape[2] != seq_len for t in tensors.values()):
        got = ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors.items())
        subject = "q and k look" if k is not None else "q looks"
        transposed = " and ".join(f"{name}.transpose(1, 2)" for name in tensors)
        raise ValueError(
            f"{subject} like [B, T, H, D]: got {got}, whose dimension 1 is cos's T = {seq_len}; rope takes "
            f"[B, H, T, D]: pass {transposed} (read in place, no copy) and transpose the outputs back"
        )


def _check_mrope_section(mrope_section: Sequence[int], rotary_dim: int) -> tuple[int, int, int]:
    try:
        section = tuple(int(size) for size in mrope_section)
    except TypeError:
        section = None
    if section is None or len(section) != 3 or min(section) < 0 or sum(section) != rotary_dim // 2:
        raise ValueError(
            f"mrope_section must be three sizes (t, h, w) >= 0 summing to rotary_dim/2 = {rotary_dim // 2}; "
            f"got {mrope_section!r}"
        )
    return section


@on_local_shards(ROPE)
def rope(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None, *,
    interleaved: bool = False, deinterleave_output: bool = False, rotary_last: bool = False,
    mrope_section: Sequence[int] | None = None, mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary position embedding of queries and keys in one launch, every Hugging Face variant.

    Each pair ``(x_a, x_b)`` of the rotated features turns by its angle:
    ``out_a = x_a·cos_a − x_b·sin_a``, ``out_b = x_b·cos_b + x_a·sin_b``. By default the pairs are
    ``(x[i], x[i + R/2])``, i.e. ``out = x·cos + rotate_half(x)·sin`` with
    ``rotate_half([a, b]) = [-b, a]`` (Llama and most models); features past ``R = rotary_dim``
    pass through unchanged.

    Args:
        q: ``[B, Hq, T, D]``. Any strides (the usual transposed ``[B, T, H, D]`` projections are
            read in place and their outputs stay transposed).
        k: ``[B, Hk, T, D]`` with ``Hk`` dividing ``Hq`` (GQA), or ``None`` to rotate ``q`` alone
            (Gemma 4, DeepSeek V4).
        cos, sin: ``[B or 1, T, W]`` or ``[T, W]`` (M-RoPE: ``[3, B or 1, T, W]``), any float dtype,
            with ``W = rotary_dim`` (one entry per feature, indexed like the output: Hugging Face's
            ``cat(freqs, freqs)`` tables) or ``W = rotary_dim/2`` (one angle per pair, read by both
            members: GPT-OSS, and ``freqs_cis.real`` / ``freqs_cis.imag`` of the complex forms).
            They receive exact gradients when they require grad (then ``q`` and ``k`` are saved).
        rotary_dim: even, at most ``D``; defaults to ``D``.
        interleaved: pairs are ``(x[2i], x[2i + 1])``, the complex form
            ``view_as_complex(x.reshape(..., -1, 2)) * (cos + i·sin)`` (Llama 4, DeepSeek V2, V4);
            the output keeps that layout.
        deinterleave_output: with ``interleaved``, write the output half-split,
            ``cat([x_even·cos − x_odd·sin, x_odd·cos + x_even·sin])`` (DeepSeek V3's
            ``apply_rotary_pos_emb_interleave``, which reads only the first half of its full-width
            tables: pass ``cos[..., :R/2]``, ``sin[..., :R/2]`` for its exact table gradients; its
            halves being equal, the whole tables give the same output).
        rotary_last: rotate the last ``rotary_dim`` features instead of the first (DeepSeek V4's
            ``[nope | rope]`` heads).
        mrope_section: ``(t, h, w)`` summing to ``rotary_dim/2`` for multimodal RoPE (Qwen2-VL,
            Qwen2.5-VL): ``cos``/``sin`` hold three planes of angles, for the time, height and width
            positions; the first ``t`` pairs read plane 0, the next ``h`` plane 1, the last ``w``
            plane 2 (a full-width table's second half likewise).
        mrope_interleaved: with ``mrope_section``, Qwen3-VL's interleaved assignment instead: pair
            ``j`` reads plane 1 if ``j % 3 == 1 and j < 3h``, plane 2 if ``j % 3 == 2 and j < 3w``,
            else plane 0.
    Returns: ``(q_rot, k_rot)`` with the shapes, strides order and dtypes of ``q`` and ``k``;
        ``k_rot`` is ``None`` when ``k`` is.
    """
    check_tensor("q", q, dim=4)
    batch, q_heads, seq_len, head_dim = q.shape
    if k is not None:
        check_tensor("k", k, dim=4)
    _check_rope_layout(q, k, cos)
    if k is not None:
        check_same_dtype(q=q, k=k)
        if k.shape[0] != batch or k.shape[2] != seq_len or k.shape[3] != head_dim:
            raise ValueError(
                f"k must be [B, Hk, T, D] = [{batch}, Hk, {seq_len}, {head_dim}] to match q {tuple(q.shape)}, "
                f"got {tuple(k.shape)}"
            )
        if k.shape[1] == 0 or q_heads % k.shape[1] != 0:
            raise ValueError(f"k's head count must divide q's (GQA): got q heads {q_heads}, k heads {k.shape[1]}")
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    if deinterleave_output and not interleaved:
        raise ValueError(
            "deinterleave_output=True needs interleaved=True (it de-interleaves interleaved pairs); got interleaved=False"
        )
    if mrope_interleaved and mrope_section is None:
        raise ValueError("mrope_interleaved=True needs mrope_section (the (t, h, w) sizes); got mrope_section=None")
    if mrope_section is not None:
        mrope_section = _check_mrope_section(mrope_section, rotary_dim)
    for name, table in (("cos", cos), ("sin", sin)):
        _check_rope_table(name, table, batch, seq_len, rotary_dim, mrope_section is not None)
    if cos.shape[-1] != sin.shape[-1]:
        raise ValueError(
            f"cos must be [B or 1, T, rotary_dim] or of width rotary_dim/2 like sin (one width for both); "
            f"got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    variant = _rope.RotaryVariant(
        rotary_dim, bool(rotary_last), bool(interleaved), bool(deinterleave_output), mrope_section,
        bool(mrope_interleaved),
    )
    return _rope.rope(q, k, cos, sin, variant)


def _check_inplace_backward(inplace_backward: bool, **tensors: torch.Tensor) -> None:
    """Refuse ``inplace_backward=True`` on a tensor it would overwrite that is a leaf requiring
    grad (a parameter, an input made with ``requires_grad=True``) or a view of one: torch's
    in-place ops refuse those, whose values the optimiser steps from and whose ``.grad`` would
    alias them. Nothing is overwritten without a gradient to compute (grad mode off, or no input
    requiring grad), so nothing is refused then either."""
    if not (inplace_backward and torch.is_grad_enabled()):
        return
    for name, tensor in tensors.items():
        base = tensor._base
        if tensor.is_leaf and tensor.requires_grad:
            what = "a leaf tensor"
        elif base is not None and base.is_leaf and base.requires_grad and tensor.requires_grad:
            what = "a view of a leaf tensor"
        else:
            continue
        raise RuntimeError(
            f"inplace_backward=True writes the gradient over {name}, but {name} is {what} that requires grad "
            "(a parameter, or a tensor made with requires_grad=True), which torch's in-place operations refuse "
            f"to overwrite; pass inplace_backward=False, or use it on an op's output (a projection's, a head's)"
        )


def _check_gated_args(gate: torch.Tensor, up: torch.Tensor, inplace_backward: bool) -> None:
    check_tensor("gate", gate)
    check_tensor("up", up)
    check_shape("up", up, tuple(gate.shape), "the shape of gate")
    check_same_dtype(gate=gate, up=up)
    check_same_device(gate=gate, up=up)
    if inplace_backward and gate is up:
        raise ValueError("inplace_backward=True needs gate and up in separate memory; got the same tensor for both")
    _check_inplace_backward(inplace_backward, gate=gate, up=up)


@on_local_shards(GATE)
def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(gate) · up``. Backward recomputes the activation: nothing beyond the inputs is saved.

    Args:
        gate, up: one shape ``[...]`` and dtype.
        inplace_backward: when True, the backward overwrites ``gate`` and ``up`` with their
            gradients, which saves two ``[..., I]`` buffers. Only valid when nothing else uses
            ``gate`` or ``up`` afterwards, as inside an MLP that owns them; a leaf that requires
            grad (or a view of one) is refused, as by torch's in-place operations.
    Returns the same shape and dtype.
    """
    _check_gated_args(gate, up, inplace_backward)
    return _gated.swiglu(gate, up, bool(inplace_backward))


@on_local_shards(GATE)
def geglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``gelu_tanh(gate) · up`` (GELU with the tanh approximation, as Gemma's MLP).

    Args:
        gate, up: one shape ``[...]`` and dtype.
        inplace_backward: as :func:`swiglu`.
    Returns the same shape and dtype.
    """
    _check_gated_args(gate, up, inplace_backward)
    return _gated.geglu(gate, up, bool(inplace_backward))


@on_local_shards(GATE)
def relu2(x: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``relu(x)²``, the squared ReLU of Nemotron's MLP (Hugging Face's ``ACT2FN["relu2"]``).

    Backward, ``2·relu(x)·dout``, recomputes from ``x`` (nothing else is saved); NaN propagates
    as through ``torch.relu``.

    Args:
        x: ``[...]``, any layout.
        inplace_backward: when True, the backward overwrites ``x`` with its gradient, which saves
            an ``[..., I]`` buffer. Only valid when nothing else uses ``x`` afterwards, as the up
            projection's output inside an MLP.
    Returns the same shape and dtype.
    """
    check_tensor("x", x)
    _check_inplace_backward(inplace_backward, x=x)
    return _gated.relu2(x, bool(inplace_backward))


def swiglu_clamped(
    gate_up: torch.Tensor, *, alpha: float = 1.702, limit: float = 7.0, inplace_backward: bool = False,
) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU (``GptOssExperts._apply_gate``) on interleaved gate/up columns.

    With ``gate = gate_up[..., ::2]`` and ``up = gate_up[..., 1::2]``::

        gate = clamp(gate, max=limit),   up = clamp(up, −limit, limit)
        out  = (up + 1) · gate · sigmoid(alpha · gate)

    in fp32, rounded once (the eager module rounds each step in a 16-bit dtype). Gradients follow
    ``torch.clamp``'s: zero where an input lies outside the limits, passing where it equals them.

    Args:
        gate_up: ``[..., 2I]``, any row stride.
        alpha, limit: GPT-OSS's 1.702 and 7.0 by default; ``limit > 0``.
        inplace_backward: when True, the backward writes the gradient of ``gate_up`` over it
            (interleaved like it), as :func:`swiglu`.
    Returns ``[..., I]`` in ``gate_up.dtype``.
    """
    check_tensor("gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up must have an even last dimension (interleaved gate and up columns), got shape {tuple(gate_up.shape)}"
        )
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
        raise ValueError(f"alpha must be a finite number, got {alpha!r}")
    if not (isinstance(limit, (int, float)) and limit > 0):
        raise ValueError(f"limit must be a number > 0, got {limit!r}")
    _check_inplace_backward(inplace_backward, gate_up=gate_up)
    return _gated.swiglu_clamped(gate_up, float(alpha), float(limit), bool(inplace_backward))


def _check_gated_linear_args(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inplace_backward: bool,
) -> None:
    _check_gated_args(gate, up, inplace_backward)
    check_tensor("weight", weight, dim=2)
    check_shape("weight", weight, (weight.shape[0], gate.shape[-1]), "[out_features, the last dimension of gate]")
    tensors = dict(gate=gate, weight=weight)
    if bias is not None:
        check_tensor("bias", bias, dim=1)
        check_shape("bias", bias, (weight.shape[0],), "[out_features] of weight")
        tensors["bias"] = bias
    check_same_dtype(**tensors)
    check_same_device(**tensors)


def swiglu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """``(silu(gate) · up) @ weightᵀ (+ bias)``: the gate and down projection of a Llama MLP.

    Saves ``gate``, ``up`` and ``weight`` for backward but not the product ``silu(gate) · up``,
    which :func:`swiglu` followed by a separate linear layer keeps for the weight's gradient: one
    ``[..., I]`` tensor less per MLP. Backward recomputes it (one elementwise pass, fused with
    the gate's gradient).

    Args:
        gate, up: one shape ``[..., I]`` and dtype.
        weight: ``[H, I]``; bias: ``[H]`` or ``None``; the dtype of ``gate``.
        inplace_backward: as :func:`swiglu`.
    Returns ``[..., H]``.
    """
    _check_gated_linear_args(gate, up, weight, bias, inplace_backward)
    return _gated.gated_linear(gate, up, weight, bias, "silu", bool(inplace_backward))


def geglu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """``(gelu_tanh(gate) · up) @ weightᵀ (+ bias)``, as :func:`swiglu_linear` for Gemma's MLP."""
    _check_gated_linear_args(gate, up, weight, bias, inplace_backward)
    return _gated.gated_linear(gate, up, weight, bias, "gelu_tanh", bool(inplace_backward))


def _check_gated_mlp_args(
    x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor,
    loras: dict[str, LoraAdapter | None], tile_tokens: int | None,
) -> None:
    check_tensor("x", x)
    if tile_tokens is not None and (isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1):
        raise ValueError(f"tile_tokens must be a positive int or None, got {tile_tokens!r}")
    for name, weight in (("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight", down_weight)):
        check_tensor(name, weight, dim=2)
    n_inter, n_hidden = gate_weight.shape
    check_shape("gate_weight", gate_weight, (n_inter, x.shape[-1]), "[intermediate, the last dimension of x]")
    check_shape("up_weight", up_weight, (n_inter, n_hidden), "the shape of gate_weight")
    check_shape("down_weight", down_weight, (n_hidden, n_inter), "the transpose of gate_weight's shape")
    tensors = dict(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
    check_same_dtype(**tensors)
    check_same_device(**tensors)
    for projection, weight in (("gate", gate_weight), ("up", up_weight), ("down", down_weight)):
        lora = loras[projection]
        if lora is not None:
            n_out, n_in = weight.shape
            _check_adapter(n_out, n_in, *_adapter_tuple(f"{projection}_lora", lora), owner=f"{projection}_lora")
            check_same_device(x=x, **{f"{projection}_lora[0] (lora_a)": lora[0]})


def _adapter_tuple(name: str, lora: object) -> LoraAdapter:
    if not (isinstance(lora, (tuple, list)) and len(lora) == 3):
        raise TypeError(f"{name} must be None or (lora_a, lora_b, scaling), got {type(lora).__name__}")
    return tuple(lora)


def _check_adapter(
    n_out: int, n_in: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, owner: str | None = None,
    n_experts: int | None = None,
) -> None:
    """An adapter ``lora_a [r, n_in]``, ``lora_b [n_out, r]`` (any float dtype) and its scaling, or
    one per expert (``[E, r, n_in]``, ``[E, n_out, r]``) with ``n_experts``; ``owner`` names the
    argument that holds them (an MLP's ``gate_lora``), if not the function."""
    names = {name: name if owner is None else f"{owner}[{index}] ({name})"
             for index, name in enumerate(("lora_a", "lora_b", "scaling"))}
    experts, per_expert = ((), "") if n_experts is None else ((n_experts,), "E, ")
    check_tensor(names["lora_a"], lora_a, dim=2 + len(experts))
    check_tensor(names["lora_b"], lora_b, dim=2 + len(experts))
    rank = lora_a.shape[len(experts)]
    check_shape(names["lora_a"], lora_a, (*experts, rank, n_in), f"[{per_expert}rank, in_features of the base weight]")
    check_shape(names["lora_b"], lora_b, (*experts, n_out, rank),
                f"[{per_expert}out_features of the base weight, rank of lora_a]")
    check_numbers(**{names["scaling"]: scaling})
    check_same_device(**{names["lora_a"]: lora_a, names["lora_b"]: lora_b})


def swiglu_mlp(
    x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor, *,
    gate_lora: LoraAdapter | None = None, up_lora: LoraAdapter | None = None, down_lora: LoraAdapter | None = None,
    tile_tokens: int | None = None,
) -> torch.Tensor:
    """A Llama MLP, ``(silu(x @ gate_weightᵀ) · (x @ up_weightᵀ)) @ down_weightᵀ``, that keeps
    only its inputs for backward, with an optional LoRA adapter on each projection.

    Made for layers under non-reentrant activation checkpointing: the recomputation of the layer
    stops at this MLP's input, and the backward recomputes the gate and up projections itself,
    one slice of the intermediate dimension (as wide as ``H`` at most) at a time. The matmuls
    are those of a checkpointed plain MLP; the memory of its backward drops from four ``[N, I]``
    tensors to a few ``[N, ≤H]`` ones. Without checkpointing it costs the two projections again
    in backward: use :func:`swiglu` between the linear layers there.

    The forward is the plain MLP's (same matmuls, bit for bit); in backward, the weight
    gradients are exact slices and the input gradient is summed over the slices in ``x``'s dtype.

    An adapter ``(lora_a [r, in], lora_b [out, r], scaling)`` adds ``scaling · (p Aᵀ) Bᵀ`` to
    its projection of ``p`` (LoRA without dropout, see :func:`lora_linear`): its ``[N, r]``
    products are recomputed in backward with the projections, and its weights get gradients
    (in their own dtype) while the base weights, if frozen, get none.

    ``tile_tokens`` (long sequences) runs forward and backward over tiles of that many tokens (rows
    of ``x``): no ``[N, I]`` tensor exists, only ``[tile_tokens, I]`` ones, at the same matmuls.
    Each token's output and input gradient are computed within its tile; the weight and adapter
    gradients are summed over the tiles in fp32.

    Args:
        x: ``[..., H]``.
        gate_weight, up_weight: ``[I, H]``; down_weight: ``[H, I]``; all of ``x``'s dtype.
        gate_lora, up_lora, down_lora: ``None`` or ``(lora_a, lora_b, scaling)``.
        tile_tokens: a positive int, or ``None`` for one tile of every token.
    Returns ``[..., H]``.
    """
    loras = dict(gate=gate_lora, up=up_lora, down=down_lora)
    _check_gated_mlp_args(x, gate_weight, up_weight, down_weight, loras, tile_tokens)
    return _gated.gated_mlp(x, gate_weight, up_weight, down_weight, "silu", tuple(loras.values()), tile_tokens)


def geglu_mlp(
    x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor, *,
    gate_lora: LoraAdapter | None = None, up_lora: LoraAdapter | None = None, down_lora: LoraAdapter | None = None,
    tile_tokens: int | None = None,
) -> torch.Tensor:
    """The GeGLU MLP (``gelu_tanh`` gate, Gemma's) as :func:`swiglu_mlp`."""
    loras = dict(gate=gate_lora, up=up_lora, down=down_lora)
    _check_gated_mlp_args(x, gate_weight, up_weight, down_weight, loras, tile_tokens)
    return _gated.gated_mlp(x, gate_weight, up_weight, down_weight, "gelu_tanh", tuple(loras.values()), tile_tokens)


def lora_linear(
    x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float = 1.0, *,
    bias: torch.Tensor | None = None, x_adapter: torch.Tensor | None = None,
) -> torch.Tensor:
    """A linear layer with a LoRA adapter: ``x @ weightᵀ + bias + scaling · (x̃ @ lora_aᵀ) @ lora_bᵀ``.

    PEFT's ``lora.Linear`` in one function (see :mod:`tigon.ops.lora`): the adapter's product
    accumulates into the base output in place, nothing of shape ``[..., out]`` is kept for backward,
    and only the inputs are saved (before the matmuls, so that checkpointing recomputes none).
    The products run in ``x``'s dtype with fp32 accumulation; ``lora_a`` and ``lora_b`` may be of
    another float dtype (PEFT keeps them in fp32), are cast for the matmuls, and get their gradients
    in their own dtype. ``weight`` and ``bias`` get gradients only if they require them (frozen in
    LoRA).

    Args:
        x: ``[..., in]``.
        weight: ``[out, in]``, ``x``'s dtype; bias: ``[out]`` or ``None``.
        lora_a: ``[r, in]``; lora_b: ``[out, r]``; scaling: a float (``lora_alpha / r``).
        x_adapter: what the adapter reads instead of ``x`` (``dropout(x)``, any float dtype), or
            ``None`` for ``x`` itself.
    Returns ``[..., out]``.
    """
    check_tensor("x", x)
    check_tensor("weight", weight, dim=2)
    check_shape("weight", weight, (weight.shape[0], x.shape[-1]), "[out_features, the last dimension of x]")
    if bias is not None:
        check_tensor("bias", bias, dim=1)
        check_shape("bias", bias, (weight.shape[0],), "[out_features] of weight")
    check_same_dtype(x=x, weight=weight, bias=bias)
    n_out, n_in = weight.shape
    _check_adapter(n_out, n_in, lora_a, lora_b, scaling)
    if x_adapter is not None:
        check_tensor("x_adapter", x_adapter)
        check_shape("x_adapter", x_adapter, tuple(x.shape), "the shape of x")
    check_same_device(x=x, weight=weight, bias=bias, lora_a=lora_a, x_adapter=x_adapter)
    return _lora.lora_linear(x, weight, bias, lora_a, lora_b, scaling, x_adapter)


def add_lora(
    base_out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float = 1.0,
) -> torch.Tensor:
    """A LoRA adapter over the output of a base layer tigon does not compute (a quantised one, as
    in QLoRA): ``base_out + scaling · (x @ lora_aᵀ) @ lora_bᵀ``.

    One ``addmm`` reads ``base_out`` and writes the sum; backward passes the output's gradient to
    ``base_out`` unchanged (to the base layer's own backward) and computes the adapter's terms
    from the kept inputs, nothing of shape ``[..., out]`` kept (see :mod:`tigon.ops.lora`). The
    products run in ``base_out``'s dtype with fp32 accumulation; ``x`` (the base layer's input, or
    its dropout) and the adapter's weights may be of another float dtype and get their gradients
    in their own.

    Args:
        base_out: ``[..., out]``, the base layer's output.
        x: ``[..., in]`` with ``base_out``'s leading dimensions.
        lora_a: ``[r, in]``; lora_b: ``[out, r]``; scaling: a float (``lora_alpha / r``).
    Returns ``[..., out]`` of ``base_out``'s dtype.
    """
    check_tensor("base_out", base_out)
    check_tensor("x", x)
    check_shape("x", x, (*base_out.shape[:-1], x.shape[-1]), "[the leading dimensions of base_out, in_features]")
    _check_adapter(base_out.shape[-1], x.shape[-1], lora_a, lora_b, scaling)
    check_same_device(base_out=base_out, x=x, lora_a=lora_a)
    return _lora.add_lora(base_out, x, lora_a, lora_b, scaling)


_GATE_UP_LAYOUTS = {False: "[E, 2I, H]", True: "transposed [E, H, 2I]"}


def _check_gate_up_layout(gate_up_proj: torch.Tensor, n_hidden: int, transposed: bool) -> tuple[int, int]:
    """``(E, I)`` of ``gate_up_proj``, checked to be ``[E, 2I, H]`` (``[E, H, 2I]`` when
    ``transposed``). ``I`` is read on the axis opposite ``H`` in whichever layout holds ``H``, so a
    tensor of the other layout is told its right shape and the flag that takes it as it is."""
    shape = tuple(gate_up_proj.shape)
    # The layout whose H axis (last for [E, 2I, H], middle for [E, H, 2I]) holds hidden_states' H;
    # the declared one when both or neither do.
    holds_hidden = {False: shape[2] == n_hidden, True: shape[1] == n_hidden}
    layout = transposed if holds_hidden[transposed] or not holds_hidden[not transposed] else not transposed
    double_inter = shape[2] if layout else shape[1]
    if double_inter % 2:
        raise ValueError(
            f"gate_up_proj {_GATE_UP_LAYOUTS[layout]} has an odd 2I axis, {double_inter}: it must hold the gate and "
            f"up projections' columns, I each; got shape {shape}"
        )
    n_experts, n_inter = shape[0], double_inter // 2
    expected = (n_experts, n_hidden, 2 * n_inter) if transposed else (n_experts, 2 * n_inter, n_hidden)
    if shape != expected:
        other = f": that is the {_GATE_UP_LAYOUTS[layout]} layout, pass transposed={layout}" if layout != transposed else ""
        raise ValueError(
            f"gate_up_proj must have shape {expected} ({_GATE_UP_LAYOUTS[transposed]} with E = {n_experts} experts, "
            f"H = {n_hidden} of hidden_states, I = {n_inter}), got {shape}{other}"
        )
    return n_experts, n_inter


def _check_moe_args(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, transposed: bool,
    loras: dict[str, LoraAdapter | None],
) -> None:
    check_tensor("hidden_states", hidden_states, dim=2)
    check_tensor("top_k_index", top_k_index, dtypes=INDEX_DTYPES, dim=2)
    check_tensor("top_k_weights", top_k_weights, dim=2)
    check_tensor("gate_up_proj", gate_up_proj, dim=3)
    check_tensor("down_proj", down_proj, dim=3)
    n_tokens, n_hidden = hidden_states.shape
    n_experts, n_inter = _check_gate_up_layout(gate_up_proj, n_hidden, transposed)
    if transposed:
        check_shape("down_proj", down_proj, (n_experts, n_inter, n_hidden),
                    f"transposed [E, I, H], I = {n_inter} from gate_up_proj, H = {n_hidden} of hidden_states")
    else:
        check_shape("down_proj", down_proj, (n_experts, n_hidden, n_inter),
                    f"[E, H, I], H = {n_hidden} of hidden_states, I = {n_inter} from gate_up_proj")
    check_shape("top_k_index", top_k_index, (n_tokens, top_k_index.shape[1]), "[T, k], T of hidden_states")
    check_shape("top_k_weights", top_k_weights, tuple(top_k_index.shape), "[T, k], as top_k_index")
    if gate_up_bias is not None:
        check_tensor("gate_up_bias", gate_up_bias, dim=2)
        check_shape("gate_up_bias", gate_up_bias, (n_experts, 2 * n_inter), "[E, 2I]")
    if down_bias is not None:
        check_tensor("down_bias", down_bias, dim=2)
        check_shape("down_bias", down_bias, (n_experts, n_hidden), "[E, H]")
    check_same_dtype(hidden_states=hidden_states, gate_up_proj=gate_up_proj, down_proj=down_proj,
                     gate_up_bias=gate_up_bias, down_bias=down_bias)
    check_same_device(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights,
                      gate_up_proj=gate_up_proj, down_proj=down_proj, gate_up_bias=gate_up_bias, down_bias=down_bias)
    for projection, (n_out, n_in) in (("gate_up", (2 * n_inter, n_hidden)), ("down", (n_hidden, n_inter))):
        name = f"{projection}_lora"
        if loras[projection] is not None:
            lora_a, lora_b, scaling = _adapter_tuple(name, loras[projection])
            _check_adapter(n_out, n_in, lora_a, lora_b, scaling, owner=name, n_experts=n_experts)
            # The adapter's rank-space rows are computed in the experts' dtype and meet its factors
            # on the tensor cores: one dtype for all.
            check_same_dtype(hidden_states=hidden_states, **{f"{name}[0] (lora_a)": lora_a,
                                                             f"{name}[1] (lora_b)": lora_b})
            check_same_device(hidden_states=hidden_states, **{f"{name}[0] (lora_a)": lora_a})


def _expert_id_bounds(top_k_index: torch.Tensor) -> Any:
    """The expert ids' range on its way to the host (:func:`~tigon.ops._launch.range_to_host`):
    read once the experts' kernels are queued, which read only valid memory whatever the ids;
    ``None`` where no host sync is allowed (torch.compile, CUDA graph capture)."""
    if top_k_index.numel() == 0 or not host_sync_allowed(top_k_index):
        return None
    return range_to_host(top_k_index)


def _check_expert_ids(bounds: Any, n_experts: int, allow_dropped: bool) -> None:
    if bounds is None:
        return
    low, high = read_range(bounds)
    last = n_experts if allow_dropped else n_experts - 1  # id E: a dropped slot
    if low < 0 or high > last:
        expected = (
            f"[0, {n_experts}] ({n_experts}: a dropped slot, as expert parallelism marks another rank's experts)"
            if allow_dropped else f"[0, {n_experts})"
        )
        raise ValueError(
            f"top_k_index must hold expert ids in {expected}, as gate_up_proj has {n_experts} experts; "
            f"got ids from {low} to {high}"
        )


def moe_experts(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
    gate: MoEGate = "swiglu", transposed: bool = False, interleaved: bool = False, alpha: float = 1.702,
    limit: float = 7.0, allow_dropped: bool = False, gate_up_lora: LoraAdapter | None = None,
    down_lora: LoraAdapter | None = None,
) -> torch.Tensor:
    """A mixture-of-experts layer's experts, fused (transformers' experts forward, whose
    ``experts_implementation="tigon"`` this is)::

        y_t = Σ_j w_tj · (gate_fn(x_t W1_eᵀ + b1_e) W2_eᵀ + b2_e),   e = top_k_index[t, j]

    Args:
        hidden_states: ``x [T, H]``.
        top_k_index: ``[T, k]`` int64/int32 expert ids in ``[0, E)`` (``[0, E]`` with ``allow_dropped``).
        top_k_weights: ``[T, k]`` routing weights, any float dtype; their gradient is returned.
        gate_up_proj: ``[E, 2I, H]`` (``[E, H, 2I]`` when ``transposed``), the gate and up
            projections' columns concatenated ``[gate | up]`` or, with ``interleaved``, in pairs.
        down_proj: ``[E, H, I]`` (``[E, I, H]`` when ``transposed``), of ``hidden_states``' dtype.
        gate_up_bias, down_bias: optional ``[E, 2I]`` (same column order) and ``[E, H]``.
        gate: ``"swiglu"`` (``silu(gate) · up``), ``"geglu"`` (tanh GELU) or ``"swiglu_clamped"``
            (GPT-OSS's, with ``alpha`` and ``limit``: :func:`swiglu_clamped`).
        allow_dropped: also take id ``E`` in ``top_k_index``, which marks a dropped slot, as
            transformers' expert parallelism marks the slots of another rank's experts: it adds
            nothing to the output or to any gradient, and its routing weight gets gradient 0.
        gate_up_lora, down_lora: ``None`` or a LoRA adapter per expert on that projection,
            ``(lora_a [E, r, in], lora_b [E, out, r], scaling)`` (``in``, ``out``: ``H``, ``2I``
            for gate_up, in its column order; ``I``, ``H`` for down, whatever ``transposed``), in
            ``hidden_states``' dtype: expert ``e``'s weight acts as ``W_e + scaling · B_e A_e``,
            computed as ``x W_eᵀ + scaling · (x A_eᵀ) B_eᵀ`` inside the grouped matmuls, without
            forming ``B_e A_e``. The factors get their gradients (``W_e`` too, if it requires one).
    Returns ``[T, H]`` in ``hidden_states``' dtype. Gradients reach ``hidden_states``, the routing
    weights, the weights and the biases. The expert ids are checked on the host with a wait taken
    once the kernels are queued (the GPU stays busy), skipped under torch.compile and CUDA graphs.
    """
    check_choice("gate", gate, _moe.GATES)
    _check_moe_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                    transposed, dict(gate_up=gate_up_lora, down=down_lora))
    check_numbers(alpha=alpha, limit=limit)
    if gate == "swiglu_clamped" and not limit > 0:
        raise ValueError(f"limit must be a number > 0, got {limit!r}")
    bounds = _expert_id_bounds(top_k_index)
    gate_up_lora_a, gate_up_lora_b, gate_up_scaling = gate_up_lora or (None, None, 1.0)
    down_lora_a, down_lora_b, down_scaling = down_lora or (None, None, 1.0)
    out = _moe.MoEExpertsFunction.apply(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
        gate_up_lora_a, gate_up_lora_b, float(gate_up_scaling), down_lora_a, down_lora_b, float(down_scaling),
        gate, bool(transposed), bool(interleaved), float(alpha), float(limit),
    )
    _check_expert_ids(bounds, gate_up_proj.shape[0], allow_dropped)
    return out


def _check_loss_options(
    ignore_index: int, reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None,
) -> None:
    check_numbers(label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap)
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_choice("reduction", reduction, REDUCTIONS)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if lse_square_scale < 0.0:
        raise ValueError(f"lse_square_scale must be >= 0, got {lse_square_scale!r}")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be None or > 0, got {softcap!r}")


def _check_target(target: torch.Tensor, expected_shape: tuple[int, ...], what: str) -> None:
    check_tensor("target", target, dtypes=INDEX_DTYPES, min_dim=0)
    check_shape("target", target, expected_shape, what)


@overload
def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = ..., reduction: Reduction = ...,
    label_smoothing: float = ..., lse_square_scale: float = ..., softcap: float | None = ...,
    return_z_loss: Literal[False] = ..., inplace_backward: bool = ...,
) -> torch.Tensor: ...
@overload
def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = ..., reduction: Reduction = ...,
    label_smoothing: float = ..., lse_square_scale: float = ..., softcap: float | None = ...,
    return_z_loss: Literal[True], inplace_backward: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = ..., reduction: Reduction = ...,
    label_smoothing: float = ..., lse_square_scale: float = ..., softcap: float | None = ...,
    return_z_loss: bool, inplace_backward: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax cross entropy with fp32 math, its gradient computed during the forward pass.

    Per token with logits ``z`` (after ``softcap · tanh(z / softcap)`` when ``softcap`` is set)
    and ``lse = logsumexp(z)``::

        loss = (1 − ε)·(lse − z[target]) + ε·(lse − mean(z)) + lse_square_scale · lse²

    (``ε = label_smoothing``, as ``torch.nn.functional.cross_entropy``; the last term is the
    z-loss). Tokens whose target is ``ignore_index`` contribute zero loss and zero gradient;
    ``"mean"`` divides by the number of the others, and is NaN when there are none (every target
    ignored, or no tokens), with zero gradients, as ``torch.nn.functional.cross_entropy``.

    The options are keyword-only: ``torch.nn.functional.cross_entropy``'s third positional
    argument is a class ``weight`` and Liger's orders its options differently, so an option given
    by position would silently land on another.

    Args:
        logits: ``[..., V]`` fp32/bf16/fp16, ``V`` up to 262144; ``N·V`` may exceed 2³¹.
        target: ``[...]`` int64/int32 in ``[0, V)`` or ``ignore_index``. Another value raises
            ``ValueError``, checked once the kernels are queued; under CUDA-graph capture and
            torch.compile, where the host may not wait for the GPU, it is not checked and the
            token is ignored (as ``ignore_index``).
        return_z_loss: also return the z-loss term (reduced like the loss, already included in
            it, for logging: it carries no gradient of its own).
        inplace_backward: write the gradient into ``logits``' storage during the forward pass,
            so the loss costs no extra ``[N, V]`` memory. ``logits`` must then not be used
            afterwards (its values are overwritten) nor be needed by another op's backward, nor be
            a leaf that requires grad (refused, as by torch's in-place operations).
    Returns: the loss (fp32; a scalar, or ``[...]`` for ``reduction="none"``), and the z-loss
    when ``return_z_loss``.
    """
    check_tensor("logits", logits)
    _check_target(target, tuple(logits.shape[:-1]), "the leading dimensions of logits")
    check_same_device(logits=logits, target=target)
    _check_loss_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    _check_inplace_backward(inplace_backward, logits=logits)
    return _cross_entropy.cross_entropy(
        logits, target, ignore_index, reduction, float(label_smoothing), float(lse_square_scale),
        None if softcap is None else float(softcap), bool(return_z_loss), bool(inplace_backward),
    )


def _check_head(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor) -> None:
    check_input_weight_order(input, weight, "target", target)
    check_tensor("input", input)
    check_tensor("weight", weight, dim=2)
    if weight.shape[1] != input.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = input.shape[-1] = {input.shape[-1]}, got {tuple(weight.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias)
        check_shape("bias", bias, (weight.shape[0],), "the vocabulary size, weight.shape[0]")
    check_same_dtype(input=input, weight=weight, bias=bias)
    _check_target(target, tuple(input.shape[:-1]), "the leading dimensions of input")
    check_same_device(input=input, weight=weight, target=target, bias=bias)


def _check_chunk_memory(chunk_memory_bytes: int | None) -> None:
    if chunk_memory_bytes is not None and chunk_memory_bytes <= 0:
        raise ValueError(f"chunk_memory_bytes must be None or > 0, got {chunk_memory_bytes!r}")


@overload
def fused_linear_cross_entropy(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = ..., *,
    ignore_index: int = ..., reduction: Reduction = ..., label_smoothing: float = ..., lse_square_scale: float = ...,
    softcap: float | None = ..., return_z_loss: Literal[False] = ..., chunk_memory_bytes: int | None = ...,
    process_group: ProcessGroup | None = ..., fp8: Fp8Recipe | None = ...,
) -> torch.Tensor: ...
@overload
def fused_linear_cross_entropy(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = ..., *,
    ignore_index: int = ..., reduction: Reduction = ..., label_smoothing: float = ..., lse_square_scale: float = ...,
    softcap: float | None = ..., return_z_loss: Literal[True], chunk_memory_bytes: int | None = ...,
    process_group: ProcessGroup | None = ..., fp8: Fp8Recipe | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def fused_linear_cross_entropy(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = ..., *,
    ignore_index: int = ..., reduction: Reduction = ..., label_smoothing: float = ..., lse_square_scale: float = ...,
    softcap: float | None = ..., return_z_loss: bool, chunk_memory_bytes: int | None = ...,
    process_group: ProcessGroup | None = ..., fp8: Fp8Recipe | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def fused_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    chunk_memory_bytes: int | None = None,
    process_group: ProcessGroup | None = None,
    fp8: Fp8Recipe | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy of ``input @ weight.T (+ bias)`` without holding the ``[N, V]`` logits.

    Tokens are processed in chunks whose logits fit in ``chunk_memory_bytes`` (default: see
    :data:`tigon.ops.fused_linear.DEFAULT_CHUNK_MEMORY_BYTES`, more for a vocabulary beyond
    :data:`~tigon.ops.fused_linear.DEFAULT_CHUNK_VOCAB`), so the extra memory
    does not grow with ``N``. Gradients flow to ``input``, ``bias`` and to ``weight`` when it
    requires grad (a frozen head, as with LoRA, costs no ``[V, H]`` gradient). The keyword-only
    options are :func:`cross_entropy`'s.

    Args:
        input: ``[..., H]``; weight: ``[V, H]``; bias: ``[V]`` or ``None``; one float dtype.
            In that order: Liger's ``(lin_weight, _input, target)`` is refused, naming the swap.
        target: ``[...]`` as ``input``'s leading dimensions, checked as :func:`cross_entropy`'s.
        process_group: with ``weight`` (and ``bias``) this rank's shard ``[V_r, H]`` of a head sharded
            along the vocabulary over the group's ranks, in rank order (see below); ``None`` for a
            whole head, or a DTensor one.
        fp8: run the head's three matmuls (logits, input and weight gradients) in FP8 with fp32
            accumulation, scaled as torchao's float8 recipe of that name does: ``"tensorwise"``,
            ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (:mod:`tigon.ops.fp8`); the softmax stays
            fp32. ``V`` and ``H`` must divide by 16. A model patched by tigon whose ``lm_head``
            torchao converted (``Float8Linear``) follows its recipe by itself. Not with a
            vocabulary-sharded head.

    **Vocabulary-parallel heads.** ``weight`` may be sharded along the vocabulary: a DTensor placed
    ``(Shard(0),)`` on a 1-D device mesh (``bias`` ``None`` or placed alike), or a plain shard with
    ``process_group``; shards may be uneven (DTensor's 51 and 50 rows of V = 101 over two ranks),
    even empty. ``input`` and ``target`` hold the same tokens on every rank (plain tensors, or
    DTensors placed ``Replicate()``). Each rank computes its slice's logits chunk by chunk (as many
    rows per chunk as one process over the whole head, so each rank holds ``1 / TP`` of its
    logits memory), and one all-gather of a few statistics per token and chunk combines the slices
    (:mod:`tigon.ops.vocab_parallel`): no rank holds all the logits or the whole weight, and every
    rank gets the whole loss, equal to one process's. The gradients of ``weight`` and ``bias`` are each rank's slice (a DTensor's placed as
    it); a plain ``input``'s is all-reduced to the whole gradient, a DTensor ``input``'s is placed
    ``Partial()`` (the sum over the ranks, reduced where its placement asks). One more small
    collective per call checks the layout (a host sync). Not under torch.compile or CUDA graphs.
    """
    sharded = vocab_sharded_head(input, weight, bias, target, process_group)
    if sharded is not None:
        input, weight, bias, target, group, reduce_grad_input = sharded
    _check_head(input, weight, bias, target)
    _check_loss_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    _check_chunk_memory(chunk_memory_bytes)
    _fp8.check_recipe(fp8, weight.shape)
    if sharded is not None:
        if fp8 is not None:
            raise ValueError(f"fp8={fp8!r} with a vocabulary-sharded head: not supported; pass fp8=None")
        return _vocab_parallel.fused_linear_cross_entropy(
            input, weight, target, bias, _vocab_parallel.vocab_shard(weight, target.numel(), group, reduce_grad_input),
            ignore_index, reduction, float(label_smoothing), float(lse_square_scale),
            None if softcap is None else float(softcap), bool(return_z_loss), chunk_memory_bytes,
        )
    return _fused_linear_cross_entropy.fused_linear_cross_entropy(
        input, weight, target, bias, ignore_index, reduction, float(label_smoothing), float(lse_square_scale),
        None if softcap is None else float(softcap), bool(return_z_loss), chunk_memory_bytes, fp8,
    )


def fused_linear_logprobs(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    outputs: Sequence[LogprobField] = ("log_probs",),
    ignore_index: int = -100,
    chunk_memory_bytes: int | None = None,
    grad_in_forward: bool = False,
    backward_context: Callable[[], AbstractContextManager[Any]] | None = None,
    process_group: ProcessGroup | None = None,
    fp8: Fp8Recipe | None = None,
) -> LogprobFields:
    """Per-token log-probabilities of ``target`` under ``input @ weight.T (+ bias)``, and
    optionally their entropy and more, without holding the ``[N, V]`` logits: the contract of
    TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``).

    The logits are transformed as ``z = softcap·tanh(logit_scale·y / softcap) / temperature``
    (no tanh when ``softcap`` is ``None``). Rows whose target is ``ignore_index`` give 0 (False
    for ``is_top1``) and no gradient. Gradients flow from ``log_probs`` and ``entropy`` to
    ``input``, ``bias`` and to ``weight`` when it requires grad.

    Args:
        input: ``[..., H]``; weight: ``[V, H]``; bias: ``[V]`` or ``None``; one float dtype.
        target: ``[...]`` as ``input``'s leading dimensions, int64/int32, checked as
            :func:`cross_entropy`'s.
        temperature: > 0. softcap: ``None`` or > 0 (Gemma's final logit softcap). logit_scale:
            multiplies the logits first (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``).
        outputs: which of ``"log_probs"``, ``"entropy"``, ``"log_sum_sq_probs"`` (``log Σ p²``),
            ``"mean_logits"`` (mean of ``z``) and ``"is_top1"`` (``target`` is ``argmax z``) to
            return; the others are ``None``. Each extra field costs a little on every call.
        chunk_memory_bytes: logits memory per chunk of tokens (default 512 MiB, times
            ``V / 128256`` for a larger vocabulary).
        grad_in_forward: promise that the loss's gradient with respect to ``log_probs`` is the
            same on every non-ignored token and that ``entropy`` gets none (a sum or mean of
            log-probs, as SFT's NLL): forward then computes the gradients as the fused linear
            cross entropy does, ``6·N·H·V`` FLOPs instead of ``8·N·H·V``. Backward checks the
            promise (one host sync) and recomputes when it does not hold: never wrong, only slower.
            Under CUDA-graph capture and torch.compile, where the host may not wait, it checks on
            the device instead, and a broken promise makes the gradients NaN.
        backward_context: ``None``, or a callable returning a context manager that a recomputing
            backward runs in, for a weight that must be gathered again to be read (DeepSpeed
            ZeRO-3: ``lambda: deepspeed.zero.GatheredParameters([weight])``).
        process_group: ``weight`` (and ``bias``) this rank's shard of a head sharded along the
            vocabulary, as in :func:`fused_linear_cross_entropy`, which also takes a DTensor
            ``weight`` placed ``(Shard(0),)``.
        fp8: the head's matmuls in FP8 by a torchao recipe, as in :func:`fused_linear_cross_entropy`.
    Returns: ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each ``target``-shaped,
        fp32 (``is_top1`` bool), or ``None`` when not in ``outputs``.
    """
    sharded = vocab_sharded_head(input, weight, bias, target, process_group)
    if sharded is not None:
        input, weight, bias, target, group, reduce_grad_input = sharded
    _check_head(input, weight, bias, target)
    if isinstance(outputs, str) or not set(outputs) <= set(_fused_linear_logprobs.FIELDS):
        raise ValueError(
            f"outputs must be a sequence of names from {', '.join(map(repr, _fused_linear_logprobs.FIELDS))}; "
            f"got {outputs!r}"
        )
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_numbers(temperature=temperature, softcap=softcap)
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be None or > 0, got {softcap!r}")
    if not (isinstance(logit_scale, (int, float)) and math.isfinite(logit_scale)):
        raise ValueError(f"logit_scale must be a finite number, got {logit_scale!r}")
    if backward_context is not None and not callable(backward_context):
        raise TypeError(f"backward_context must be None or callable, got {type(backward_context).__name__}")
    _check_chunk_memory(chunk_memory_bytes)
    _fp8.check_recipe(fp8, weight.shape)
    if sharded is not None:
        if fp8 is not None:
            raise ValueError(f"fp8={fp8!r} with a vocabulary-sharded head: not supported; pass fp8=None")
        return _vocab_parallel.fused_linear_logprobs(
            input, weight, target, bias, _vocab_parallel.vocab_shard(weight, target.numel(), group, reduce_grad_input),
            ignore_index, float(temperature), None if softcap is None else float(softcap), float(logit_scale),
            tuple(outputs), chunk_memory_bytes, bool(grad_in_forward), backward_context,
        )
    return _fused_linear_logprobs.fused_linear_logprobs(
        input, weight, target, bias, ignore_index, float(temperature), None if softcap is None else float(softcap),
        float(logit_scale), tuple(outputs), chunk_memory_bytes, bool(grad_in_forward), backward_context, fp8,
    )
