"""Cross entropy of ``x @ Wᵀ (+ b)`` without ever holding the ``[N, V]`` logits.

The tokens are processed in chunks of ``C`` rows whose logits fit in ``chunk_memory_bytes``; one
``[C, V]`` buffer is reused by every chunk::

    logits  = x_c @ Wᵀ (+ b)                   cuBLAS, fp32 accumulation, stored in x's dtype
    loss_c, dlogits = cross_entropy(logits)    tigon's kernel, gradient written over the buffer
    dx_c    = dlogits @ W
    dW     += dlogits_cᵀ @ x_c                 (the first chunk writes, the others accumulate)
    db     += Σ_rows dlogits                   fp32

``dlogits`` is the cross-entropy gradient of :mod:`tigon.ops.cross_entropy` (softcap, label
smoothing, z-loss and ``ignore_index`` included), already divided by the number of non-ignored
tokens for ``"mean"``. For ``"mean"`` and ``"sum"`` the gradients are therefore computed during
the forward pass and backward multiplies them by ``grad_output`` in place (nothing to do when it
is 1, the usual ``loss.backward()``). For ``"none"`` the forward pass computes the losses only and
backward recomputes the logits chunk by chunk with the per-token ``grad_output`` folded into
``dlogits``. Gradients are computed only for the tensors that require them: a frozen head (LoRA)
costs no ``[V, H]`` gradient and no ``dlogitsᵀ @ x`` matmul.

Shapes: ``input [..., H]`` (any row stride), ``weight [V, H]``, ``bias [V]`` or ``None``, one of
fp32/bf16/fp16; ``target [...]`` int64/int32. Cost: ``6·N·H·V`` matmul FLOPs (``8·N·H·V`` for
``"none"``, which recomputes) plus, per chunk, a read and a write of the ``[V, H]`` weight
gradient by the accumulating matmul; extra memory ``C·V`` logits plus the gradients themselves.
"""

from __future__ import annotations

import torch

from tigon.ops._launch import as_rows, tigon_op
from tigon.ops.cross_entropy import (
    check_targets,
    cross_entropy_bwd,
    launch_cross_entropy_fwd,
    reduce_rows,
    shaped_losses,
)

# Logits memory per chunk. Smaller chunks hold less but make the [V, H] weight gradient be read and
# written once more per chunk, and make the matmuls thinner: see docs/perf-notes/cross_entropy.md.
DEFAULT_CHUNK_MEMORY_BYTES = 512 * 2**20
# Chunks larger than this many rows are rounded down to a multiple of it, a whole number of
# matmul tiles.
CHUNK_ROW_MULTIPLE = 64


