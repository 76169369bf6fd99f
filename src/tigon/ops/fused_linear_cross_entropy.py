"""Cross entropy of ``x @ Wᵀ (+ b)`` without ever holding the ``[N, V]`` logits.

The tokens are processed in chunks of ``C`` rows whose logits fit in ``chunk_memory_bytes``, by
the chunk loop of :mod:`tigon.ops.fused_linear` with tigon's cross-entropy kernel as its head::

    logits  = x_c @ Wᵀ (+ b)
    loss_c, dlogits = cross_entropy(logits)    gradient written over the logits buffer
    dx_c = dlogits @ W,  dW += dlogitsᵀ @ x_c,  db += Σ_rows dlogits

``dlogits`` is the cross-entropy gradient of :mod:`tigon.ops.cross_entropy` (softcap, label
smoothing, z-loss and ``ignore_index`` included; targets checked as there, with no host sync
under CUDA-graph capture). For ``"mean"`` every gradient is divided by ``n_valid``, the number of
non-ignored tokens, counted on the device: in eager mode the matmuls apply ``1 / n_valid`` in
fp32, under CUDA-graph capture the matmuls and the kernel share it
(:func:`tigon.ops.fused_linear.mean_scales`). For ``"mean"`` and ``"sum"`` the gradients are
therefore computed during the forward pass and backward multiplies them by ``grad_output`` in place (nothing to do when it
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
    check_target_bounds,
    count_valid,
    cross_entropy_bwd,
    launch_cross_entropy_fwd,
    reduce_rows,
    shaped_losses,
    target_bounds,
)
from tigon.ops.fused_linear import (
    chunk_rows_for,
    fused_linear_chunks,
    head_matmuls,
    mean_scales,
    new_grads,
    row_chunks,
)


def _chunked_cross_entropy(
    x2d, weight, target, bias, grad_scale, loss, z_loss, grad_input, grad_weight, grad_bias, chunk_rows,
    ignore_index, label_smoothing, lse_square_scale, softcap, matmul_scale=1.0, fp8=None,
):
    """Writes ``loss [N]`` (and ``z_loss``) and, when any of them is given, the gradients
    ``grad_input [N, H]``, ``grad_weight [V, H]``, ``grad_bias [V]`` (fp32), each gradient row of
    the logits multiplied by ``grad_scale`` (fp32 ``[N]`` per row, ``[1]`` for every row, or
    ``None``) and every gradient by the host number ``matmul_scale``; the matmuls in FP8 by the
    recipe ``fp8`` (:mod:`tigon.ops.fp8`) unless it is ``None``."""
    compute_grad = grad_input is not None or grad_weight is not None or grad_bias is not None
    matmuls = head_matmuls(weight, fp8, grad_input is not None, grad_weight is not None)
    # In FP8 with one scale per tensor, dlogits go from the logits straight to their FP8 copies
    # (Fp8HeadMatmuls.cross_entropy_grad); a bias's gradient needs them in 16 bits.
    grad_to_fp8 = compute_grad and grad_bias is None and matmuls.casts_cross_entropy_grad
    if grad_to_fp8:
        matmuls.group_grad_weight(chunk_rows)
        row_stats = x2d.new_empty((4, chunk_rows), dtype=torch.float32)
        grad_bounds = x2d.new_zeros(-(x2d.shape[0] // -chunk_rows), dtype=torch.float32)

    def cross_entropy_head(ranges, logits):
        ((start, end),) = ranges
        chunk_scale = grad_scale if grad_scale is None or grad_scale.numel() == 1 else grad_scale[start:end]
        # The gradient over the logits, or (grad_to_fp8) the rows' statistics for the FP8 one.
        grad = logits if compute_grad and not grad_to_fp8 else None
        stats_and_bound = (row_stats[:, : end - start], grad_bounds[start // chunk_rows :][:1]) if grad_to_fp8 else ()
        launch_cross_entropy_fwd(
            logits, target[start:end], grad, chunk_scale, loss[start:end], None if z_loss is None else z_loss[start:end],
            ignore_index, label_smoothing, lse_square_scale, softcap, *stats_and_bound,
        )
        if grad_to_fp8:
            matmuls.cross_entropy_grad(logits, target[start:end], *stats_and_bound, softcap)

    fused_linear_chunks(
        x2d, weight, bias, row_chunks(x2d.shape[0], chunk_rows), cross_entropy_head,
        grad_input, grad_weight, grad_bias, matmul_scale, matmuls=matmuls,
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
              return_z_loss, chunk_rows, grad_input_needed, grad_weight_needed, grad_bias_needed, fp8=None):
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
    fp8: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ ``loss`` (fp32 scalar, ``[N]`` for ``"none"``), ``z_loss`` (empty unless
    ``return_z_loss``) and, for ``"mean"``/``"sum"``, the needed gradients ``grad_input [N, H]``,
    ``grad_weight [V, H]``, ``grad_bias [V]`` for ``grad_output = 1`` (empty when not needed,
    and always for ``"none"``, whose backward recomputes)."""
    x2d, target = as_rows(input), target.reshape(-1)
    n_rows = x2d.shape[0]
    n_valid = count_valid(target, weight.shape[0], ignore_index) if reduction == "mean" else None
    in_forward = reduction != "none"
    grad_input, grad_weight, grad_bias = new_grads(
        x2d, weight,
        grad_input_needed and in_forward, grad_weight_needed and in_forward, grad_bias_needed and in_forward,
    )
    grad_scale, matmul_scale = None, 1.0
    if n_valid is not None and (grad_input_needed or grad_weight_needed or grad_bias_needed):
        grad_scale, matmul_scale = mean_scales(n_valid, n_rows)
    loss = x2d.new_empty(n_rows, dtype=torch.float32)
    z_loss = torch.empty_like(loss) if return_z_loss else None
    _chunked_cross_entropy(
        x2d, weight, target, bias, grad_scale, loss, z_loss, grad_input, grad_weight, grad_bias, chunk_rows,
        ignore_index, label_smoothing, lse_square_scale, softcap, matmul_scale, fp8,
    )
    z_loss = reduce_rows(z_loss, reduction, n_valid) if return_z_loss else loss.new_empty(0)
    return reduce_rows(loss, reduction, n_valid), z_loss, *_grads_out(x2d, bias, grad_input, grad_weight, grad_bias)


