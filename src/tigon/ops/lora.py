"""LoRA: a linear layer plus a low-rank adapter, ``y = x Wᵀ + b + s · (x Aᵀ) Bᵀ``, in one function.

``W [out, in]`` (and ``b``) is the frozen base layer, ``A [r, in]`` and ``B [out, r]`` the adapter,
``s`` its scaling (``lora_alpha / r``, or ``/ √r`` for rsLoRA). PEFT computes the adapter as a
module chain, ``base(x) + lora_B(lora_A(dropout(x))) · s``: with its fp32 adapters on a bf16
model that is a cast of ``x`` to fp32, two fp32 matmuls, an fp32 ``[N, out]`` product, its scaling,
an fp32 sum and a cast back, and autograd keeps the fp32 copies. Here the adapter's second
matmul accumulates straight into the base output (``addmm_``: cuBLAS reads the base product in its
epilogue), so the adapter costs two skinny matmuls and one extra pass over ``y``::

    y  = x Wᵀ + b                     the base matmul
    u  = x̃ Aᵀ                          [N, r];  x̃ = dropout(x), or x itself
    y += s · u Bᵀ                      in place

Backward, with ``dy`` the output's gradient and ``W`` frozen (no ``dW``)::

    g  = s · dy B                      [N, r]
    dB = s · dyᵀ u                     u recomputed from x̃ (one skinny matmul), not kept
    dA = gᵀ x̃
    dx = dy W  (+ g A, added in place when x̃ is x; else it is the gradient of x̃)

Nothing of shape ``[N, out]`` is kept; the function keeps only its inputs, saved before its
matmuls run (:func:`tigon.ops._launch.keep_for_backward`), so that non-reentrant checkpointing
stops recomputing before them.

Dtypes: the products run in ``x``'s dtype (that of ``W``), accumulating in fp32 as cuBLAS does;
the adapter's weights, of any float dtype (PEFT keeps them in fp32), are cast to it for the
matmuls, and their gradients are returned in their own dtype. This is what autocast does with
fp32 weights; in fp32 it is PEFT's arithmetic.

Over a base layer that tigon does not compute (bitsandbytes' 4-bit layers of QLoRA), the adapter
is added to the base's output by :class:`LoRAAddFunction`: ``y = base_out + s · (x̃ Aᵀ) Bᵀ`` in one
``addmm``, whose backward passes ``dy`` to the base's own backward unchanged and computes the
adapter's terms as above (``x``'s gradient from the adapter, ``g A``, is then summed with the
base's by autograd).

The gated MLP with adapters on its projections, which keeps only its input under checkpointing,
is :class:`tigon.ops.gated.GatedMLPFunction`; it uses the helpers here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tigon.ops._launch import as_rows, keep_for_backward, kept_tensors, kept_x_needs_grad, save_inputs


class Adapter(NamedTuple):
    """One adapter in the compute dtype: ``a [r, in]``, ``b [out, r]`` and its ``scaling``."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


def adapters(dtype: torch.dtype, tensors, scalings) -> list[Adapter | None]:
    """``tensors = (a₀, b₀, a₁, b₁, ...)`` (``None`` pairs for absent adapters) as :class:`Adapter`
    tuples cast to ``dtype``."""
    pairs = zip(tensors[::2], tensors[1::2], scalings)
    return [None if a is None else Adapter(a.to(dtype), b.to(dtype), scaling) for a, b, scaling in pairs]


def down_project(x_rows: torch.Tensor, *adapters: Adapter | None) -> list[torch.Tensor | None]:
    """``x Aᵀ`` (``[N, r]``) for each adapter present, in one matmul over ``x`` for all of them."""
    present = [adapter for adapter in adapters if adapter is not None]
    if not present:
        return [None] * len(adapters)
    u = x_rows @ torch.cat([adapter.a for adapter in present]).T if len(present) > 1 else x_rows @ present[0].a.T
    parts = iter(u.split([adapter.rank for adapter in present], dim=1))
    return [None if adapter is None else next(parts) for adapter in adapters]


def add_adapter_(out: torch.Tensor, u: torch.Tensor | None, adapter: Adapter | None, rows=slice(None)) -> None:
    """``out += s · u B[rows]ᵀ`` in place (nothing without an adapter); ``rows`` picks output
    features, for the slices of a backward that recomputes ``out`` piece by piece."""
    if adapter is not None:
        out.addmm_(u, adapter.b[rows].T, alpha=adapter.scaling)


