"""Losses of whole sequences' log-probabilities, computed from ``x @ Wᵀ (+ b)`` without the logits.

Preference losses (DPO, CPO, SimPO, ORPO, KTO) depend on the logits only through each sequence's
summed log-probability of its targets::

    logp_s = Σ_{t in s, target_t ≠ ignore} log softmax(z_t)[target_t] = −Σ_t ce_t

where ``ce_t`` is the token's cross entropy. With ``L`` any function of the ``logp_s`` (and of
the reference model's, which are constants), the chain rule gives the gradient of the logits of
every token of sequence ``s``::

    dL/dz_t = dL/d(Σ_t ce_t) · dce_t/dz_t = −dL/dlogp_s · (softmax(z_t) − onehot(target_t))

that is, the cross-entropy gradient that tigon's kernel writes over the logits, scaled by one
number per sequence, ``−dL/dlogp_s``. The chunk loop of :mod:`tigon.ops.fused_linear` applies
that number as its per-row scale to the ``[C, H]`` operands of the matmuls, never to the
``[C, V]`` logits. A pair's chosen and rejected sequences are always in the same chunk, so a
chunk holds everything its share of ``L`` depends on; the derivative of that share with respect
to the chunk's ``logp_s`` (a few numbers) is taken by autograd, so that each loss is written once,
as a formula.

Per chunk: the reference model's logits (when given) are computed first, reduced to its
``logp_s`` and discarded; then the policy's logits, loss and gradients as above. Gradients are
computed during the forward pass; backward multiplies them by ``grad_output`` in place.
Cost: ``6·N·H·V`` matmul FLOPs for the policy plus ``2·N·H·V`` for the reference; extra memory one
chunk of logits (at least one pair, or one sequence for unpaired losses) plus the gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tigon.ops._launch import as_rows
from tigon.ops.cross_entropy import check_targets, cross_entropy_bwd, launch_cross_entropy_fwd
from tigon.ops.fused_linear import DEFAULT_CHUNK_MEMORY_BYTES, fused_linear_chunks, gather_rows, new_grads

# sequence_loss(sequence_ids [k], logps [k], ref_logps [k], all fp64) → this chunk's share of the loss
# (fp64 scalar), differentiable in logps. The loss is the sum of the chunks' shares.
SequenceLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sequence_chunks(n_sequences: int, seq_len: int, paired: bool, sequences_per_chunk: int):
    """Row ranges of chunks of whole sequences. For ``paired`` the first half of the sequences
    are the chosen ones and the second half the rejected ones, and the chunk of pairs ``[a, b)``
    holds sequences ``a..b`` then ``B + a..B + b``."""
    n_groups = n_sequences // 2 if paired else n_sequences
    per_chunk = max(1, sequences_per_chunk // 2 if paired else sequences_per_chunk)
    chunks = []
    for first in range(0, n_groups, per_chunk):
        last = min(first + per_chunk, n_groups)
        sequence_ranges = [(first, last), (n_groups + first, n_groups + last)] if paired else [(first, last)]
        chunks.append([(start * seq_len, end * seq_len) for start, end in sequence_ranges])
    return chunks


def sequences_per_chunk_for(seq_len: int, n_classes: int, element_size: int, paired: bool,
                            chunk_memory_bytes: int | None) -> int:
    """Sequences whose logits fit in ``chunk_memory_bytes``; at least one pair (or sequence)."""
    budget = DEFAULT_CHUNK_MEMORY_BYTES if chunk_memory_bytes is None else int(chunk_memory_bytes)
    group = 2 if paired else 1
    return max(1, budget // (group * seq_len * n_classes * element_size)) * group


class _SequenceLogpsHead:
    """The part of a chunk head shared by the policy and the reference: the tokens' cross entropy
    (and, with ``compute_grad``, its gradient over the logits), summed per sequence."""

    def __init__(self, target: torch.Tensor, compute_grad: bool, ignore_index: int, max_rows: int):
        self.seq_len = target.shape[1]
        self.target_rows = target.reshape(-1, 1)
        self.compute_grad, self.ignore_index = compute_grad, ignore_index
        self.token_loss = torch.empty(max_rows, dtype=torch.float32, device=target.device)

    def __call__(self, ranges, logits) -> tuple[torch.Tensor, torch.Tensor]:
        """→ ``(sequence_ids [k], logps [k])`` of the chunk's sequences, in chunk order."""
        targets = gather_rows(self.target_rows, ranges).view(-1)
        token_loss = self.token_loss[: targets.numel()]
        launch_cross_entropy_fwd(
            logits, targets, logits if self.compute_grad else None, None, token_loss, None,
            self.ignore_index, 0.0, 0.0, None,
        )
        ids = torch.cat([
            torch.arange(start // self.seq_len, end // self.seq_len, device=logits.device) for start, end in ranges
        ])
        # In fp64: a sequence's log-prob sums thousands of token losses, and a preference loss's
        # derivative depends on differences of such sums, which fp32 rounding would blur.
        return ids, -token_loss.view(-1, self.seq_len).sum(1, dtype=torch.float64)


def sequence_logps(input, weight, target, bias, ignore_index, chunk_memory_bytes, dtype=torch.float32):
    """``[S]`` summed log-probabilities of ``target [S, T]`` under ``input [S, T, H] @ weightᵀ
    (+ bias)``, computed without gradient, in ``dtype``."""
    n_sequences, seq_len = target.shape
    per_chunk = sequences_per_chunk_for(seq_len, weight.shape[0], input.element_size(), False, chunk_memory_bytes)
    chunks = sequence_chunks(n_sequences, seq_len, False, per_chunk)
    logps_head = _SequenceLogpsHead(target, False, ignore_index, min(per_chunk, n_sequences) * seq_len)
    logps = torch.zeros(n_sequences, dtype=torch.float64, device=input.device)

    def head(ranges, logits):
        ids, chunk_logps = logps_head(ranges, logits)
        logps[ids] = chunk_logps

    fused_linear_chunks(as_rows(input), weight, bias, chunks, head)
    return logps.to(dtype)


class FusedLinearPreferenceFunction(torch.autograd.Function):
    """→ ``(loss, logps [S], ref_logps [S])``; the log-probabilities are not differentiable (they
    are returned for metrics). The reference tensors are constants: no gradient flows to them."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, ref_input, ref_weight, ref_bias, sequence_loss, paired,
                ignore_index, chunk_memory_bytes, needs):
        n_sequences, seq_len = target.shape
        check_targets(target.reshape(-1), weight.shape[0], ignore_index)
        if ref_input is None:
            ref_logps = torch.zeros(n_sequences, dtype=torch.float64, device=input.device)
        else:
            ref_logps = sequence_logps(ref_input, ref_weight, target, ref_bias, ignore_index, chunk_memory_bytes,
                                       torch.float64)

        x2d = as_rows(input)
        per_chunk = sequences_per_chunk_for(seq_len, weight.shape[0], input.element_size(), paired, chunk_memory_bytes)
        chunks = sequence_chunks(n_sequences, seq_len, paired, per_chunk)
        compute_grad = any(needs)
        grad_input, grad_weight, grad_bias = new_grads(x2d, weight, *needs)
        logps = torch.zeros(n_sequences, dtype=torch.float64, device=input.device)
        loss = torch.zeros((), dtype=torch.float64, device=input.device)
        logps_head = _SequenceLogpsHead(target, compute_grad, ignore_index, min(per_chunk, n_sequences) * seq_len)

        def preference_head(ranges, logits):
            ids, chunk_logps = logps_head(ranges, logits)
            logps[ids] = chunk_logps
            with torch.enable_grad():
                chunk_logps.requires_grad_(compute_grad)
                share = sequence_loss(ids, chunk_logps, ref_logps[ids])
            loss.add_(share.detach())
            if not compute_grad:
                return None
            grad_logps = torch.autograd.grad(share, chunk_logps, allow_unused=True)[0]
            if grad_logps is None:
                grad_logps = torch.zeros_like(chunk_logps)
            # The chain rule above: each row's dlogits (its cross-entropy gradient) times −dL/dlogp.
            return (-grad_logps).float().repeat_interleave(seq_len)

        fused_linear_chunks(x2d, weight, bias, chunks, preference_head,
                            grad_input, grad_weight, grad_bias)
        ctx.save_for_backward(grad_input, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype))
        ctx.needs, ctx.input_shape = needs, input.shape
        logps, ref_logps = logps.float(), ref_logps.float()
        ctx.mark_non_differentiable(logps, ref_logps)
        return loss.float(), logps, ref_logps

    @staticmethod
    def backward(ctx, grad_loss, grad_logps, grad_ref_logps):
        grad_input, grad_weight, grad_bias = scaled_grads(ctx.saved_tensors, ctx.needs, grad_loss, ctx.input_shape)
        return grad_input, grad_weight, None, grad_bias, None, None, None, None, None, None, None, None


def scaled_grads(grads, needs, grad_loss, input_shape):
    """``(grad_input, grad_weight, grad_bias)`` that a forward pass computed for ``grad_output = 1``,
    multiplied in place by the scalar ``grad_loss`` (so backward runs once per forward), ``None``
    where not ``needs``; ``grad_input`` viewed as ``input_shape``."""
    grad_output = grad_loss.reshape(1).float()
    scaled = []
    for grad, needed in zip(grads, needs):
        if needed and grad.numel() > 0:  # a vocabulary-parallel rank may hold no row of the head
            cross_entropy_bwd(grad.view(-1, grad.shape[-1]), grad_output)
        scaled.append(grad if needed else None)
    if scaled[0] is not None:
        scaled[0] = scaled[0].view(input_shape)
    return tuple(scaled)


def fused_linear_preference(input, weight, target, bias, ref_input, ref_weight, ref_bias, sequence_loss: SequenceLoss,
                            paired: bool, ignore_index: int, chunk_memory_bytes: int | None):
    """``input [S, T, H]``, ``weight [V, H]``, ``target [S, T]`` (and the optional reference) →
    ``(loss, logps [S], ref_logps [S])``, fp32; inputs validated by :mod:`tigon.losses`."""
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(t is not None and t.requires_grad and grad_enabled for t in (input, weight, bias))
    return FusedLinearPreferenceFunction.apply(
        input, weight, target, bias, ref_input, ref_weight, ref_bias, sequence_loss, paired, ignore_index,
        chunk_memory_bytes, needs,
    )
