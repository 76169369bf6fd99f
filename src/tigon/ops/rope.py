"""Rotary position embedding of queries and keys, Hugging Face convention, in one launch.

Forward, per head and position, on the first ``R = rotary_dim`` features of ``x`` (``q`` or ``k``)
split into halves ``x = [x_lo, x_hi]`` of ``R/2`` features each, with the tables split the same way::

    out_lo = x_lo · cos_lo − x_hi · sin_lo          (x · cos + rotate_half(x) · sin,
    out_hi = x_hi · cos_hi + x_lo · sin_hi           rotate_half([a, b]) = [−b, a])

Features past ``R`` are copied unchanged (partial rotary). Per feature pair ``(i, i + R/2)`` this is
``out = M · x`` with ``M = [[cos_lo, −sin_lo], [sin_hi, cos_hi]]``, so the backward is
``dx = Mᵀ · dout``: the same formula with ``(sin_lo, sin_hi)`` replaced by ``(−sin_hi, −sin_lo)``,
which one kernel does under a flag. For Hugging Face's tables (both halves equal) that is the
rotation by −θ, ``dout · cos + rotate_half_T(dout) · sin`` with ``rotate_half_T([a, b]) = [b, −a]``;
swapping the halves keeps the backward exact for any table. ``cos`` and ``sin`` get no gradient:
they are functions of position ids, not of anything trained.

Shapes: ``q [B, Hq, T, D]``, ``k [B, Hk, T, D]`` (fp32/bf16/fp16, any strides; the transposed views
of ``[B, T, H, D]`` projections are read in place), ``cos, sin [B or 1, T, R]`` or ``[T, R]`` of any
float dtype. One program owns a block of positions of one sequence and a slice of the concatenated
``q ‖ k`` head axis: it loads its cos/sin rows once and rotates every head of its slice with them.

Bytes per call (the roofline): forward reads q and k and writes q_rot and k_rot,
``2·B·T·(Hq + Hk)·D`` elements; the backward moves the same amount. The tables, ``2·B·T·R``
elements at most, are read once per slice of heads and mostly hit in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.ops._launch import num_programs_for, rows_per_block, tigon_op

# A program rotates at most this many heads with one load of its cos/sin rows; fewer when the
# grid would otherwise be too small to fill the GPU.
MAX_HEADS_PER_PROGRAM = 8


@triton.jit
def _rotate_heads(
    x, out, n_heads, stride_xh, stride_oh,
    cos_lo, cos_hi, sin_lo, sin_hi, half_cols, rotary_mask, pass_cols, pass_mask,
    HALF_ROTARY: tl.constexpr, PASS_DIM: tl.constexpr,
):
    """Rotates ``n_heads`` consecutive heads; ``x`` and ``out`` point at the first head's
    ``[BLOCK_T, 1]`` rows and advance one head stride per step (pointer arithmetic is 64-bit)."""
    for _ in range(n_heads):
        x_lo = tl.load(x + half_cols, mask=rotary_mask, other=0.0).to(tl.float32)
        x_hi = tl.load(x + HALF_ROTARY + half_cols, mask=rotary_mask, other=0.0).to(tl.float32)
        out_lo = x_lo * cos_lo - x_hi * sin_lo
        out_hi = x_hi * cos_hi + x_lo * sin_hi
        tl.store(out + half_cols, out_lo.to(out.dtype.element_ty), mask=rotary_mask)
        tl.store(out + HALF_ROTARY + half_cols, out_hi.to(out.dtype.element_ty), mask=rotary_mask)
        if PASS_DIM > 0:
            passed = tl.load(x + 2 * HALF_ROTARY + pass_cols, mask=pass_mask)
            tl.store(out + 2 * HALF_ROTARY + pass_cols, passed, mask=pass_mask)
        x += stride_xh
        out += stride_oh


@triton.jit
def rope_kernel(
    Q, K, COS, SIN, Q_OUT, K_OUT,
    seq_len, q_heads, n_heads, heads_per_program,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_qob, stride_qoh, stride_qot,
    stride_kob, stride_koh, stride_kot,
    stride_cos_b, stride_cos_t, stride_sin_b, stride_sin_t,
    HALF_ROTARY: tl.constexpr, PASS_DIM: tl.constexpr, TRANSPOSED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    # Grid: (position block, sequence, slice of the q ‖ k head axis). Every feature stride is 1.
    batch = tl.program_id(1).to(tl.int64)
    positions = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = positions[:, None] < seq_len
    rows = positions.to(tl.int64)[:, None]
    half_cols = tl.arange(0, BLOCK_HALF)[None, :]
    rotary_mask = row_mask & (half_cols < HALF_ROTARY)
    pass_cols = tl.arange(0, BLOCK_PASS)[None, :]
    pass_mask = row_mask & (pass_cols < PASS_DIM)

    cos = COS + batch * stride_cos_b + rows * stride_cos_t + half_cols
    sin = SIN + batch * stride_sin_b + rows * stride_sin_t + half_cols
    cos_lo = tl.load(cos, mask=rotary_mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos + HALF_ROTARY, mask=rotary_mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin, mask=rotary_mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin + HALF_ROTARY, mask=rotary_mask, other=0.0).to(tl.float32)
    if TRANSPOSED:
        # Mᵀ = [[cos_lo, sin_hi], [−sin_lo, cos_hi]]: the forward's formula with the sine halves
        # swapped and negated (see the module docstring).
        sin_lo, sin_hi = -sin_hi, -sin_lo

    # This program's heads [first_head, end_head) of q ‖ k: the part below q_heads is q's, the
    # rest k's (a part may be empty: a count ≤ 0 runs no step).
    first_head = tl.program_id(2) * heads_per_program
    end_head = tl.minimum(first_head + heads_per_program, n_heads)
    first_k_head = tl.maximum(first_head - q_heads, 0)
    _rotate_heads(
        Q + batch * stride_qb + first_head.to(tl.int64) * stride_qh + rows * stride_qt,
        Q_OUT + batch * stride_qob + first_head.to(tl.int64) * stride_qoh + rows * stride_qot,
        tl.minimum(end_head, q_heads) - first_head, stride_qh, stride_qoh,
        cos_lo, cos_hi, sin_lo, sin_hi, half_cols, rotary_mask, pass_cols, pass_mask,
        HALF_ROTARY, PASS_DIM,
    )
    _rotate_heads(
        K + batch * stride_kb + first_k_head.to(tl.int64) * stride_kh + rows * stride_kt,
        K_OUT + batch * stride_kob + first_k_head.to(tl.int64) * stride_koh + rows * stride_kot,
        tl.maximum(end_head - q_heads, 0) - first_k_head, stride_kh, stride_koh,
        cos_lo, cos_hi, sin_lo, sin_hi, half_cols, rotary_mask, pass_cols, pass_mask,
        HALF_ROTARY, PASS_DIM,
    )


def _rotated_like(x: torch.Tensor) -> torch.Tensor:
    """The output for ``x``: dense, in ``x``'s order of dimensions (``torch.empty_like``: a transposed
    ``[B, T, H, D]`` projection's output stays transposed, so the caller's next view is free), or
    contiguous where that order would not give unit feature stride. Shared by the launcher and the
    fake so that both give the same strides."""
    out = torch.empty_like(x)
    return out if out.stride(-1) == 1 else torch.empty_like(x, memory_format=torch.contiguous_format)


def _unit_feature_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _table_strides(table: torch.Tensor) -> tuple[int, int]:
    """(batch stride, position stride) of a ``[B or 1, T, R]`` or ``[T, R]`` table; a table shared
    by every sequence has batch stride 0."""
    if table.dim() == 2 or table.shape[0] == 1:
        return 0, table.stride(-2)
    return table.stride(0), table.stride(1)


def _rotate_fake(q, k, cos, sin, rotary_dim, transposed):
    return _rotated_like(q), _rotated_like(k)


@tigon_op("rope_rotate", fake=_rotate_fake)
def rope_rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, T, D]``, ``k [B, Hk, T, D]`` → rotated ``(q_rot, k_rot)`` in the input dtype.

    ``transposed=False`` is the forward; ``transposed=True`` applies the transposed rotation, which
    maps the gradients of ``(q_rot, k_rot)`` to those of ``(q, k)``.
    """
    q_out, k_out = _rotated_like(q), _rotated_like(k)
    if q.numel() == 0:  # no sequence or no position: nothing to rotate, and no grid to launch
        return q_out, k_out
    q, k = _unit_feature_stride(q), _unit_feature_stride(k)
    cos, sin = _unit_feature_stride(cos), _unit_feature_stride(sin)
    batch, q_heads, seq_len, head_dim = q.shape
    n_heads = q_heads + k.shape[1]

    half_rotary, pass_dim = rotary_dim // 2, head_dim - rotary_dim
    block_t = min(triton.next_power_of_2(seq_len), rows_per_block(head_dim, min_elements=2048, max_rows=64))
    position_blocks = triton.cdiv(seq_len, block_t)
    # Share each cos/sin load across up to MAX_HEADS_PER_PROGRAM heads, unless that leaves fewer
    # programs than the GPU holds at once: a short grid runs one partial wave and idles the rest.
    heads_per_program = max(
        1, min(MAX_HEADS_PER_PROGRAM, batch * position_blocks * n_heads // num_programs_for(q.device, 8))
    )
    grid = (position_blocks, batch, triton.cdiv(n_heads, heads_per_program))
    rope_kernel[grid](
        q, k, cos, sin, q_out, k_out,
        seq_len, q_heads, n_heads, heads_per_program,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        *_table_strides(cos), *_table_strides(sin),
        HALF_ROTARY=half_rotary, PASS_DIM=pass_dim, TRANSPOSED=transposed,
        BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(half_rotary),
        BLOCK_PASS=triton.next_power_of_2(max(pass_dim, 1)),
        num_warps=max(1, min(4, block_t * triton.next_power_of_2(head_dim) // 512)),
    )
    return q_out, k_out


class RoPEFunction(torch.autograd.Function):
    """Saves only ``cos`` and ``sin``: the rotation is linear, so the backward needs neither ``q``
    nor ``k``, only the transposed rotation of the incoming gradients. ``cos`` and ``sin`` get no
    gradient (they are computed from position ids)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, rotary_dim):
        ctx.save_for_backward(cos, sin)
        ctx.rotary_dim = rotary_dim
        return rope_rotate(q, k, cos, sin, rotary_dim, False)

    @staticmethod
    def backward(ctx, dq_rot, dk_rot):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_rotate(dq_rot, dk_rot, cos, sin, ctx.rotary_dim, True)
        return dq, dk, None, None, None


def rope(q, k, cos, sin, rotary_dim):
    """``(q_rot, k_rot)`` with the shapes and dtypes of ``q`` and ``k``; inputs validated by
    :mod:`tigon.functional`."""
    return RoPEFunction.apply(q, k, cos, sin, rotary_dim)