class LoRALinearFunction(torch.autograd.Function):
    """``x Wᵀ + b + s · (x̃ Aᵀ) Bᵀ`` keeping nothing but its inputs (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, x_adapter):
        save_inputs(ctx, x, weight, bias, lora_a, lora_b, x_adapter)
        ctx.scaling = scaling
        x_rows = as_rows(x)
        (adapter,) = adapters(x.dtype, (lora_a, lora_b), (scaling,))
        x_adapter_rows = x_rows if x_adapter is None else as_rows(x_adapter).to(x.dtype)
        out = torch.nn.functional.linear(x_rows, weight, bias)
        add_adapter_(out, x_adapter_rows @ adapter.a.T, adapter)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, lora_a, lora_b, x_adapter = kept_tensors(ctx)
        _, need_weight, need_bias, need_a, need_b, _, need_x_adapter = ctx.needs_input_grad
        need_x = kept_x_needs_grad(ctx)
        (adapter,) = adapters(x.dtype, (lora_a, lora_b), (ctx.scaling,))
        x_rows, dout_rows = as_rows(x), as_rows(dout)
        x_adapter_rows = x_rows if x_adapter is None else as_rows(x_adapter).to(x.dtype)
        dout_b = dout_rows @ adapter.b
        dout_b.mul_(adapter.scaling)
        grad_a = (dout_b.T @ x_adapter_rows).to(lora_a.dtype) if need_a else None
        grad_b = None
        if need_b:
            grad_b = dout_rows.T @ (x_adapter_rows @ adapter.a.T)
            grad_b = grad_b.mul_(adapter.scaling).to(lora_b.dtype)
        grad_x = grad_x_adapter = None
        if need_x:
            grad_x = dout_rows @ weight
            if x_adapter is None:
                grad_x.addmm_(dout_b, adapter.a)
            grad_x = grad_x.view(x.shape)
        if need_x_adapter:
            grad_x_adapter = (dout_b @ adapter.a).to(x_adapter.dtype).view(x_adapter.shape)
        grad_weight = (dout_rows.T @ x_rows) if need_weight else None
        grad_bias = dout_rows.sum(0) if need_bias else None
        return grad_x, grad_weight, grad_bias, grad_a, grad_b, None, grad_x_adapter


def lora_linear(x, weight, bias, lora_a, lora_b, scaling, x_adapter):
    """``x Wᵀ + b + s · (x̃ Aᵀ) Bᵀ`` with ``x̃ = x_adapter`` (dropout of ``x``) or ``x``; inputs
    validated by :mod:`tigon.functional`."""
    x_kept = keep_for_backward(x, weight, bias, lora_a, lora_b, x_adapter)
    return LoRALinearFunction.apply(x_kept, weight, bias, lora_a, lora_b, float(scaling), x_adapter)


class LoRAAddFunction(torch.autograd.Function):
    """``base_out + s · (x̃ Aᵀ) Bᵀ`` keeping nothing but its inputs (see the module docstring)."""

    @staticmethod
    def forward(ctx, x_adapter, base_out, lora_a, lora_b, scaling):
        save_inputs(ctx, x_adapter, lora_a, lora_b)
        ctx.scaling = scaling
        base_rows = as_rows(base_out)
        (adapter,) = adapters(base_out.dtype, (lora_a, lora_b), (scaling,))
        u = as_rows(x_adapter).to(base_out.dtype) @ adapter.a.T
        return torch.addmm(base_rows, u, adapter.b.T, alpha=scaling).view(base_out.shape)

    @staticmethod
    def backward(ctx, dout):
        x_adapter, lora_a, lora_b = kept_tensors(ctx)
        _, need_base, need_a, need_b, _ = ctx.needs_input_grad
        (adapter,) = adapters(dout.dtype, (lora_a, lora_b), (ctx.scaling,))
        x_rows, dout_rows = as_rows(x_adapter).to(dout.dtype), as_rows(dout)
        dout_b = dout_rows @ adapter.b
        dout_b.mul_(adapter.scaling)
        grad_a = (dout_b.T @ x_rows).to(lora_a.dtype) if need_a else None
        grad_b = None
        if need_b:
            grad_b = (dout_rows.T @ (x_rows @ adapter.a.T)).mul_(adapter.scaling).to(lora_b.dtype)
        grad_x = None
        if kept_x_needs_grad(ctx):
            grad_x = (dout_b @ adapter.a).to(x_adapter.dtype).view(x_adapter.shape)
        return grad_x, dout if need_base else None, grad_a, grad_b, None


def add_lora(base_out, x_adapter, lora_a, lora_b, scaling):
    """``base_out + s · (x̃ Aᵀ) Bᵀ``; inputs validated by :mod:`tigon.functional`."""
    x_kept = keep_for_backward(x_adapter, lora_a, lora_b)
    return LoRAAddFunction.apply(x_kept, base_out, lora_a, lora_b, float(scaling))