def _bwd_fake(grad_loss, input, weight, target, bias, ignore_index, label_smoothing, lse_square_scale, softcap,
              chunk_rows, grad_input_needed, grad_weight_needed, grad_bias_needed, fp8=None):
    return _grads_fake(input, weight, bias, grad_input_needed, grad_weight_needed, grad_bias_needed)


@tigon_op("fused_linear_cross_entropy_bwd", fake=_bwd_fake)
def fused_linear_cross_entropy_bwd(
    grad_loss: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    bias: torch.Tensor | None, ignore_index: int, label_smoothing: float, lse_square_scale: float,
    softcap: float | None, chunk_rows: int, grad_input_needed: bool, grad_weight_needed: bool,
    grad_bias_needed: bool, fp8: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``reduction="none"``: recomputes each chunk's logits and folds the per-token
    ``grad_loss [...]`` (fp32) into ``dlogits``. Returns the gradients as the forward op does."""
    x2d, target = as_rows(input), target.reshape(-1)
    grad_input, grad_weight, grad_bias = new_grads(
        x2d, weight, grad_input_needed, grad_weight_needed, grad_bias_needed,
    )
    scratch_loss = x2d.new_empty(x2d.shape[0], dtype=torch.float32)
    _chunked_cross_entropy(
        x2d, weight, target, bias, grad_loss.reshape(-1), scratch_loss, None, grad_input, grad_weight, grad_bias,
        chunk_rows, ignore_index, label_smoothing, lse_square_scale, softcap, fp8=fp8,
    )
    return _grads_out(x2d, bias, grad_input, grad_weight, grad_bias)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """``"mean"``/``"sum"`` save the gradients computed by the forward pass (scaled in place by
    ``grad_output`` in backward, so backward runs once per forward); ``"none"`` saves the inputs
    and recomputes."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale,
                softcap, return_z_loss, chunk_memory_bytes, needs, fp8):
        chunk_rows = chunk_rows_for(target.numel(), weight.shape[0], input.element_size(), chunk_memory_bytes)
        options = (ignore_index, reduction, label_smoothing, lse_square_scale, softcap, return_z_loss, chunk_rows)
        loss, z_loss, grad_input, grad_weight, grad_bias = fused_linear_cross_entropy_fwd(
            input, weight, target, bias, *options, *needs, fp8,
        )
        if reduction == "none":
            ctx.save_for_backward(input, weight, target, bias)
        else:
            ctx.save_for_backward(grad_input, grad_weight, grad_bias)
        ctx.options = (ignore_index, label_smoothing, lse_square_scale, softcap, chunk_rows)
        ctx.reduction, ctx.needs, ctx.fp8 = reduction, needs, fp8
        ctx.input_shape = input.shape
        ctx.mark_non_differentiable(z_loss)
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss):
        if ctx.reduction == "none":
            input, weight, target, bias = ctx.saved_tensors
            grad_input, grad_weight, grad_bias = fused_linear_cross_entropy_bwd(
                grad_loss, input, weight, target, bias, *ctx.options, *ctx.needs, ctx.fp8,
            )
        else:
            grad_input, grad_weight, grad_bias = ctx.saved_tensors
            grad_output = grad_loss.reshape(1)
            for grad, needed in zip((grad_input, grad_weight, grad_bias.view(1, -1)), ctx.needs):
                if needed:
                    cross_entropy_bwd(grad, grad_output, keep_zeros=True)
        grad_input_needed, grad_weight_needed, grad_bias_needed = ctx.needs
        return (
            grad_input.view(ctx.input_shape) if grad_input_needed else None,
            grad_weight if grad_weight_needed else None,
            None,
            grad_bias if grad_bias_needed else None,
            None, None, None, None, None, None, None, None, None,
        )


def fused_linear_cross_entropy(input, weight, target, bias, ignore_index, reduction, label_smoothing,
                               lse_square_scale, softcap, return_z_loss, chunk_memory_bytes, fp8=None):
    """``input [..., H]``, ``weight [V, H]``, ``target [...]``, ``bias [V]`` → the fp32 loss (and
    z-loss); inputs validated by :mod:`tigon.functional`, the targets' range here, once the
    kernels are queued."""
    # Which gradients to compute, known here rather than inside forward (which always runs
    # without grad mode) so that nothing is computed under torch.no_grad().
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(
        t is not None and t.requires_grad and grad_enabled for t in (input, weight, bias)
    )
    bounds = target_bounds(target, ignore_index)
    loss, z_loss = FusedLinearCrossEntropyFunction.apply(
        input, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
        return_z_loss, chunk_memory_bytes, needs, fp8,
    )
    check_target_bounds(bounds, weight.shape[0], ignore_index)
    return shaped_losses(loss, z_loss, target, reduction, return_z_loss)
