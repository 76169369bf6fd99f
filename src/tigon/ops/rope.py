"""Rotary position embedding of queries and keys, every Hugging Face variant, in one launch.

Each of the ``P = R/2`` feature pairs of the rotated slice (``R = rotary_dim`` features, the first
ones or, with ``rotary_last``, the last ones) turns by its own angle::

    out_a = x_a · cos_a − x_b · sin_a           i.e.  out = M · x,  M = [[cos_a, −sin_a],
    out_b = x_b · cos_b + x_a · sin_b                                  [sin_b,  cos_b]]

Which features form pair ``j``, where its outputs go and which table entries it reads are
switches (``tl.constexpr``, so each combination compiles to its own straight-line kernel and the
default one is exactly the plain kernel):

- pairs: half-split ``(x[j], x[j + P])`` (Hugging Face's ``rotate_half``) or ``interleaved``
  ``(x[2j], x[2j + 1])`` (the complex forms: Llama 4, DeepSeek V2/V3/V4);
- output layout: the input's, or, for interleaved pairs, half-split (``deinterleave_output``:
  DeepSeek V3's ``cat([x_even·cos − x_odd·sin, x_odd·cos + x_even·sin])``);
- tables: full width ``R``, indexed by the output feature the entry multiplies (half-split:
  ``(j, j + P)``, interleaved: ``(2j, 2j + 1)``), or half width ``R/2``, one angle per pair read by
  both members (GPT-OSS, the complex forms' ``freqs_cis``);
- M-RoPE (Qwen2-VL, Qwen3-VL): the tables hold three planes ``[3, B, T, W]`` (time, height, width
  positions) and pair ``j`` reads the plane its frequency belongs to: sectioned, ``j`` in the first
  ``t`` pairs → plane 0, the next ``h`` → 1, the last ``w`` → 2; interleaved (Qwen3-VL), plane 1
  where ``j % 3 == 1 and j < 3h``, plane 2 where ``j % 3 == 2 and j < 3w``, else plane 0. Nothing
  combined is built: each program reads each pair's entry from its plane directly.

Features outside the rotated slice are copied unchanged (partial rotary).

Backward. For the heads: ``dx = Mᵀ · dout``, with ``Mᵀ = [[cos_a, sin_b], [−sin_a, cos_b]]``, the
forward's formula with ``(sin_a, sin_b)`` replaced by ``(−sin_b, −sin_a)`` and input and output
layouts swapped (``dout`` is read in the output's layout, ``dx`` written in the input's): the same
kernel under a flag, exact for any table. For the tables (only when they require grad; they are
usually functions of position ids): ``dcos_a = Σ dout_a·x_a``, ``dsin_a = −Σ dout_a·x_b``,
``dcos_b = Σ dout_b·x_b``, ``dsin_b = Σ dout_b·x_a``, summed over the heads of q and k and over the
batch where a table is shared; a half-width entry collects both members' terms, an M-RoPE plane
only its own pairs'. That reduction runs in PyTorch (fp32) and needs q and k, which are then saved.

Shapes: ``q [B, Hq, T, D]``, ``k [B, Hk, T, D]`` or none (fp32/bf16/fp16, any strides; the
transposed views of ``[B, T, H, D]`` projections are read in place), ``cos, sin [B or 1, T, W]``,
``[T, W]`` or, for M-RoPE, ``[3, B or 1, T, W]``, with ``W = R`` or ``R/2``, any float dtype. One
program owns a block of positions of one sequence and a slice of the concatenated ``q ‖ k`` head
axis: it loads its cos/sin rows once and rotates every head of its slice with them.

Bytes per call (the roofline): forward reads q and k and writes q_rot and k_rot,
``2·B·T·(Hq + Hk)·D`` elements; the backward moves the same amount. The tables, ``2·B·T·W``
elements (three times that for M-RoPE), are read once per slice of heads and mostly hit in L2.
Interleaved pairs are moved as the plain ones are: a side in that layout is read (or written) as
each row's whole rotated slice, one contiguous block, and split into its pairs (or joined back)
in registers, so the heads' accesses are vectorised and the head loop exchanges nothing
through shared memory.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tigon.ops._launch import cdiv, launch, next_power_of_2, num_programs_for, rows_per_block, tigon_op

# A program rotates at most this many heads with one load of its cos/sin rows; fewer when the
# grid would otherwise be too small to fill the GPU.
MAX_HEADS_PER_PROGRAM = 8

# How an M-RoPE table's planes are assigned to pairs (the kernel's MROPE switch).
MROPE_NONE, MROPE_SECTIONED, MROPE_INTERLEAVED = 0, 1, 2


class RotaryVariant(NamedTuple):
    """Which rotation: validated by :func:`tigon.functional.rope`, whose docstring explains each
    option. ``mrope_section`` is ``None`` without M-RoPE."""

    rotary_dim: int
    rotary_last: bool = False
    interleaved: bool = False
    deinterleave_output: bool = False
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = False


@triton.jit
def _load_pairs(pointer, mask):
    """Loads ``[BLOCK_T, 2·BLOCK_HALF]`` features as one contiguous block (vectorised loads) and
    splits it in registers into the members ``(f[2j], f[2j + 1])`` of each pair, as fp32."""
    features = tl.load(pointer, mask=mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(features, (features.shape[0], features.shape[1] // 2, 2)))


@triton.jit
def _store_pairs(pointer, value_a, value_b, mask):
    """Stores the members of each pair interleaved, ``f[2j] = value_a[j]``, ``f[2j + 1] = value_b[j]``:
    joined in registers into one contiguous block."""
    features = tl.join(value_a, value_b)
    features = tl.reshape(features, (features.shape[0], features.shape[1] * 2))
    tl.store(pointer, features.to(pointer.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    x, out, n_heads, stride_xh, stride_oh,
    cos_a, cos_b, sin_a, sin_b, member_a, member_b, rotary_mask, features, features_mask, pass_cols, pass_mask,
    READ_INTERLEAVED: tl.constexpr, WRITE_INTERLEAVED: tl.constexpr, PASS_DIM: tl.constexpr,
):
    """Rotates ``n_heads`` consecutive heads; ``x`` and ``out`` point at the first head's
    ``[BLOCK_T, 1]`` rows and advance one head stride per step (pointer arithmetic is 64-bit).
    A half-split side holds pair ``j``'s members at the offsets ``member_a``, ``member_b``
    (``[1, BLOCK_HALF]``, two contiguous accesses); an interleaved side is accessed as the whole
    rotated slice, ``features`` (``[1, 2·BLOCK_HALF]``), and (de)interleaved in registers."""
    for _ in range(n_heads):
        if READ_INTERLEAVED:
            x_a, x_b = _load_pairs(x + features, features_mask)
        else:
            x_a = tl.load(x + member_a, mask=rotary_mask, other=0.0).to(tl.float32)
            x_b = tl.load(x + member_b, mask=rotary_mask, other=0.0).to(tl.float32)
        out_a = x_a * cos_a - x_b * sin_a
        out_b = x_b * cos_b + x_a * sin_b
        if WRITE_INTERLEAVED:
            _store_pairs(out + features, out_a, out_b, features_mask)
        else:
            tl.store(out + member_a, out_a.to(out.dtype.element_ty), mask=rotary_mask)
            tl.store(out + member_b, out_b.to(out.dtype.element_ty), mask=rotary_mask)
        if PASS_DIM > 0:
            passed = tl.load(x + pass_cols, mask=pass_mask)
            tl.store(out + pass_cols, passed, mask=pass_mask)
        x += stride_xh
        out += stride_oh


@triton.jit
def _in_planes(table, pair, stride_plane, mrope_bound_1, mrope_bound_2, MROPE: tl.constexpr):
    """``table`` (pointing at this program's rows) moved to the M-RoPE plane of each pair in ``pair``."""
    if MROPE == 1:  # sectioned: [0, t) → plane 0, [t, t + h) → 1, the rest → 2
        plane = (pair >= mrope_bound_1).to(tl.int64) + (pair >= mrope_bound_2).to(tl.int64)
        table += plane * stride_plane
    elif MROPE == 2:  # interleaved: j % 3 == 1 below 3h → plane 1, j % 3 == 2 below 3w → 2, else 0
        phase = pair % 3
        plane = tl.where(
            (phase == 1) & (pair < mrope_bound_1), 1, tl.where((phase == 2) & (pair < mrope_bound_2), 2, 0)
        )
        table += plane.to(tl.int64) * stride_plane
    return table


@triton.jit
def _load_table(table, entry_a, entry_b, mask, HALF_TABLE: tl.constexpr):
    """The entries of ``table`` (pointing at this program's rows, plane included) multiplying
    each pair's two outputs, as fp32: a half-width table's one entry per pair is loaded once."""
    value_a = tl.load(table + entry_a, mask=mask, other=0.0).to(tl.float32)
    if HALF_TABLE:
        value_b = value_a
    else:
        value_b = tl.load(table + entry_b, mask=mask, other=0.0).to(tl.float32)
    return value_a, value_b


@triton.jit
def rope_kernel(
    Q, K, COS, SIN, Q_OUT, K_OUT,
    seq_len, q_heads, n_heads, heads_per_program, mrope_bound_1, mrope_bound_2,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_qob, stride_qoh, stride_qot,
    stride_kob, stride_koh, stride_kot,
    stride_cos_plane, stride_cos_b, stride_cos_t, stride_sin_plane, stride_sin_b, stride_sin_t,
    HALF_ROTARY: tl.constexpr, PASS_DIM: tl.constexpr, ROTARY_START: tl.constexpr, PASS_START: tl.constexpr,
    PAIRS_INTERLEAVED: tl.constexpr, OUT_INTERLEAVED: tl.constexpr, HALF_TABLE: tl.constexpr,
    MROPE: tl.constexpr, TRANSPOSED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    # Grid: (position block, sequence, slice of the q ‖ k head axis). Every feature stride is 1.
    batch = tl.program_id(1).to(tl.int64)
    positions = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = positions[:, None] < seq_len
    rows = positions.to(tl.int64)[:, None]
    pair = tl.arange(0, BLOCK_HALF)[None, :]
    rotary_mask = row_mask & (pair < HALF_ROTARY)
    pass_cols = PASS_START + tl.arange(0, BLOCK_PASS)[None, :]
    pass_mask = row_mask & (tl.arange(0, BLOCK_PASS)[None, :] < PASS_DIM)
    # Offsets within the rotated slice. A half-split side holds pair j's members at (j, j + P).
    # Interleaved pairs (x[2j], x[2j + 1]) are not read as two stride-2 gathers (scalar accesses,
    # and a layout conversion through shared memory): a side in that layout is read and written
    # as its whole slice, one contiguous block, split into pairs or joined back in registers.
    half_a, half_b = pair, pair + HALF_ROTARY
    feature = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    features_mask = row_mask & (feature < 2 * HALF_ROTARY)

    # A full-width table is indexed like the forward's output, a half-width one by pair.
    cos = COS + batch * stride_cos_b + rows * stride_cos_t
    sin = SIN + batch * stride_sin_b + rows * stride_sin_t
    if OUT_INTERLEAVED and not HALF_TABLE:
        # Entries (2j, 2j + 1): the rows' whole slice, each entry in its pair's plane.
        cos_a, cos_b = _load_pairs(
            _in_planes(cos, feature // 2, stride_cos_plane, mrope_bound_1, mrope_bound_2, MROPE) + feature,
            features_mask,
        )
        sin_a, sin_b = _load_pairs(
            _in_planes(sin, feature // 2, stride_sin_plane, mrope_bound_1, mrope_bound_2, MROPE) + feature,
            features_mask,
        )
    else:  # entries (j, j + P), or j for a half-width table
        cos = _in_planes(cos, pair, stride_cos_plane, mrope_bound_1, mrope_bound_2, MROPE)
        sin = _in_planes(sin, pair, stride_sin_plane, mrope_bound_1, mrope_bound_2, MROPE)
        cos_a, cos_b = _load_table(cos, half_a, half_b, rotary_mask, HALF_TABLE)
        sin_a, sin_b = _load_table(sin, half_a, half_b, rotary_mask, HALF_TABLE)
    if TRANSPOSED:
        # Mᵀ = [[cos_a, sin_b], [−sin_a, cos_b]]: the forward's formula with the sines swapped and
        # negated, reading the incoming gradient in the output's layout and writing the input's.
        sin_a, sin_b = -sin_b, -sin_a
        read_interleaved, write_interleaved = OUT_INTERLEAVED, PAIRS_INTERLEAVED
    else:
        read_interleaved, write_interleaved = PAIRS_INTERLEAVED, OUT_INTERLEAVED
    # The rotated slice starts at feature 0, or at D − R with rotary_last.
    member_a, member_b, features = ROTARY_START + half_a, ROTARY_START + half_b, ROTARY_START + feature

    # This program's heads [first_head, end_head) of q ‖ k: the part below q_heads is q's, the
    # rest k's (a part may be empty: a count ≤ 0 runs no step).
    first_head = tl.program_id(2) * heads_per_program
    end_head = tl.minimum(first_head + heads_per_program, n_heads)
    first_k_head = tl.maximum(first_head - q_heads, 0)
    _rotate_heads(
        Q + batch * stride_qb + first_head.to(tl.int64) * stride_qh + rows * stride_qt,
        Q_OUT + batch * stride_qob + first_head.to(tl.int64) * stride_qoh + rows * stride_qot,
        tl.minimum(end_head, q_heads) - first_head, stride_qh, stride_qoh,
        cos_a, cos_b, sin_a, sin_b, member_a, member_b, rotary_mask, features, features_mask, pass_cols, pass_mask,
        read_interleaved, write_interleaved, PASS_DIM,
    )
    _rotate_heads(
        K + batch * stride_kb + first_k_head.to(tl.int64) * stride_kh + rows * stride_kt,
        K_OUT + batch * stride_kob + first_k_head.to(tl.int64) * stride_koh + rows * stride_kot,
        tl.maximum(end_head - q_heads, 0) - first_k_head, stride_kh, stride_koh,
        cos_a, cos_b, sin_a, sin_b, member_a, member_b, rotary_mask, features, features_mask, pass_cols, pass_mask,
        read_interleaved, write_interleaved, PASS_DIM,
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


def _table_strides(table: torch.Tensor) -> tuple[int, int, int]:
    """(plane stride, batch stride, position stride) of a ``[B or 1, T, W]``, ``[T, W]`` or M-RoPE
    ``[3, B or 1, T, W]`` table; a table shared by every sequence has batch stride 0."""
    plane = table.stride(0) if table.dim() == 4 else 0
    shared = table.dim() == 2 or table.shape[-3] == 1
    return plane, 0 if shared else table.stride(-3), table.stride(-2)


def _mrope_bounds(mrope_section, mrope_interleaved: bool) -> tuple[int, int, int]:
    """(MROPE switch, bound 1, bound 2): the pair indices where the planes change."""
    if mrope_section is None:
        return MROPE_NONE, 0, 0
    t, h, w = mrope_section
    if mrope_interleaved:
        return MROPE_INTERLEAVED, 3 * h, 3 * w
    return MROPE_SECTIONED, t, t + h


@functools.lru_cache(maxsize=4096)
def _geometry(batch, n_heads, seq_len, head_dim, half_rotary, interleaved, element_size, device):
    """``(grid, heads per program, BLOCK_T, BLOCK_HALF, num_warps)`` of :func:`rope_rotate`."""
    block_t = min(next_power_of_2(seq_len), rows_per_block(head_dim, min_elements=2048, max_rows=64))
    position_blocks = cdiv(seq_len, block_t)
    # Share each cos/sin load across up to MAX_HEADS_PER_PROGRAM heads, unless that leaves fewer
    # programs than the GPU holds at once: a short grid runs one partial wave and idles the rest.
    heads_per_program = max(
        1, min(MAX_HEADS_PER_PROGRAM, batch * position_blocks * n_heads // num_programs_for(device, 8))
    )
    grid = (position_blocks, batch, cdiv(n_heads, heads_per_program))
    block_half = next_power_of_2(half_rotary)
    if interleaved:
        # A thread splits each 16-byte vector it loads of an interleaved slice into half as many
        # pairs. With at most 8 bytes of a [block_t, block_half] half per thread, those are the
        # very pairs it reads or writes on the half-split side and in the tables: no value has to
        # cross threads (Triton would exchange them through shared memory in the loop).
        num_warps = max(1, min(16, block_t * block_half * element_size // 256))
    else:
        num_warps = max(1, min(4, block_t * next_power_of_2(head_dim) // 512))
    return grid, heads_per_program, block_t, block_half, num_warps


def _rotate_fake(q, k, cos, sin, transposed, rotary_dim, *options):
    return _rotated_like(q), _rotated_like(k)


@tigon_op("rope_rotate", fake=_rotate_fake)
def rope_rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transposed: bool,
    rotary_dim: int, rotary_last: bool = False, interleaved: bool = False, deinterleave_output: bool = False,
    mrope_section: list[int] | None = None, mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, T, D]``, ``k [B, Hk, T, D]`` (``Hk`` may be 0) → rotated ``(q_rot, k_rot)`` in the
    input dtype; the options after ``transposed`` are the fields of :class:`RotaryVariant`.

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
    mrope, mrope_bound_1, mrope_bound_2 = _mrope_bounds(mrope_section, mrope_interleaved)
    grid, heads_per_program, block_t, block_half, num_warps = _geometry(
        batch, n_heads, seq_len, head_dim, half_rotary, interleaved, q.element_size(), q.device,
    )
    launch(
        rope_kernel, grid,
        q, k, cos, sin, q_out, k_out,
        seq_len, q_heads, n_heads, heads_per_program, mrope_bound_1, mrope_bound_2,
        *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3],
        *_table_strides(cos), *_table_strides(sin),
        HALF_ROTARY=half_rotary, PASS_DIM=pass_dim,
        ROTARY_START=pass_dim if rotary_last else 0, PASS_START=0 if rotary_last else rotary_dim,
        PAIRS_INTERLEAVED=interleaved, OUT_INTERLEAVED=interleaved and not deinterleave_output,
        HALF_TABLE=cos.shape[-1] == half_rotary, MROPE=mrope, TRANSPOSED=transposed,
        BLOCK_T=block_t, BLOCK_HALF=block_half, BLOCK_PASS=next_power_of_2(max(pass_dim, 1)),
        num_warps=num_warps,
    )
    return q_out, k_out


def _pair_members(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the two members of every pair of a rotated slice ``[..., R]``: ``[..., R/2]`` each."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _pair_planes(variant: RotaryVariant, device: torch.device) -> torch.Tensor:
    """The M-RoPE plane of every pair ``[R/2]``, as the kernel picks it."""
    mrope, bound_1, bound_2 = _mrope_bounds(variant.mrope_section, variant.mrope_interleaved)
    pair = torch.arange(variant.rotary_dim // 2, device=device)
    if mrope == MROPE_SECTIONED:
        return (pair >= bound_1).long() + (pair >= bound_2).long()
    phase = pair % 3
    return torch.where((phase == 1) & (pair < bound_1), 1, torch.where((phase == 2) & (pair < bound_2), 2, 0))


def _table_grads(heads, cos, sin, variant: RotaryVariant):
    """``(dcos, dsin)`` in the tables' shapes and dtypes from ``heads``, pairs ``(x, dout)`` of the
    inputs and their outputs' gradients (see the module docstring for the formulas)."""
    rotary_dim = variant.rotary_dim
    out_interleaved = variant.interleaved and not variant.deinterleave_output
    # Per pair and output member, over the heads: dout_a·x_a, dout_b·x_b (cos), −dout_a·x_b, dout_b·x_a (sin).
    dcos_a = dcos_b = dsin_a = dsin_b = 0.0
    for x, dout in heads:
        start = x.shape[-1] - rotary_dim if variant.rotary_last else 0
        x_a, x_b = (m.float() for m in _pair_members(x[..., start:start + rotary_dim], variant.interleaved))
        dout_a, dout_b = (m.float() for m in _pair_members(dout[..., start:start + rotary_dim], out_interleaved))
        dcos_a = dcos_a + (dout_a * x_a).sum(1)
        dcos_b = dcos_b + (dout_b * x_b).sum(1)
        dsin_a = dsin_a - (dout_a * x_b).sum(1)
        dsin_b = dsin_b + (dout_b * x_a).sum(1)

    half_table = cos.shape[-1] == rotary_dim // 2
    planes = _pair_planes(variant, cos.device) if variant.mrope_section is not None else None

    def to_table(grad_a, grad_b, table):
        if half_table:  # one entry per pair, read by both members
            grad, entry_planes = grad_a + grad_b, planes
        elif out_interleaved:  # entries (2j, 2j + 1)
            grad = torch.stack((grad_a, grad_b), dim=-1).flatten(-2)
            entry_planes = None if planes is None else planes.repeat_interleave(2)
        else:  # entries (j, j + R/2)
            grad = torch.cat((grad_a, grad_b), dim=-1)
            entry_planes = None if planes is None else torch.cat((planes, planes))
        if entry_planes is not None:  # each entry's gradient lands in its own plane only
            grad = torch.stack([grad * (entry_planes == plane) for plane in range(3)])
        return grad.sum_to_size(table.shape).to(table.dtype)

    return to_table(dcos_a, dcos_b, cos), to_table(dsin_a, dsin_b, sin)


class RoPEFunction(torch.autograd.Function):
    """Saves ``cos`` and ``sin``, and ``q`` and ``k`` only when a table requires grad: the rotation
    is linear, so the heads' backward is the transposed rotation of the incoming gradients alone.
    ``k`` may be ``None`` (one tensor rotated); its output is then ``None``."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, variant: RotaryVariant):
        tables_need_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        ctx.save_for_backward(cos, sin, *((q, k) if tables_need_grad else (None, None)))
        ctx.variant, ctx.has_k = variant, k is not None
        q_rot, k_rot = rope_rotate(q, q[:, :0] if k is None else k, cos, sin, False, *variant)
        return q_rot, k_rot if k is not None else None

    @staticmethod
    def backward(ctx, dq_rot, dk_rot):
        cos, sin, q, k = ctx.saved_tensors
        variant = ctx.variant
        if not ctx.has_k:
            dk_rot = dq_rot[:, :0]
        dq = dk = dcos = dsin = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dq, dk = rope_rotate(dq_rot, dk_rot, cos, sin, True, *variant)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            heads = [(q, dq_rot)] + ([(k, dk_rot)] if ctx.has_k else [])
            dcos, dsin = _table_grads(heads, cos, sin, variant)
        return dq, dk if ctx.has_k else None, dcos, dsin, None


def rope(q, k, cos, sin, variant: RotaryVariant):
    """``(q_rot, k_rot)`` with the shapes and dtypes of ``q`` and ``k`` (``k_rot`` is ``None`` when
    ``k`` is); inputs validated by :mod:`tigon.functional`."""
    return RoPEFunction.apply(q, k, cos, sin, variant)
