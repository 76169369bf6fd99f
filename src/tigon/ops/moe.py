"""Mixture-of-experts experts: every token through its top-k experts' gated MLPs, weighted and summed.

With ``x [T, H]``, each token ``t`` routed to ``k`` experts ``e_tj`` with weights ``w_tj``, and
expert ``e``'s ``W1_e`` (``gate_up_proj``, ``2I`` outputs) and ``W2_e`` (``down_proj``)::

    gate, up = split(x_t W1_eᵀ + b1_e)          one row r per (t, j): S = T·k rows
    h_r      = act(gate) · up                   [S, I]
    y_t      = Σ_j w_tj · (h_r W2_eᵀ + b2_e)    [T, H]

computed as ``y_t = Σ_j (wh_r W2_eᵀ + w_r b2_e)`` with the weighted ``wh_r = w_r h_r``, so that the
down projection's weight gradient needs no weighting in its inner loop.

Rows are sorted by expert once (the routing metadata, no host sync: ``row_token``, per-expert
``expert_end`` and a tile schedule), and four Triton kernels do the work; none materialises a
gathered copy of ``x`` or ``dy`` (``[S, H]``):

- ``moe_gate_up_kernel``: the grouped GEMM ``gate_up = x[row_token] W1ᵀ``, gathering its rows
  straight from ``x``, with the gate and the routing weight in its epilogue; it writes ``wh [S, I]``
  and the pre-activations ``gate_up [S, 2I]`` (kept for backward: recomputing them would cost 2/9
  of the step's FLOPs).
- ``moe_scatter_kernel``: ``wh W2ᵀ`` plus the weighted bias, stored at the row's (t, j) and summed
  over j by one deterministic reduction. The backward's ``dx_t = Σ_j d_gate_up_r W1_e`` is the same
  kernel adding into the token's fp32 row (atomics: an ``[S, H]`` buffer would cost 0.5 GiB at
  Qwen3-30B-A3B's shapes).
- ``moe_down_bwd_kernel``: ``g = dy[row_token] W2_e`` with the gate's backward in its epilogue::

      dh_r     = w_r · g_r
      d_gate_r = dh_r · up · act'(gate),   d_up_r = dh_r · act(gate)     (over gate_up, in place)
      dw_r     = g_r · h_r (+ dy_t · b2_e)  since y_t's term is w_r · (h_r W2ᵀ + b2)

  ``h`` is recomputed there from ``gate_up``; ``dw`` is summed from per-column-block partials.
- ``moe_weight_grad_kernel``: per expert, ``dW = Σ_r aᵣᵀ bᵣ`` over the expert's rows: ``dW2 =
  Σ dy_tᵀ wh_r`` and ``dW1 = Σ d_gate_upᵣᵀ x_t``, gathering ``dy`` and ``x`` by token.

LoRA adapters per expert (PEFT's ``target_parameters`` on the stacked weights), on either
projection: ``W_e + s·B_e A_e`` with ``A [E, r, in]``, ``B [E, out, r]``, never formed. For a
projection of rows ``a`` (``x`` gathered by token, or ``wh``)::

    t_r = s · a_r A_eᵀ                       [S, r], moe_low_rank_kernel, kept for backward
    out_r = t_r B_eᵀ + a_r W_eᵀ              t·Bᵀ starts the accumulator of the kernel above
    u_r = s · g_r B_e                        g: the gradient of out_r (dy_t, or d_gate_up_r)
    da_r += u_r A_e                          in moe_down_bwd_kernel / the dx scatter, likewise
    dA_e = Σ_r u_rᵀ a_r,   dB_e = Σ_r g_rᵀ t_r     moe_weight_grad_kernel, rank-sized tiles

The factors are laid out ``[E, r, ·]`` in memory first (PEFT's ``lora_B`` holds expert ``e`` in
every ``E``-th column), and their rank is padded to the tensor cores' 16.

Layouts, as transformers 5 stores experts (``use_experts_implementation``): ``gate_up_proj [E, 2I,
H]`` and ``down_proj [E, H, I]``, or transposed (``[E, H, 2I]``, ``[E, I, H]``, GPT-OSS), with the
``2I`` columns concatenated ``[gate | up]`` or interleaved ``[g0, u0, g1, u1, …]`` (GPT-OSS); all
are read in place through strides, and ``gate_up [S, 2I]`` keeps the weight's column order. The
gates: ``swiglu`` (SiLU), ``geglu`` (tanh GELU) and GPT-OSS's clamped SwiGLU.

Dropped slots: an id equal to ``E`` routes its slot to no expert here. Expert parallelism hands
each rank the routing of every token with the slots of other ranks' experts set to ``E`` (and
their weights to 0: transformers' ``EpRouterParallel``); they sort past the last expert, so no
tile reaches them and they cost no FLOPs: their rows of the ``[S, H]`` buffer are zeroed
(``moe_drop_rows_kernel``, whose programs over kept rows return at once), their weights' gradient
is 0 and they add nothing to ``dx``, the weights' or the biases' gradients.

Dtypes: ``x`` and the weights share one float dtype; products accumulate in fp32 (IEEE fp32
products for fp32 inputs, not TF32); the routing weights may be of any float dtype and their
gradient is returned in it. A token's ``k`` rows, and ``dx``, are summed in fp32 and rounded
once. FLOPs per call (the roofline): ``6·S·H·I`` forward and ``12·S·H·I`` backward; measured
rates and what limits each kernel: docs/perf-notes/moe.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.ops._launch import empty_tensor, interpreting, tigon_op
from tigon.ops.gated import clamp_passes_at_limit, gate_activation, swiglu_clamped_grads, swiglu_clamped_math

GATES = ("swiglu", "geglu", "swiglu_clamped")
_ACTIVATION = {"swiglu": "silu", "geglu": "gelu_tanh", "swiglu_clamped": "clamped"}
# Triton 3.6's interpreter misreads bf16 operands of tl.dot; there they are widened to fp32 first
# (exactly: bf16 products are exact in fp32, as on the GPU's tensor cores).
_WIDEN_BF16_DOT = tl.constexpr(interpreting())


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    if _WIDEN_BF16_DOT and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


# Tiles are visited GROUP at a time along M (M fastest within a group): a group's A tiles and the
# B tiles it walks through stay in L2. Without it, an expert as wide as Mixtral's (a 235 MB
# gate_up_proj) would stream its weights from HBM once per M tile.
GROUP = tl.constexpr(8)


@triton.jit
def _grouped(pid, n_m, n_n):
    """``(pid_m, pid_n)`` of program ``pid`` over an ``n_m × n_n`` grid of tiles, in GROUP order."""
    per_group = GROUP * n_n
    first_m = (pid // per_group) * GROUP
    size = tl.minimum(n_m - first_m, GROUP)
    return first_m + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _row_tile(tile_expert_ptr, tile_row_ptr, expert_end_ptr, row_token_ptr, n_cols,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert (−1 past the last tile), its rows (int64), their tokens, the rows'
    mask and its column block, over a grid of (schedule tiles) × ⌈n_cols / BLOCK_N⌉ programs."""
    n_blocks = tl.cdiv(n_cols, BLOCK_N)
    pid_m, pid_n = _grouped(tl.program_id(0), tl.num_programs(0) // n_blocks, n_blocks)
    expert = tl.load(tile_expert_ptr + pid_m)
    row0 = tl.load(tile_row_ptr + pid_m).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(expert_end_ptr + tl.maximum(expert, 0))
    # A row past the expert's end reads token 0, a valid address; its results are masked on store.
    tokens = tl.load(row_token_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    return expert, rows, tokens, row_mask, pid_n


@triton.jit
def _gate_math(gate, up, ACTIVATION: tl.constexpr, alpha, limit):
    if ACTIVATION == "clamped":
        return swiglu_clamped_math(gate, up, alpha, limit)
    act, _ = gate_activation(gate, ACTIVATION)
    return act * up


@triton.jit
def _pair_columns(pid_n, n_inter, INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The gate_up columns of intermediate features ``[pid_n·BLOCK_N, +BLOCK_N)``: interleaved, one
    contiguous run of ``2·BLOCK_N`` (gate, up) pairs; concatenated, the gate's (the up's are
    ``n_inter`` further)."""
    if INTERLEAVED:
        cols = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        mask = cols < 2 * n_inter
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n_inter
    return cols, mask


@triton.jit
def _split_pairs(tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_M, 2·BLOCK_N]`` interleaved (gate, up) columns → gate, up ``[BLOCK_M, BLOCK_N]``."""
    return tl.split(tl.reshape(tile, (BLOCK_M, BLOCK_N, 2)))


@triton.jit
def _join_pairs(gate, up, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    return tl.reshape(tl.join(gate, up), (BLOCK_M, 2 * BLOCK_N))


@triton.jit
def _low_rank_rows(T, rows, row_mask, stride_t, n_rank, BLOCK_R: tl.constexpr):
    """An adapter's rank-space rows ``T[rows, :n_rank]``, ``[BLOCK_M, BLOCK_R]``, zero past ``n_rank``."""
    ranks = tl.arange(0, BLOCK_R)
    return tl.load(T + rows[:, None] * stride_t + ranks[None, :],
                   mask=row_mask[:, None] & (ranks < n_rank)[None, :], other=0.0)


@triton.jit
def _add_low_rank(acc, t, Q, expert, stride_qe, stride_qr, stride_qc, cols, col_mask, n_rank,
                  PRECISION: tl.constexpr, BLOCK_R: tl.constexpr):
    """``acc + t Q_e[:, cols]``: ``t`` from :func:`_low_rank_rows`, ``Q_e`` viewed as ``[n_rank, ·]``
    through strides (one adapter factor; the rank is the inner dimension of this one product)."""
    ranks = tl.arange(0, BLOCK_R)
    q_ptrs = Q + expert.to(tl.int64) * stride_qe + ranks[:, None] * stride_qr + cols[None, :] * stride_qc
    return _dot(t, tl.load(q_ptrs, mask=(ranks < n_rank)[:, None] & col_mask[None, :], other=0.0), acc, PRECISION)


@triton.jit
def moe_gate_up_kernel(
    X, W, BIAS, ROW_SCALE, ROW_TOKEN, TILE_EXPERT, TILE_ROW, EXPERT_END, GATE_UP, WH,
    n_in, n_inter,
    stride_x, stride_we, stride_wk, stride_wc, stride_be, stride_gu, stride_wh,
    LORA_T, LORA_B, n_rank, stride_t, stride_le, stride_lr, stride_lc,
    alpha, limit,
    ACTIVATION: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # Interleaved weights give one [BLOCK_K, 2·BLOCK_N] tile of (gate, up) pairs per step, split
    # after the loop; concatenated ones a gate tile and an up tile, n_inter columns apart. With an
    # adapter, its term t_r B_eᵀ (t = s·x A_eᵀ, computed before) starts the accumulators.
    expert, rows, tokens, row_mask, pid_n = _row_tile(
        TILE_EXPERT, TILE_ROW, EXPERT_END, ROW_TOKEN, n_inter, BLOCK_M, BLOCK_N
    )
    if expert < 0:
        return
    cols, col_mask = _pair_columns(pid_n, n_inter, INTERLEAVED, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + tokens[:, None] * stride_x + ks[None, :]
    w_ptrs = W + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wc
    acc = tl.zeros((BLOCK_M, cols.shape[0]), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        # The adapter's term first: its loads then overlap the main loop's first ones.
        t = _low_rank_rows(LORA_T, rows, row_mask, stride_t, n_rank, BLOCK_R)
        acc = _add_low_rank(acc, t, LORA_B, expert, stride_le, stride_lr, stride_lc, cols, col_mask, n_rank,
                            PRECISION, BLOCK_R)
        if not INTERLEAVED:
            acc_up = _add_low_rank(acc_up, t, LORA_B, expert, stride_le, stride_lr, stride_lc, cols + n_inter,
                                   col_mask, n_rank, PRECISION, BLOCK_R)
    for k0 in range(0, n_in, BLOCK_K):
        k_mask = ks < n_in - k0
        a = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        acc = _dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, PRECISION)
        if not INTERLEAVED:
            acc_up = _dot(a, tl.load(w_ptrs + n_inter * stride_wc, mask=w_mask, other=0.0), acc_up, PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    b_ptrs = BIAS + expert * stride_be + cols
    gu_ptrs = GATE_UP + rows[:, None] * stride_gu + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptrs, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(gu_ptrs, acc.to(GATE_UP.dtype.element_ty), mask=mask)
    if INTERLEAVED:
        gate, up = _split_pairs(acc, BLOCK_M, BLOCK_N)
    else:
        if HAS_BIAS:
            acc_up += tl.load(b_ptrs + n_inter, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(gu_ptrs + n_inter, acc_up.to(GATE_UP.dtype.element_ty), mask=mask)
        gate, up = acc, acc_up
    features = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    scale = tl.load(ROW_SCALE + rows, mask=row_mask, other=0.0)[:, None]
    wh = _gate_math(gate, up, ACTIVATION, alpha, limit) * scale
    tl.store(WH + rows[:, None] * stride_wh + features[None, :], wh.to(WH.dtype.element_ty),
             mask=row_mask[:, None] & (features < n_inter)[None, :])


@triton.jit
def _expert_matmul(acc, A, a_rows, stride_a, W, expert, stride_we, stride_wk, stride_wn, cols, col_mask, n_in,
                   PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + A[a_rows] W_e[:, cols]`` in fp32, ``[BLOCK_M, BLOCK_N]``: ``a_rows`` (int64) must be
    valid rows of ``A`` (masked rows read a valid one), ``W_e`` viewed as ``[n_in, ·]`` through strides."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_a + ks[None, :]
    w_ptrs = W + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    for k0 in range(0, n_in, BLOCK_K):
        k_mask = ks < n_in - k0
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(a, w, acc, PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def moe_scatter_kernel(
    A, W, BIAS, ROW_SCALE, ROW_TOKEN, ROW_PAIR, TILE_EXPERT, TILE_ROW, EXPERT_END, OUT,
    n_in, n_out,
    stride_a, stride_we, stride_wk, stride_wn, stride_be, stride_out,
    LORA_T, LORA_Q, n_rank, stride_t, stride_qe, stride_qr, stride_qn,
    ATOMIC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # A_r W_e (+ t_r Q_e, an adapter's term) (+ scale_r · b_e) for the sorted rows r of this tile,
    # added into the fp32 row of its token (ATOMIC) or stored as row pair[r] = t·k + j of
    # OUT [S, n_out], summed over j after.
    expert, rows, tokens, row_mask, pid_n = _row_tile(
        TILE_EXPERT, TILE_ROW, EXPERT_END, ROW_TOKEN, n_out, BLOCK_M, BLOCK_N
    )
    if expert < 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        t = _low_rank_rows(LORA_T, rows, row_mask, stride_t, n_rank, BLOCK_R)
        acc = _add_low_rank(acc, t, LORA_Q, expert, stride_qe, stride_qr, stride_qn, cols, col_mask, n_rank,
                            PRECISION, BLOCK_R)
    # Rows past the expert's end (past A's last row in the last tile) read row 0.
    acc = _expert_matmul(
        acc, A, tl.where(row_mask, rows, 0), stride_a, W, expert, stride_we, stride_wk, stride_wn, cols, col_mask,
        n_in, PRECISION, BLOCK_K,
    )
    if HAS_BIAS:
        bias = tl.load(BIAS + expert * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc += tl.load(ROW_SCALE + rows, mask=row_mask, other=0.0)[:, None] * bias[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if ATOMIC:
        tl.atomic_add(OUT + tokens[:, None] * stride_out + cols[None, :], acc, mask=mask, sem="relaxed")
    else:
        pairs = tl.load(ROW_PAIR + rows, mask=row_mask, other=0).to(tl.int64)
        tl.store(OUT + pairs[:, None] * stride_out + cols[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def moe_drop_rows_kernel(
    ORDER, EXPERT_END, OUT, n_rows, n_cols, n_experts, stride_out,
    BY_PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Zeros in OUT [S, n_cols] at the rows of the slots routed to no expert (id E): the sorted rows
    # from the last expert's end on, which no tile of the schedule covers; stored at the slot's
    # pair t·k + j (BY_PAIR) or at the sorted row.
    first = tl.program_id(0) * BLOCK_M
    kept = tl.load(EXPERT_END + n_experts - 1)
    if first + BLOCK_M <= kept:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = (rows >= kept) & (rows < n_rows)
    if BY_PAIR:
        rows = tl.load(ORDER + rows, mask=row_mask, other=0)
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=OUT.dtype.element_ty)
    for c0 in range(0, n_cols, BLOCK_N):
        mask = row_mask[:, None] & (c0 + cols < n_cols)[None, :]
        tl.store(OUT + rows[:, None] * stride_out + (c0 + cols)[None, :], zeros, mask=mask)


@triton.jit
def moe_down_bwd_kernel(
    DY, W, ROW_SCALE, ROW_TOKEN, TILE_EXPERT, TILE_ROW, EXPERT_END, GATE_UP, D_SCALE_PARTS,
    n_rows, n_hidden, n_inter,
    stride_dy, stride_we, stride_wk, stride_wn, stride_gu,
    LORA_U, LORA_A, n_rank, stride_u, stride_le, stride_lr, stride_ln,
    alpha, limit,
    ACTIVATION: tl.constexpr, PASS_AT_LIMIT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_LORA: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # g = dy_t W2_e (+ u_r A2_e with an adapter on the down projection: u = s·dy_t B2_e, computed
    # before), then the gate's backward (module docstring).
    expert, rows, tokens, row_mask, pid_n = _row_tile(
        TILE_EXPERT, TILE_ROW, EXPERT_END, ROW_TOKEN, n_inter, BLOCK_M, BLOCK_N
    )
    if expert < 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_inter
    g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        u = _low_rank_rows(LORA_U, rows, row_mask, stride_u, n_rank, BLOCK_R)
        g = _add_low_rank(g, u, LORA_A, expert, stride_le, stride_lr, stride_ln, cols, col_mask, n_rank,
                          PRECISION, BLOCK_R)
    g = _expert_matmul(
        g, DY, tokens, stride_dy, W, expert, stride_we, stride_wk, stride_wn, cols, col_mask, n_hidden,
        PRECISION, BLOCK_K,
    )
    mask = row_mask[:, None] & col_mask[None, :]
    pair_cols, pair_mask = _pair_columns(pid_n, n_inter, INTERLEAVED, BLOCK_N)
    gu_ptrs = GATE_UP + rows[:, None] * stride_gu + pair_cols[None, :]
    gu_mask = row_mask[:, None] & pair_mask[None, :]
    if INTERLEAVED:
        gate, up = _split_pairs(tl.load(gu_ptrs, mask=gu_mask, other=0.0).to(tl.float32), BLOCK_M, BLOCK_N)
    else:
        gate = tl.load(gu_ptrs, mask=gu_mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptrs + n_inter, mask=gu_mask, other=0.0).to(tl.float32)
    scale = tl.load(ROW_SCALE + rows, mask=row_mask, other=0.0)[:, None]
    if ACTIVATION == "clamped":
        d_gate, d_up, h = swiglu_clamped_grads(gate, up, g * scale, alpha, limit, PASS_AT_LIMIT)
    else:
        act, act_grad = gate_activation(gate, ACTIVATION)
        h = act * up
        d_up = g * scale * act
        d_gate = g * scale * up * act_grad
    # Each program reads its own tile of gate_up before overwriting it with the gradient.
    if INTERLEAVED:
        tl.store(gu_ptrs, _join_pairs(d_gate, d_up, BLOCK_M, BLOCK_N).to(GATE_UP.dtype.element_ty), mask=gu_mask)
    else:
        tl.store(gu_ptrs, d_gate.to(GATE_UP.dtype.element_ty), mask=gu_mask)
        tl.store(gu_ptrs + n_inter, d_up.to(GATE_UP.dtype.element_ty), mask=gu_mask)
    # This column block's share of dw_r = g_r · h_r, summed over the blocks after (no atomics:
    # every (block, row) is written once).
    tl.store(D_SCALE_PARTS + pid_n * n_rows + rows, tl.sum(tl.where(mask, g * h, 0.0), axis=1), mask=row_mask)


@triton.jit
def moe_low_rank_kernel(
    A, P, ROW_TOKEN, TILE_EXPERT, TILE_ROW, EXPERT_END, OUT,
    n_in, n_rank, scaling,
    stride_a, stride_pe, stride_pk, stride_pr, stride_out,
    GATHER: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # OUT[r] = scaling · A[r] P_e for the sorted rows r of this tile (A read at the row's token
    # when GATHER): an adapter's rank-space rows [S, n_rank], P_e viewed as [n_in, n_rank].
    expert, rows, tokens, row_mask, _ = _row_tile(
        TILE_EXPERT, TILE_ROW, EXPERT_END, ROW_TOKEN, n_rank, BLOCK_M, BLOCK_R
    )
    if expert < 0:
        return
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < n_rank
    acc = _expert_matmul(
        tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32), A, tokens if GATHER else tl.where(row_mask, rows, 0),
        stride_a, P, expert, stride_pe, stride_pk, stride_pr, ranks, rank_mask, n_in, PRECISION, BLOCK_K,
    )
    tl.store(OUT + rows[:, None] * stride_out + ranks[None, :], (acc * scaling).to(OUT.dtype.element_ty),
             mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def moe_weight_grad_kernel(
    A, B, ROW_TOKEN, EXPERT_END, DW,
    n_out, n_in,
    stride_a, stride_b, stride_de, stride_do, stride_di,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # DW_e[o, i] = Σ_r A[r, o] · B[r, i] over expert e's rows r (read at their token
    # when gathered); an expert without rows gets zeros.
    o_blocks = tl.cdiv(n_out, BLOCK_O)
    i_blocks = tl.cdiv(n_in, BLOCK_I)
    pid = tl.program_id(0)
    expert = pid // (o_blocks * i_blocks)
    pid_o, pid_i = _grouped(pid % (o_blocks * i_blocks), o_blocks, i_blocks)
    outs = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    ins = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    out_mask = outs < n_out
    in_mask = ins < n_in
    start = tl.load(EXPERT_END + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    end = tl.load(EXPERT_END + expert).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + ks
        k_mask = rows < end
        tokens = tl.load(ROW_TOKEN + rows, mask=k_mask, other=0).to(tl.int64)
        a_rows = tokens if GATHER_A else rows
        b_rows = tokens if GATHER_B else rows
        a = tl.load(A + a_rows[:, None] * stride_a + outs[None, :], mask=k_mask[:, None] & out_mask[None, :], other=0.0)
        b = tl.load(B + b_rows[:, None] * stride_b + ins[None, :], mask=k_mask[:, None] & in_mask[None, :], other=0.0)
        acc = _dot(tl.trans(a), b, acc, PRECISION)
    dw_ptrs = DW + expert.to(tl.int64) * stride_de + outs[:, None] * stride_do + ins[None, :] * stride_di
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=out_mask[:, None] & in_mask[None, :])



@triton.jit
def moe_schedule_kernel(
    EXPERT_END, TILE_EXPERT, TILE_ROW, n_experts, n_tiles,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # Expert e's rows [start_e, end_e) make ⌈count_e / BLOCK_M⌉ tiles, numbered in expert order;
    # tile t belongs to the expert whose tiles span it (−1 past the last). Each program places
    # BLOCK_T tiles (every one recounts the experts' tiles: E is small).
    experts = tl.arange(0, BLOCK_E)
    valid = experts < n_experts
    end = tl.load(EXPERT_END + experts, mask=valid, other=0)
    start = tl.load(EXPERT_END + experts - 1, mask=valid & (experts > 0), other=0)
    tiles = tl.where(valid, tl.cdiv(end - start, BLOCK_M), 0)
    tile_end = tl.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    tile = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    expert = tl.sum(((tile_end[None, :] <= tile[:, None]) & valid[None, :]).to(tl.int32), axis=1)
    owner = experts[None, :] == expert[:, None]
    row = tl.sum(tl.where(owner, start[None, :], 0), axis=1)
    first = tl.sum(tl.where(owner, tile_start[None, :], 0), axis=1)
    tl.store(TILE_EXPERT + tile, tl.where(expert < n_experts, expert, -1), mask=tile < n_tiles)
    tl.store(TILE_ROW + tile, row + (tile - first) * BLOCK_M, mask=tile < n_tiles)

# Tiles (BLOCK_M is shared by every row kernel: the tile schedule is built for it once per call).
# Chosen on the H100 at Qwen3-30B-A3B's shapes (benchmarks/tune_moe.py). The interpreter runs one
# program at a time in Python, at a cost set by the programs and loop steps more than by the tile's
# size: its tiles are 64 wide, a tiny model's experts take one, and tests/ops/test_moe.py's CPU
# shape crosses several tiles along every dimension.
_GPU_TILES = {
    "block_m": 128,
    "gate_up": dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "down": dict(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    "dx": dict(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
    "down_bwd": dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "weight_grad": dict(BLOCK_O=128, BLOCK_I=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "low_rank": dict(BLOCK_K=128, num_warps=4, num_stages=3),
}
_INTERPRETER_TILES = {
    "block_m": 64,
    "gate_up": dict(BLOCK_N=64, BLOCK_K=64),
    "down": dict(BLOCK_N=64, BLOCK_K=64),
    "dx": dict(BLOCK_N=64, BLOCK_K=64),
    "down_bwd": dict(BLOCK_N=64, BLOCK_K=64),
    "weight_grad": dict(BLOCK_O=64, BLOCK_I=64, BLOCK_K=64),
    "low_rank": dict(BLOCK_K=64),
}


def _tiles(dtype: torch.dtype) -> dict:
    """The tiles for ``dtype``: fp32 operands take half the ``BLOCK_K`` of 16-bit ones (the same
    bytes per pipeline stage in shared memory)."""
    if interpreting():
        return _INTERPRETER_TILES
    if dtype.itemsize < 4:
        return _GPU_TILES
    return {name: {**config, "BLOCK_K": config["BLOCK_K"] // 2} if isinstance(config, dict) else config
            for name, config in _GPU_TILES.items()}


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _tile_schedule_fake(expert_end, n_tiles, block_m):
    return expert_end.new_empty(n_tiles), expert_end.new_empty(n_tiles)


@tigon_op("moe_tile_schedule", fake=_tile_schedule_fake)
def tile_schedule(expert_end: torch.Tensor, n_tiles: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tile_expert, tile_row)`` of :func:`routing`, int32 ``[n_tiles]``, from ``expert_end`` (int32)."""
    tile_expert = expert_end.new_empty(n_tiles)
    tile_row = expert_end.new_empty(n_tiles)
    block_e = triton.next_power_of_2(expert_end.numel())
    block_t = max(16, 4096 // block_e)
    moe_schedule_kernel[(triton.cdiv(n_tiles, block_t),)](
        expert_end, tile_expert, tile_row, expert_end.numel(), n_tiles, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_T=block_t,
    )
    return tile_expert, tile_row


def routing(top_k_index: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """The routing metadata of ``top_k_index [T, k]`` (expert ids in ``[0, n_experts]``, the last
    a dropped slot), without a host sync: ``(order, row_token, expert_end, tile_expert,
    tile_row)``, all int32.

    Row ``r`` of the expert-sorted order is pair ``order[r]`` (``t·k + j``) of token ``row_token[r]``;
    expert ``e``'s rows end at ``expert_end[e]``, and the dropped slots' rows follow the last
    expert's. Tile ``i`` of ``block_m`` rows belongs to expert ``tile_expert[i]`` (−1 past the
    last) and starts at row ``tile_row[i]``; the schedule is sized for the most tiles any routing
    can need, ``⌈S / block_m⌉ + min(E, S)``.
    """
    top_k = top_k_index.shape[1]
    device = top_k_index.device
    sorted_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    n_rows = order.numel()
    expert_ids = torch.arange(n_experts, device=device, dtype=sorted_ids.dtype)
    expert_end = torch.searchsorted(sorted_ids, expert_ids, right=True, out_int32=True)
    n_tiles = triton.cdiv(n_rows, block_m) + min(n_experts, n_rows)
    tile_expert, tile_row = tile_schedule(expert_end, n_tiles, block_m)
    order = order.int()
    return order, torch.div(order, top_k, rounding_mode="floor"), expert_end, tile_expert, tile_row


class _Layout:
    """Strides of the experts' weights as the kernels read them (see the module docstring)."""

    def __init__(self, gate_up_proj, down_proj, transposed):
        n_inter = down_proj.shape[1] if transposed else down_proj.shape[2]
        gate_up_in, gate_up_cols = (1, 2) if transposed else (2, 1)  # the dims of H and of 2I
        down_in, down_out = (1, 2) if transposed else (2, 1)  # the dims of I and of H
        self.n_inter = n_inter
        # gate_up_proj as [E, H (k), 2I (c)] and its transpose [E, 2I (k), H (n)]
        self.gate_up_kc = (gate_up_proj.stride(0), gate_up_proj.stride(gate_up_in), gate_up_proj.stride(gate_up_cols))
        self.gate_up_cn = (gate_up_proj.stride(0), gate_up_proj.stride(gate_up_cols), gate_up_proj.stride(gate_up_in))
        # down_proj as [E, I (k), H (n)] and its transpose [E, H (k), I (n)]
        self.down_in_out = (down_proj.stride(0), down_proj.stride(down_in), down_proj.stride(down_out))
        self.down_out_in = (down_proj.stride(0), down_proj.stride(down_out), down_proj.stride(down_in))


def _row_grid(tile_expert: torch.Tensor, n_cols: int, block_n: int) -> tuple[int]:
    return (tile_expert.numel() * triton.cdiv(n_cols, block_n),)


def _optional(tensor: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, int]:
    """A possibly absent tensor as the kernels take it, with its row stride."""
    return (empty_tensor(device), 0) if tensor is None else (tensor, tensor.stride(0))


def _rank_block(rank: int) -> int:
    """``BLOCK_R``: an adapter's rank padded to a power of two, at least the tensor cores' 16."""
    return max(16, triton.next_power_of_2(rank))


def _factor_strides(factor: torch.Tensor, as_stored: bool) -> tuple[int, int, int]:
    """Strides of an adapter factor ``[E, d1, d2]`` read as ``[E, d1, d2]`` or, transposed, ``[E, d2, d1]``."""
    return (factor.stride(0), factor.stride(1), factor.stride(2)) if as_stored else (
        factor.stride(0), factor.stride(2), factor.stride(1))


def _low_rank_term(rows: torch.Tensor | None, factor: torch.Tensor | None, as_stored: bool, device) -> tuple:
    """The kernels' adapter term ``rows_r F_e`` (``rows [S, r]`` from :func:`_low_rank`, ``F_e``
    read ``[r, n]`` through strides): its arguments ``(T, F, n_rank, stride_t, *F's strides)`` and
    constexprs; a kernel without one gets placeholders and ``HAS_LORA=False``."""
    if rows is None:
        empty = empty_tensor(device)
        return (empty, empty, 0, 0, 0, 0, 0), dict(HAS_LORA=False, BLOCK_R=16)
    rank = rows.shape[1]
    return ((rows, factor, rank, rows.stride(0), *_factor_strides(factor, as_stored)),
            dict(HAS_LORA=True, BLOCK_R=_rank_block(rank)))


def _low_rank(a, gather, factor, as_stored, scaling, meta):
    """``scaling · a_r F_e`` per sorted row ``r`` (``a`` read at the row's token when ``gather``),
    ``[S, r]`` in ``a``'s dtype, with ``F_e`` an adapter factor read ``[n_in, r]`` through strides."""
    _, row_token, expert_end, tile_expert, tile_row = meta
    rank = factor.shape[2] if as_stored else factor.shape[1]
    out = a.new_empty((row_token.numel(), rank))
    tiles = _tiles(a.dtype)
    block_r = _rank_block(rank)
    moe_low_rank_kernel[_row_grid(tile_expert, rank, block_r)](
        a, factor, row_token, tile_expert, tile_row, expert_end, out,
        a.shape[1], rank, scaling,
        a.stride(0), *_factor_strides(factor, as_stored), out.stride(0),
        GATHER=gather, PRECISION=_precision(a.dtype), BLOCK_M=tiles["block_m"], BLOCK_R=block_r, **tiles["low_rank"],
    )
    return out


def _scatter(kind, a, weight, weight_strides, bias, row_scale, meta, out, n_in, low_rank=None):
    """``a_r W_e (+ t_r F_e) + scale_r · b_e`` per sorted row ``r``: added into ``out [T, n_out]``
    (fp32) at the row's token for ``kind="dx"``, stored into ``out [S, n_out]`` at the row's pair
    for ``"down"``; ``low_rank``, an adapter's term from :func:`_low_rank_term`."""
    order, row_token, expert_end, tile_expert, tile_row = meta
    tiles = _tiles(a.dtype)
    config = tiles[kind]
    n_out = out.shape[1]
    bias, stride_bias = _optional(bias, a.device)
    lora_args, lora_options = low_rank or _low_rank_term(None, None, True, a.device)
    moe_scatter_kernel[_row_grid(tile_expert, n_out, config["BLOCK_N"])](
        a, weight, bias, _optional(row_scale, a.device)[0], row_token, order, tile_expert, tile_row, expert_end, out,
        n_in, n_out,
        a.stride(0), *weight_strides, stride_bias, out.stride(0),
        *lora_args,
        ATOMIC=kind == "dx", HAS_BIAS=stride_bias != 0, PRECISION=_precision(a.dtype),
        BLOCK_M=tiles["block_m"], **lora_options, **config,
    )


def _zero_dropped(out, meta, by_pair):
    """Zeros in ``out [S, ·]`` at the rows of dropped slots (id E), by pair or by sorted row."""
    order, _, expert_end, _, _ = meta
    tiles = _tiles(out.dtype)
    moe_drop_rows_kernel[(triton.cdiv(out.shape[0], tiles["block_m"]),)](
        order, expert_end, out, out.shape[0], out.shape[1], expert_end.numel(), out.stride(0),
        BY_PAIR=by_pair, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["down"]["BLOCK_N"],
    )


def _weight_grad(a, b, gather_a, gather_b, meta, like, transposed, n_out, n_in, low_rank=False):
    """``dW_e[o, i] = Σ_r a[r, o] · b[r, i]`` over each expert's rows, as a new tensor
    shaped as the weight ``like`` (``o`` its dim 1, ``i`` its dim 2; the reverse when transposed);
    ``low_rank``: an adapter factor's, whose smaller side (the rank) takes a tile of its size."""
    _, row_token, expert_end, _, _ = meta
    dw = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    o_dim, i_dim = (2, 1) if transposed else (1, 2)
    config = dict(_tiles(a.dtype)["weight_grad"])
    if low_rank:
        config["BLOCK_O" if n_out < n_in else "BLOCK_I"] = _rank_block(min(n_out, n_in))
    grid = (like.shape[0] * triton.cdiv(n_out, config["BLOCK_O"]) * triton.cdiv(n_in, config["BLOCK_I"]),)
    moe_weight_grad_kernel[grid](
        a, b, row_token, expert_end, dw,
        n_out, n_in,
        a.stride(0), b.stride(0), dw.stride(0), dw.stride(o_dim), dw.stride(i_dim),
        GATHER_A=gather_a, GATHER_B=gather_b, PRECISION=_precision(a.dtype),
        **config,
    )
    return dw


def _or_empty(tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a new empty one where it is absent: a custom op's outputs may not alias."""
    return like.new_empty((0,)) if tensor is None else tensor


def _moe_fwd_fake(x, gate_up_proj, down_proj, gate_up_bias, down_bias, row_weight, order, row_token, expert_end,
                  tile_expert, tile_row, gate, transposed, interleaved, alpha, limit, gate_up_lora_a=None,
                  gate_up_lora_b=None, gate_up_scaling=1.0, down_lora_a=None, down_lora_b=None, down_scaling=1.0):
    n_inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    n_rows = row_token.shape[0]

    def rank_rows(lora_a):
        return x.new_empty((0,) if lora_a is None else (n_rows, lora_a.shape[1]))

    return (x.new_empty(x.shape), x.new_empty((n_rows, 2 * n_inter)), x.new_empty((n_rows, n_inter)),
            rank_rows(gate_up_lora_a), rank_rows(down_lora_a))


@tigon_op("moe_fwd", fake=_moe_fwd_fake)
def moe_fwd(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None, row_weight: torch.Tensor, order: torch.Tensor, row_token: torch.Tensor,
    expert_end: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor, gate: str, transposed: bool,
    interleaved: bool, alpha: float, limit: float, gate_up_lora_a: torch.Tensor | None = None,
    gate_up_lora_b: torch.Tensor | None = None, gate_up_scaling: float = 1.0, down_lora_a: torch.Tensor | None = None,
    down_lora_b: torch.Tensor | None = None, down_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, H]`` through the experts → ``(y [T, H], gate_up [S, 2I], wh [S, I], t_gate_up [S, r],
    t_down [S, r])`` (module docstring); the routing is :func:`routing`'s, ``row_weight [S]`` fp32
    the routing weight of each sorted row. The adapters, each optional: ``lora_a [E, r, n_in]``,
    ``lora_b [E, n_out, r]``; ``t`` is an adapter's ``s·a_r Aᵀ`` (kept for backward; empty without one)."""
    meta = (order, row_token, expert_end, tile_expert, tile_row)
    layout = _Layout(gate_up_proj, down_proj, transposed)
    tiles = _tiles(x.dtype)
    n_tokens, n_hidden = x.shape
    n_rows, n_inter = row_token.numel(), layout.n_inter
    gate_up = x.new_empty((n_rows, 2 * n_inter))
    wh = x.new_empty((n_rows, n_inter))
    t_gate_up = t_down = None
    if gate_up_lora_a is not None:
        t_gate_up = _low_rank(x, True, gate_up_lora_a, False, gate_up_scaling, meta)
    lora_args, lora_options = _low_rank_term(t_gate_up, gate_up_lora_b, False, x.device)
    bias, stride_bias = _optional(gate_up_bias, x.device)
    config = tiles["gate_up"]
    moe_gate_up_kernel[_row_grid(tile_expert, n_inter, config["BLOCK_N"])](
        x, gate_up_proj, bias, row_weight, row_token, tile_expert, tile_row, expert_end, gate_up, wh,
        n_hidden, n_inter,
        x.stride(0), *layout.gate_up_kc, stride_bias, gate_up.stride(0), wh.stride(0),
        *lora_args,
        alpha, limit,
        ACTIVATION=_ACTIVATION[gate], INTERLEAVED=interleaved, HAS_BIAS=stride_bias != 0,
        PRECISION=_precision(x.dtype),
        BLOCK_M=tiles["block_m"], **lora_options, **config,
    )
    if down_lora_a is not None:
        t_down = _low_rank(wh, False, down_lora_a, False, down_scaling, meta)
    # Each pair's weighted row lands at t·k + j; the k rows of a token are then summed in fp32
    # (in a fixed order: the output is deterministic) and rounded once.
    rows = x.new_empty((n_rows, n_hidden))
    _scatter("down", wh, down_proj, layout.down_in_out, down_bias, row_weight, meta, rows, n_inter,
             _low_rank_term(t_down, down_lora_b, False, x.device))
    _zero_dropped(rows, meta, by_pair=True)
    y = rows.view(n_tokens, n_rows // max(n_tokens, 1), n_hidden).sum(dim=1)
    return y, gate_up, wh, _or_empty(t_gate_up, x), _or_empty(t_down, x)


def _moe_bwd_fake(dy, x, gate_up_proj, down_proj, gate_up, wh, row_weight, order, row_token, expert_end,
                  tile_expert, tile_row, gate, transposed, interleaved, alpha, limit, needs_dx, needs_d_gate_up,
                  needs_d_down, zero_dropped=False, gate_up_lora_a=None, gate_up_lora_b=None, gate_up_scaling=1.0,
                  down_lora_a=None, down_lora_b=None, down_scaling=1.0, t_gate_up=None, t_down=None,
                  needs_d_lora=True):
    def grad(like, needed):
        return dy.new_empty((0,)) if like is None or not needed else like.new_empty(like.shape)

    return (grad(x, needs_dx), grad(gate_up_proj, needs_d_gate_up), grad(down_proj, needs_d_down),
            row_weight.new_empty(row_weight.shape), *(grad(factor, needs_d_lora) for factor in (
                gate_up_lora_a, gate_up_lora_b, down_lora_a, down_lora_b)))


@tigon_op("moe_bwd", fake=_moe_bwd_fake, mutates_args=("gate_up",))
def moe_bwd(
    dy: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gate_up: torch.Tensor,
    wh: torch.Tensor, row_weight: torch.Tensor, order: torch.Tensor, row_token: torch.Tensor,
    expert_end: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor, gate: str, transposed: bool,
    interleaved: bool, alpha: float, limit: float, needs_dx: bool, needs_d_gate_up: bool, needs_d_down: bool,
    zero_dropped: bool = False, gate_up_lora_a: torch.Tensor | None = None, gate_up_lora_b: torch.Tensor | None = None,
    gate_up_scaling: float = 1.0, down_lora_a: torch.Tensor | None = None, down_lora_b: torch.Tensor | None = None,
    down_scaling: float = 1.0, t_gate_up: torch.Tensor | None = None, t_down: torch.Tensor | None = None,
    needs_d_lora: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """``(dx, d_gate_up_proj, d_down_proj, d_row_weight, d_gate_up_lora_a, d_gate_up_lora_b,
    d_down_lora_a, d_down_lora_b)`` for ``dy [T, H]``; a gradient not asked for (the adapters' by
    ``needs_d_lora``), or of an absent adapter, is an empty tensor. ``gate_up`` is overwritten with its gradient, and with
    ``zero_dropped`` its dropped slots' rows with zeros (for a sum over every row). ``d_row_weight
    [S]`` fp32 leaves out the down bias's term ``dy_t · b2_e``. The adapters as :func:`moe_fwd`
    takes them, with the ``t`` it returned."""
    meta = (order, row_token, expert_end, tile_expert, tile_row)
    layout = _Layout(gate_up_proj, down_proj, transposed)
    tiles = _tiles(dy.dtype)
    n_tokens, n_hidden = dy.shape
    n_inter = layout.n_inter
    config = tiles["down_bwd"]
    # An adapter y += t_r B_eᵀ with t_r = s·a_r A_eᵀ (a = x or wh) sends the row's output gradient
    # g_r back through u_r = s·g_r B_e: a_r's gradient gains u_r A_e, and
    #     dA_e = Σ_r u_rᵀ a_r,   dB_e = Σ_r g_rᵀ t_r      over expert e's rows.
    d_down_a = d_down_b = d_gate_up_a = d_gate_up_b = None
    u_down = None
    if down_lora_a is not None:
        u_down = _low_rank(dy, True, down_lora_b, True, down_scaling, meta)
    lora_args, lora_options = _low_rank_term(u_down, down_lora_a, True, dy.device)
    # Zeros where no program writes: the rows of dropped slots.
    d_row_weight = row_weight.new_zeros((triton.cdiv(n_inter, config["BLOCK_N"]), row_weight.numel()))
    moe_down_bwd_kernel[_row_grid(tile_expert, n_inter, config["BLOCK_N"])](
        dy, down_proj, row_weight, row_token, tile_expert, tile_row, expert_end, gate_up, d_row_weight,
        row_weight.numel(), n_hidden, n_inter,
        dy.stride(0), *layout.down_out_in, gate_up.stride(0),
        *lora_args,
        alpha, limit,
        ACTIVATION=_ACTIVATION[gate], PASS_AT_LIMIT=clamp_passes_at_limit(), INTERLEAVED=interleaved,
        PRECISION=_precision(dy.dtype), BLOCK_M=tiles["block_m"], **lora_options, **config,
    )
    if u_down is not None and needs_d_lora:
        d_down_a = _weight_grad(u_down, wh, False, False, meta, down_lora_a, False, u_down.shape[1], n_inter, True)
        d_down_b = _weight_grad(dy, t_down, True, False, meta, down_lora_b, False, n_hidden, t_down.shape[1], True)
    d_down = None
    if needs_d_down:
        d_down = _weight_grad(dy, wh, True, False, meta, down_proj, transposed, n_hidden, n_inter)
    u_gate_up = None
    if gate_up_lora_a is not None and (needs_dx or needs_d_lora):
        u_gate_up = _low_rank(gate_up, False, gate_up_lora_b, True, gate_up_scaling, meta)
    if u_gate_up is not None and needs_d_lora:
        d_gate_up_a = _weight_grad(u_gate_up, x, False, True, meta, gate_up_lora_a, False, u_gate_up.shape[1],
                                   n_hidden, True)
        d_gate_up_b = _weight_grad(gate_up, t_gate_up, False, False, meta, gate_up_lora_b, False, 2 * n_inter,
                                   t_gate_up.shape[1], True)
    dx = None
    if needs_dx:
        dx = torch.zeros((n_tokens, n_hidden), dtype=torch.float32, device=dy.device)
        _scatter("dx", gate_up, gate_up_proj, layout.gate_up_cn, None, None, meta, dx, 2 * n_inter,
                 _low_rank_term(u_gate_up, gate_up_lora_a, True, dy.device))
        dx = dx.to(x.dtype)
    d_gate_up = None
    if needs_d_gate_up:
        d_gate_up = _weight_grad(gate_up, x, False, True, meta, gate_up_proj, transposed, 2 * n_inter, n_hidden)
    if zero_dropped:
        _zero_dropped(gate_up, meta, by_pair=False)
    return (_or_empty(dx, dy), _or_empty(d_gate_up, dy), _or_empty(d_down, dy), d_row_weight.sum(dim=0),
            *(_or_empty(grad, dy) for grad in (d_gate_up_a, d_gate_up_b, d_down_a, d_down_b)))


def _rank_major(lora_a: torch.Tensor | None, lora_b: torch.Tensor | None) -> tuple:
    """An adapter's factors ``lora_a [E, r, in]``, ``lora_b [E, out, r]``, both laid out ``[E, r, ·]``
    in memory (copies unless they are): the kernels read their ``[r, n]`` and ``[n, r]`` tiles along
    ``n``. PEFT's ``lora_B`` of stacked experts is ``[out, r·E]``, expert ``e`` every ``E``-th
    column: read in place, each element would cost its own memory sector."""
    if lora_a is None:
        return None, None
    return lora_a.contiguous(), lora_b.mT.contiguous().mT


class MoEExpertsFunction(torch.autograd.Function):
    """The experts of a MoE layer (module docstring); arguments as :func:`tigon.functional.moe_experts`."""

    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                gate_up_lora_a, gate_up_lora_b, gate_up_scaling, down_lora_a, down_lora_b, down_scaling,
                gate, transposed, interleaved, alpha, limit):
        n_experts = gate_up_proj.shape[0]
        meta = routing(top_k_index, n_experts, _tiles(x.dtype)["block_m"])
        row_weight = top_k_weights.reshape(-1)[meta[0]].float()
        gate_up_lora_a, gate_up_lora_b = _rank_major(gate_up_lora_a, gate_up_lora_b)
        down_lora_a, down_lora_b = _rank_major(down_lora_a, down_lora_b)
        adapters = (gate_up_lora_a, gate_up_lora_b, gate_up_scaling, down_lora_a, down_lora_b, down_scaling)
        y, gate_up, wh, t_gate_up, t_down = moe_fwd(
            x, gate_up_proj, down_proj, gate_up_bias, down_bias, row_weight, *meta,
            gate, transposed, interleaved, alpha, limit, *adapters,
        )
        ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                              gate_up_lora_a, gate_up_lora_b, down_lora_a, down_lora_b,
                              t_gate_up if gate_up_lora_a is not None else None,
                              t_down if down_lora_a is not None else None, gate_up, wh, row_weight, *meta)
        ctx.options = (gate, transposed, interleaved, alpha, limit)
        ctx.scalings = (gate_up_scaling, down_scaling)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_lora_a,
         gate_up_lora_b, down_lora_a, down_lora_b, t_gate_up, t_down, gate_up, wh, row_weight,
         *meta) = ctx.saved_tensors
        order = meta[0]
        needs = ctx.needs_input_grad
        needs_gate_up_bias = gate_up_bias is not None and needs[5]
        gate_up_scaling, down_scaling = ctx.scalings
        (dx, d_gate_up_proj, d_down_proj, d_row_weight, d_gate_up_lora_a, d_gate_up_lora_b, d_down_lora_a,
         d_down_lora_b) = moe_bwd(
            dy.contiguous(), x, gate_up_proj, down_proj, gate_up, wh, row_weight, *meta, *ctx.options,
            needs[0], needs[3], needs[4], needs_gate_up_bias,
            gate_up_lora_a, gate_up_lora_b, gate_up_scaling, down_lora_a, down_lora_b, down_scaling, t_gate_up, t_down,
            any(needs[i] for i in (7, 8, 10, 11)),
        )
        d_weights = None
        if needs[2]:
            d_pairs = torch.empty_like(d_row_weight)
            d_pairs[order.long()] = d_row_weight
            d_weights = d_pairs.view(top_k_weights.shape)
            if down_bias is not None:
                # y_t's term w_tj · b2_e: its weight's gradient gains dy_t · b2_e (0 for a dropped
                # slot, which reads the padded column E).
                bias_terms = torch.nn.functional.pad(dy.float() @ down_bias.float().T, (0, 1))
                d_weights = d_weights + bias_terms.gather(1, top_k_index.long())
            d_weights = d_weights.to(top_k_weights.dtype)
        d_gate_up_bias = d_down_bias = None
        if needs_gate_up_bias:
            # Σ over each expert's rows of d_gate_up (now in gate_up, the dropped slots' rows
            # zeroed): one matmul with the rows' one-hot expert matrix [E, S].
            row_expert = top_k_index.reshape(-1)[order.long()]
            one_hot = (row_expert[None, :] == torch.arange(gate_up_bias.shape[0], device=dy.device)[:, None])
            d_gate_up_bias = (one_hot.to(gate_up.dtype) @ gate_up).to(gate_up_bias.dtype)
        if down_bias is not None and needs[6]:
            # Σ over token t and slot j routed to e of w_tj · dy_t: the routing weights as a dense
            # [T, E] matrix (a column E for the dropped slots, left out), transposed, times dy.
            n_experts = down_bias.shape[0]
            routed = torch.zeros((dy.shape[0], n_experts + 1), dtype=torch.float32, device=dy.device)
            routed.scatter_add_(1, top_k_index.long(), top_k_weights.float())
            d_down_bias = (routed[:, :n_experts].T @ dy.float()).to(down_bias.dtype)
        return (
            dx if needs[0] else None, None, d_weights,
            d_gate_up_proj if needs[3] else None, d_down_proj if needs[4] else None,
            d_gate_up_bias, d_down_bias,
            d_gate_up_lora_a if needs[7] else None, d_gate_up_lora_b if needs[8] else None, None,
            d_down_lora_a if needs[10] else None, d_down_lora_b if needs[11] else None, None,
            None, None, None, None, None,
        )