def chunk_rows_for(n_rows: int, n_classes: int, element_size: int, chunk_memory_bytes: int | None) -> int:
    """Rows per chunk: as many ``[V]`` logits rows as fit in ``chunk_memory_bytes``, at least 1."""
    budget = DEFAULT_CHUNK_MEMORY_BYTES if chunk_memory_bytes is None else int(chunk_memory_bytes)
    rows = max(1, budget // (n_classes * element_size))
    if rows > CHUNK_ROW_MULTIPLE:
        rows -= rows % CHUNK_ROW_MULTIPLE
    return max(1, min(rows, n_rows))


def _chunked_cross_entropy(
    x2d, weight, target, bias, grad_scale, loss, z_loss, grad_input, grad_weight, grad_bias, chunk_rows,
    ignore_index, label_smoothing, lse_square_scale, softcap, matmul_scale=1.0,
):
    """The chunk loop: writes ``loss [N]`` (and ``z_loss``) and, when any of them is given, the
    gradients ``grad_input [N, H]``, ``grad_weight [V, H]``, ``grad_bias [V]`` (fp32), each
    gradient row of the logits multiplied by ``grad_scale`` (``[N]`` or ``None``) and every
    gradient by ``matmul_scale``.

    ``matmul_scale`` (``1 / n_valid`` for ``"mean"``) is applied by the matmuls in fp32 rather than
    stored into ``dlogits``: in fp16, ``p / n_valid`` falls below the smallest subnormal (6e-8)
    for a few thousand tokens and would flush to zero before the matmuls read it."""
    n_rows = x2d.shape[0]
    compute_grad = grad_input is not None or grad_weight is not None or grad_bias is not None
    logits_buffer = x2d.new_empty((min(chunk_rows, n_rows), weight.shape[0]))
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        x_chunk, logits = x2d[start:end], logits_buffer[: end - start]
        if bias is None:
            torch.mm(x_chunk, weight.t(), out=logits)
        else:
            torch.addmm(bias, x_chunk, weight.t(), out=logits)
        chunk_scale = grad_scale if grad_scale is None or grad_scale.numel() == 1 else grad_scale[start:end]
        launch_cross_entropy_fwd(
            logits, target[start:end], logits if compute_grad else None, chunk_scale,
            loss[start:end], None if z_loss is None else z_loss[start:end],
            ignore_index, label_smoothing, lse_square_scale, softcap,
        )
        # From here on the buffer holds dlogits.
        # beta = 0 ignores what the output held (torch.empty); alpha is applied in fp32.
        if grad_input is not None:
            grad_input[start:end].addmm_(logits, weight, beta=0, alpha=matmul_scale)
        if grad_weight is not None:
            grad_weight.addmm_(logits.t(), x_chunk, beta=0 if start == 0 else 1, alpha=matmul_scale)
        if grad_bias is not None:
            grad_bias.add_(logits.sum(0, dtype=torch.float32), alpha=matmul_scale)


def _new_grads(x2d, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed):
    """Gradient buffers for what is needed, ``None`` for the rest (``grad_bias`` accumulates in fp32)."""
    # The first chunk's matmul writes grad_weight; without tokens there is no chunk to do it.
    new_weight_like = torch.empty_like if x2d.shape[0] > 0 else torch.zeros_like
    return (
        torch.empty_like(x2d, memory_format=torch.contiguous_format) if grad_input_needed else None,
        new_weight_like(weight, memory_format=torch.contiguous_format) if grad_weight_needed else None,
        torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if grad_bias_needed else None,
    )


def _grads_out(x2d, bias, grad_input, grad_weight, grad_bias):
    """The gradients as op outputs: an empty tensor (a distinct one: outputs may not alias) where
    one was not computed."""
    return (
        x2d.new_empty(0) if grad_input is None else grad_input,
        x2d.new_empty(0) if grad_weight is None else grad_weight,
        x2d.new_empty(0) if grad_bias is None else grad_bias.to(bias.dtype),
    )


def _grads_fake(input, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed):
    n_rows = input.numel() // input.shape[-1]
    return (
        input.new_empty((n_rows, input.shape[-1]) if grad_input_needed else (0,)),
        weight.new_empty(tuple(weight.shape) if grad_weight_needed else (0,)),
        input.new_empty((weight.shape[0],) if grad_bias_needed else (0,)),
    )


def _fwd_fake(input, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
              return_z_loss, chunk_rows, grad_input_needed, grad_weight_needed, grad_bias_needed):
    shape = (target.numel(),) if reduction == "none" else ()
    loss = input.new_empty(shape, dtype=torch.float32)
    z_loss = input.new_empty(shape if return_z_loss else (0,), dtype=torch.float32)
    in_forward = reduction != "none"
    return loss, z_loss, *_grads_fake(
        input, weight, bias,
        grad_input_needed and in_forward, grad_weight_needed and in_forward, grad_bias_needed and in_forward,
    )


@tigon_op("fused_linear_cross_entropy_fwd", fake=_fwd_fake)
def fused_linear_cross_entropy_fwd(
    input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ignore_index: int, reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None,
    return_z_loss: bool, chunk_rows: int, grad_input_needed: bool, grad_weight_needed: bool, grad_bias_needed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ ``loss`` (fp32 scalar, ``[N]`` for ``"none"``), ``z_loss`` (empty unless
    ``return_z_loss``) and, for ``"mean"``/``"sum"``, the needed gradients ``grad_input [N, H]``,
    ``grad_weight [V, H]``, ``grad_bias [V]`` for ``grad_output = 1`` (empty when not needed,
    and always for ``"none"``, whose backward recomputes)."""
    x2d, target = as_rows(input), target.reshape(-1)
    n_valid = check_targets(target, weight.shape[0], ignore_index)
    in_forward = reduction != "none"
    grad_input, grad_weight, grad_bias = _new_grads(
        x2d, weight, bias,
        grad_input_needed and in_forward, grad_weight_needed and in_forward, grad_bias_needed and in_forward,
    )
    loss = x2d.new_empty(x2d.shape[0], dtype=torch.float32)
    z_loss = torch.empty_like(loss) if return_z_loss else None
    _chunked_cross_entropy(
        x2d, weight, target, bias, None, loss, z_loss, grad_input, grad_weight, grad_bias, chunk_rows,
        ignore_index, label_smoothing, lse_square_scale, softcap,
        matmul_scale=1.0 / n_valid if reduction == "mean" else 1.0,
    )
    z_loss = reduce_rows(z_loss, reduction, n_valid) if return_z_loss else loss.new_empty(0)
    return reduce_rows(loss, reduction, n_valid), z_loss, *_grads_out(x2d, bias, grad_input, grad_weight, grad_bias)


def _bwd_fake(grad_loss, input, weight, target, bias, ignore_index, label_smoothing, lse_square_scale, softcap,
              chunk_rows, grad_input_needed, grad_weight_needed, grad_bias_needed):
    return _grads_fake(input, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed)


@tigon_op("fused_linear_cross_entropy_bwd", fake=_bwd_fake)
def fused_linear_cross_entropy_bwd(
    grad_loss: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    bias: torch.Tensor | None, ignore_index: int, label_smoothing: float, lse_square_scale: float,
    softcap: float | None, chunk_rows: int, grad_input_needed: bool, grad_weight_needed: bool,
    grad_bias_needed: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``reduction="none"``: recomputes each chunk's logits and folds the per-token
    ``grad_loss [...]`` (fp32) into ``dlogits``. Returns the gradients as the forward op does."""
    x2d, target = as_rows(input), target.reshape(-1)
    grad_input, grad_weight, grad_bias = _new_grads(
        x2d, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed,
    )
    scratch_loss = x2d.new_empty(x2d.shape[0], dtype=torch.float32)
    _chunked_cross_entropy(
        x2d, weight, target, bias, grad_loss.reshape(-1), scratch_loss, None, grad_input, grad_weight, grad_bias,
        chunk_rows, ignore_index, label_smoothing, lse_square_scale, softcap,
    )
    return _grads_out(x2d, bias, grad_input, grad_weight, grad_bias)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """``"mean"``/``"sum"`` save the gradients computed by the forward pass (scaled in place by
    ``grad_output`` in backward, so backward runs once per forward); ``"none"`` saves the inputs
    and recomputes."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale,
                softcap, return_z_loss, chunk_memory_bytes, needs):
        chunk_rows = chunk_rows_for(target.numel(), weight.shape[0], input.element_size(), chunk_memory_bytes)
        options = (ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss, chunk_rows)
        loss, z_loss, grad_input, grad_weight, grad_bias = fused_linear_cross_entropy_fwd(
            input, weight, target, bias, *options, *needs,
        )
        if reduction == "none":
            ctx.save_for_backward(input, weight, target, bias)
        else:
            ctx.save_for_backward(grad_input, grad_weight, grad_bias)
        ctx.options = (ignore_index, label_smoothing, lse_square_scale, softcap, chunk_rows)
        ctx.reduction, ctx.needs = reduction, needs
        ctx.input_shape = input.shape
        ctx.mark_non_differentiable(z_loss)
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss):
        if ctx.reduction == "none":
            input, weight, target, bias = ctx.saved_tensors
            grad_input, grad_weight, grad_bias = fused_linear_cross_entropy_bwd(
                grad_loss, input, weight, target, bias, *ctx.options, *ctx.needs,
            )
        else:
            grad_input, grad_weight, grad_bias = ctx.saved_tensors
            grad_output = grad_loss.reshape(1)
            for grad, needed in zip((grad_input, grad_weight, grad_bias.view(1, -1)), ctx.needs):
                if needed:
                    cross_entropy_bwd(grad, grad_output)
        grad_input_needed, grad_weight_needed, grad_bias_needed = ctx.needs
        return (
            grad_input.view(ctx.input_shape) if grad_input_needed else None,
            grad_weight if grad_weight_needed else None,
            None,
            grad_bias if grad_bias_needed else None,
            None, None, None, None, None, None, None, None,
        )


def fused_linear_cross_entropy(input, weight, target, bias, ignore_index, reduction, label_smoothing,
                               lse_square_scale, softcap, return_z_loss, chunk_memory_bytes):
    """``input [..., H]``, ``weight [V, H]``, ``target [...]``, ``bias [V]`` → the fp32 loss (and
    z-loss); inputs validated by :mod:`tigon.functional`."""
    # Which gradients to compute, known here rather than inside forward (which always runs
    # without grad mode) so that nothing is computed under torch.no_grad().
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(
        t is not None and t.requires_grad and grad_enabled for t in (input, weight, bias)
    )
    loss, z_loss = FusedLinearCrossEntropyFunction.apply(
        input, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
        return_z_loss, chunk_memory_bytes, needs,
    )
    return shaped_losses(loss, z_loss, target, reduction, return_z_loss)
