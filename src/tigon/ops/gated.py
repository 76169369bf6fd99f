"""Activations of an MLP: SwiGLU ``silu(gate) · up``, GeGLU ``gelu_tanh(gate) · up``, GPT-OSS's
clamped SwiGLU and Nemotron's squared ReLU ``relu(x)²`` (an ungated MLP's activation, here for the
elementwise machinery it shares with the gates).

SwiGLU's and GeGLU's activations have the form ``act(g) = g · σ(z(g))``:

    silu:       z(g) = g
    gelu_tanh:  z(g) = 2·√(2/π)·(g + 0.044715·g³)     since ½·(1 + tanh(u)) = σ(2u)

so one derivative serves both, with ``s = σ(z(g))`` and ``σ' = s·(1 − s)``::

    act'(g) = s + g·s·(1 − s)·z'(g) = s·(1 + g·(1 − s)·z'(g))
    z'(g)   = 1  (silu),   2·√(2/π)·(1 + 3·0.044715·g²)  (gelu_tanh)

For silu this is the familiar ``σ(g)·(1 + g·(1 − σ(g)))``; for gelu_tanh it equals the textbook
``½(1 + tanh u) + ½·g·(1 − tanh² u)·u'`` because ``1 − tanh² u = 4·σ(2u)·(1 − σ(2u))``.

Forward ``out = act(gate) · up``; backward, recomputing ``act`` from ``gate`` (nothing but the
inputs is saved)::

    d_up   = dout · act(gate)
    d_gate = dout · up · act'(gate)

``inplace_backward`` writes ``d_gate`` and ``d_up`` over ``gate`` and ``up`` (each element is
read before it is overwritten, by the same program), so the backward allocates nothing.

Beside FP8 matmuls that scale each operand by one number (torchao's ``tensorwise`` recipe), the
gate casts its output (the next matmul's input), its gradients (the previous matmuls' output
gradients), or both, to FP8 itself: a first pass over the inputs folds the largest magnitude of
the 16-bit values into one number, the scale ``max(fp8) / amax`` follows, and a second pass
recomputes the values, scales them and stores FP8 bytes. The 16-bit tensors are never stored,
and the bytes equal those of a cast of them.

With the MLP's down projection fused in (:class:`GatedLinearFunction`, ``out = h @ Wᵀ`` with
``h = act(gate) · up``), nothing of ``h`` is saved: a separate down projection keeps ``h`` for its
weight gradient ``dWᵀ = doutᵀ·h``, a third ``[N, I]`` tensor beside ``gate`` and ``up``. The
backward computes ``dh = dout·W`` into a new buffer, and one kernel reads ``gate, up, dh`` and
writes ``d_gate, d_up`` over ``gate, up`` and the recomputed ``h`` over ``dh``, from which
``dW`` follows.

The whole MLP (:class:`GatedMLPFunction`, ``x`` and the three weights in, ``[..., H]`` out) keeps
nothing but its inputs, saved by a separate identity function before any matmul (the reason is in
:class:`tigon.ops._launch.KeepForBackwardFunction`); its backward recomputes ``gate`` and ``up`` per slice of the
intermediate dimension.

GPT-OSS's clamped SwiGLU reads ``gate_up [..., 2I]`` with gate and up interleaved (even and odd
columns), clamps ``ĝ = min(gate, L)`` and ``û = clamp(up, −L, L)``, and computes
``out = (û + 1) · ĝ · σ(α·ĝ)``: the activation above with ``z(g) = α·g``, so::

    d_gate = dout · (û + 1) · s·(1 + α·ĝ·(1 − s))  where gate ≤ L, else 0        s = σ(α·ĝ)
    d_up   = dout · ĝ · s                          where −L ≤ up ≤ L, else 0

(``torch.clamp``'s gradient: zero outside the limits. At a limit itself, the installed torch's
rule: torch up to 2.13 passes the gradient there, torch 2.14 stops it, so ``≤`` above is ``<``
under 2.14; :func:`clamp_passes_at_limit` asks torch once.) The math lives in
:func:`swiglu_clamped_math` and :func:`swiglu_clamped_grads`, ``@triton.jit`` helpers on fp32
tiles that a fused kernel (a MoE's expert MLP) calls on its own tiles.

The squared ReLU ``out = relu(x)²`` has ``dx = dout · 2·relu(x)``; its backward recomputes from
``x`` and may overwrite it, like the gates' ``inplace_backward``.

Shapes: ``gate, up [...]`` of one shape and dtype (fp32/bf16/fp16), handled as ``[rows, cols]``
row views (any row stride, e.g. the two halves of a fused gate/up projection, read in place);
math in fp32, one rounding on store. Bytes per call (the roofline): forward reads gate and up and
writes out (3 tensors), backward reads gate, up, dout and writes d_gate, d_up (5 tensors); the
clamped SwiGLU moves the same (``gate_up`` counts twice); the squared ReLU reads x and writes out
(2), then reads x and dout and writes dx (3).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tigon.ops import lora as _lora
from tigon.ops.fp8 import fp8_format, fp8_scales, saturated_fp8_code, tile_amax
from tigon.ops._launch import (
    as_rows,
    cdiv,
    keep_for_backward,
    kept_tensors,
    kept_x_needs_grad,
    launch,
    next_power_of_2,
    save_inputs,
    tigon_op,
)

# A program's tile: 4096 elements (8 KiB of a 16-bit tensor); 512 per warp is 16 per thread,
# i.e. two 16-byte loads of each bf16 input in flight per thread.
ELEMENTS_PER_PROGRAM = 4096
ELEMENTS_PER_WARP = 512

# The kernels' activation of each gate.
GATE_KINDS = {"swiglu": "silu", "geglu": "gelu_tanh"}
_GELU_SLOPE = tl.constexpr(2 * 0.7978845608028654)  # 2·√(2/π): z = slope·(g + cubic·g³)
_GELU_CUBIC = tl.constexpr(0.044715)


@triton.jit
def _tile(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row offsets (int64, for row strides), column offsets and mask of this program's tile; tiles
    run along a row first, so neighbouring programs touch neighbouring memory."""
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    pid = tl.program_id(0)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def gate_activation(g, ACTIVATION: tl.constexpr):
    """``act(g)`` and ``act'(g)`` in fp32 (see the module docstring for the derivation)."""
    if ACTIVATION == "gelu_tanh":
        z = _GELU_SLOPE * (g + _GELU_CUBIC * g * g * g)
        dz_dg = _GELU_SLOPE * (1.0 + 3.0 * _GELU_CUBIC * g * g)
    else:
        z = g
        dz_dg = 1.0
    s = tl.sigmoid(z)
    return g * s, s * (1.0 + g * (1.0 - s) * dz_dg)


@triton.jit
def gated_fwd_kernel(
    GATE, UP, OUT, SCALE,
    n_rows, n_cols,
    stride_gate, stride_up, stride_out,
    ACTIVATION: tl.constexpr, OUTPUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LIMIT: tl.constexpr = None, MANT_BITS: tl.constexpr = None, EXP_BIAS: tl.constexpr = None,
):
    """``act(gate) · up``, rounded to the inputs' dtype, and per ``OUTPUT``: stored in ``OUT``
    (``"store"``); its largest magnitude folded into ``SCALE [1]`` by atomic maximum (``"amax"``);
    or times ``SCALE [1]``, saturated and stored as FP8 bytes in ``OUT`` (``"fp8"``, the format of
    :func:`tigon.ops.fp8.fp8_format`)."""
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    gate = tl.load(GATE + rows * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + rows * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = gate_activation(gate, ACTIVATION)
    out = (act * up).to(GATE.dtype.element_ty)
    if OUTPUT == "amax":
        tl.atomic_max(SCALE, tile_amax(out))
    elif OUTPUT == "fp8":
        code = saturated_fp8_code(out.to(tl.float32), tl.load(SCALE), LIMIT, MANT_BITS, EXP_BIAS)
        tl.store(OUT + rows * stride_out + cols, code, mask=mask)
    else:
        tl.store(OUT + rows * stride_out + cols, out, mask=mask)


@triton.jit
def gated_bwd_kernel(
    GATE, UP, DOUT, DGATE, DUP, SCALES,
    n_rows, n_cols,
    stride_gate, stride_up, stride_dout, stride_dgate, stride_dup,
    ACTIVATION: tl.constexpr, STORE_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    OUTPUT: tl.constexpr = "store",
    LIMIT: tl.constexpr = None, MANT_BITS: tl.constexpr = None, EXP_BIAS: tl.constexpr = None,
):
    """``d_gate`` and ``d_up``, per ``OUTPUT`` as :func:`gated_fwd_kernel`'s product: stored
    (``"store"``); rounded to the inputs' dtype, their largest magnitudes folded into ``SCALES
    [2]`` (``"amax"``); or rounded, times ``SCALES [2]`` and stored as FP8 bytes (``"fp8"``), or
    as pairs of them over ``DOUT`` (``"fp8_pairs"``: ``DGATE`` is ``DOUT``'s bytes, and element
    ``(r, c)`` of ``d_gate`` is the first byte of ``DOUT[r, c]``, ``d_up``'s the second)."""
    # DGATE and DUP may be GATE and UP themselves: every element is loaded before the stores
    # that depend on it, and tiles of different programs do not overlap. With STORE_OUT, the
    # forward's output act(gate)·up is recomputed over DOUT, by the same reasoning.
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    gate = tl.load(GATE + rows * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + rows * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + rows * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    act, act_grad = gate_activation(gate, ACTIVATION)
    d_up = dout * act
    d_gate = dout * up * act_grad
    if OUTPUT == "store":
        tl.store(DUP + rows * stride_dup + cols, d_up.to(DUP.dtype.element_ty), mask=mask)
        tl.store(DGATE + rows * stride_dgate + cols, d_gate.to(DGATE.dtype.element_ty), mask=mask)
    else:
        # torchao casts the gradients autograd would hand it: rounded to the 16-bit dtype first.
        d_gate = d_gate.to(GATE.dtype.element_ty).to(tl.float32)
        d_up = d_up.to(GATE.dtype.element_ty).to(tl.float32)
        if OUTPUT == "amax":
            tl.atomic_max(SCALES, tile_amax(d_gate))
            tl.atomic_max(SCALES + 1, tile_amax(d_up))
        else:
            gate_code = saturated_fp8_code(d_gate, tl.load(SCALES), LIMIT, MANT_BITS, EXP_BIAS)
            up_code = saturated_fp8_code(d_up, tl.load(SCALES + 1), LIMIT, MANT_BITS, EXP_BIAS)
            if OUTPUT == "fp8":
                tl.store(DGATE + rows * stride_dgate + cols, gate_code, mask=mask)
                tl.store(DUP + rows * stride_dup + cols, up_code, mask=mask)
            else:
                pairs = DGATE + rows * stride_dgate + 2 * cols
                tl.store(pairs, gate_code, mask=mask)
                tl.store(pairs + 1, up_code, mask=mask)
    if STORE_OUT:
        tl.store(DOUT + rows * stride_dout + cols, (act * up).to(DOUT.dtype.element_ty), mask=mask)


@functools.cache
def clamp_passes_at_limit() -> bool:
    """Whether the installed torch's ``torch.clamp`` passes the gradient of an input equal to a
    (scalar) limit: yes up to torch 2.13, no from 2.14. Asked of torch once, on a CPU scalar
    (launchers call it where autograd may be off: inside a backward, or under ``no_grad``)."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.ones((), requires_grad=True)
        (grad,) = torch.autograd.grad(x.clamp(max=1.0), x)
    return bool(grad == 1)


@triton.jit
def swiglu_clamped_math(gate, up, alpha, limit):
    """GPT-OSS's clamped SwiGLU on fp32 tiles: ``(û + 1)·ĝ·σ(α·ĝ)`` with ``ĝ = min(gate, limit)``
    and ``û = clamp(up, −limit, limit)``. NaN propagates, as through ``torch.clamp`` (a comparison
    with NaN is false, so the value is kept)."""
    gate_c = tl.where(gate > limit, limit, gate)
    up_c = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    return (up_c + 1.0) * (gate_c * tl.sigmoid(alpha * gate_c))


@triton.jit
def swiglu_clamped_grads(gate, up, dout, alpha, limit, PASS_AT_LIMIT: tl.constexpr):
    """``(d_gate, d_up, out)`` of :func:`swiglu_clamped_math` for the incoming gradient ``dout``
    (fp32 tiles). A clamped input gets exactly 0, whatever ``dout`` holds, as from ``torch.clamp``;
    an input equal to a limit passes its gradient where ``PASS_AT_LIMIT`` (:func:`clamp_passes_at_limit`)."""
    gate_c = tl.where(gate > limit, limit, gate)
    up_c = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    s = tl.sigmoid(alpha * gate_c)
    glu = gate_c * s
    if PASS_AT_LIMIT:
        gate_passes = gate <= limit
        up_passes = (up >= -limit) & (up <= limit)
    else:
        gate_passes = gate < limit
        up_passes = (up > -limit) & (up < limit)
    # d(ĝ·σ(α·ĝ))/dĝ = s + ĝ·α·s·(1 − s): the derivative of g·σ(z(g)) with z' = α (module docstring).
    d_gate = tl.where(gate_passes, dout * (up_c + 1.0) * s * (1.0 + alpha * gate_c * (1.0 - s)), 0.0)
    d_up = tl.where(up_passes, dout * glu, 0.0)
    return d_gate, d_up, (up_c + 1.0) * glu


@triton.jit
def _pair_tile(rows, cols, mask, stride):
    """Offsets and mask ``[BLOCK_M, BLOCK_N, 2]`` of the interleaved (gate, up) pairs of the output
    tile ``rows × cols``: both are loaded (or stored) at once and split (or joined) in registers."""
    pair = tl.arange(0, 2)
    offsets = (rows * stride + 2 * cols)[:, :, None] + pair[None, None, :]
    return offsets, mask[:, :, None] & (pair < 2)[None, None, :]


@triton.jit
def swiglu_clamped_fwd_kernel(
    GATE_UP, OUT,
    n_rows, n_cols,
    stride_gate_up, stride_out,
    alpha, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    pairs, pair_mask = _pair_tile(rows, cols, mask, stride_gate_up)
    gate, up = tl.split(tl.load(GATE_UP + pairs, mask=pair_mask, other=0.0).to(tl.float32))
    out = swiglu_clamped_math(gate, up, alpha, limit)
    tl.store(OUT + rows * stride_out + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_clamped_bwd_kernel(
    GATE_UP, DOUT, D_GATE_UP,
    n_rows, n_cols,
    stride_gate_up, stride_dout, stride_d_gate_up,
    alpha, limit,
    PASS_AT_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # D_GATE_UP may be GATE_UP itself: each pair is loaded before its gradient is stored over it.
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    pairs, pair_mask = _pair_tile(rows, cols, mask, stride_gate_up)
    gate, up = tl.split(tl.load(GATE_UP + pairs, mask=pair_mask, other=0.0).to(tl.float32))
    dout = tl.load(DOUT + rows * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    d_gate, d_up, _ = swiglu_clamped_grads(gate, up, dout, alpha, limit, PASS_AT_LIMIT)
    d_pairs, _ = _pair_tile(rows, cols, mask, stride_d_gate_up)
    tl.store(D_GATE_UP + d_pairs, tl.join(d_gate, d_up).to(D_GATE_UP.dtype.element_ty), mask=pair_mask)


@triton.jit
def relu2_fwd_kernel(
    X, OUT,
    n_rows, n_cols,
    stride_x, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    relu = tl.where(x < 0.0, 0.0, x)  # NaN is kept, as by torch.relu
    tl.store(OUT + rows * stride_out + cols, (relu * relu).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def relu2_bwd_kernel(
    X, DOUT, DX,
    n_rows, n_cols,
    stride_x, stride_dout, stride_dx,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # DX may be X itself: every element is loaded before its gradient is stored over it.
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + rows * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    relu = tl.where(x < 0.0, 0.0, x)
    tl.store(DX + rows * stride_dx + cols, (2.0 * relu * dout).to(DX.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=4096)
def _launch_config(n_rows: int, n_cols: int) -> tuple[tuple[int], int, int, int]:
    """Grid, ``BLOCK_M``, ``BLOCK_N`` and warps for tiles of ~ELEMENTS_PER_PROGRAM elements.

    Short rows stack several per tile. Long rows are cut into the width (1K to 4K) that pads them
    least, so that no program runs half empty: 14336 = 7 × 2048, where 4096 would pad by 1/8.
    """
    widest = min(next_power_of_2(max(n_cols, 1)), ELEMENTS_PER_PROGRAM)
    widths = [width for width in (widest, widest // 2, widest // 4) if width >= min(widest, 1024)]
    block_n = min(widths, key=lambda width: cdiv(n_cols, width) * width)
    block_m = min(ELEMENTS_PER_PROGRAM // block_n, next_power_of_2(max(n_rows, 1)))
    num_warps = max(1, min(8, block_m * block_n // ELEMENTS_PER_WARP))
    grid = (cdiv(n_rows, block_m) * cdiv(n_cols, block_n),)
    return grid, block_m, block_n, num_warps


def _gated_fwd_fake(gate, up, activation):
    return gate.new_empty(gate.shape)


@tigon_op("gated_fwd", fake=_gated_fwd_fake)
def gated_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``gate, up [N, I]`` row views (unit column stride) → ``act(gate) · up [N, I]``, contiguous."""
    n_rows, n_cols = gate.shape
    out = gate.new_empty((n_rows, n_cols))
    grid, block_m, block_n, num_warps = _launch_config(n_rows, n_cols)
    launch(
        gated_fwd_kernel, grid,
        gate, up, out, None,
        n_rows, n_cols,
        gate.stride(0), up.stride(0), out.stride(0),
        ACTIVATION=activation, OUTPUT="store", BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out


def _gated_fwd_fp8_fake(gate, up, activation, dtype, power_of_2):
    return gate.new_empty(gate.shape, dtype=dtype), gate.new_empty((), dtype=torch.float32)


@tigon_op("gated_fwd_fp8", fake=_gated_fwd_fp8_fake)
def gated_fwd_fp8(
    gate: torch.Tensor, up: torch.Tensor, activation: str, dtype: torch.dtype, power_of_2: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate, up [N, I]`` row views → ``act(gate) · up`` as torchao's tensorwise cast makes it
    from the product rounded to ``gate``'s dtype: FP8 ``dtype [N, I]`` (contiguous) times ``scale
    = max(dtype) / amax`` over the whole tensor (fp64, floored to a power of two with
    ``power_of_2``), and ``scale`` (fp32, 0-d). Two reads of the inputs (the amax, then the cast);
    the 16-bit product is never stored."""
    n_rows, n_cols = gate.shape
    out = gate.new_empty((n_rows, n_cols), dtype=dtype)
    grid, block_m, block_n, num_warps = _launch_config(n_rows, n_cols)

    def run(output, scale):
        launch(
            gated_fwd_kernel, grid,
            gate, up, out.view(torch.uint8), scale,
            n_rows, n_cols,
            gate.stride(0), up.stride(0), out.stride(0),
            ACTIVATION=activation, OUTPUT=output, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
            **fp8_format(dtype),
        )

    amax = gate.new_zeros(1, dtype=torch.float32)
    run("amax", amax)
    scale, _ = fp8_scales(amax, torch.finfo(dtype).max, power_of_2)
    run("fp8", scale)
    return out, scale.reshape(())


def _launch_bwd(dout, gate, up, d_gate, d_up, activation, store_out=False, output="store", scales=None,
                fp8_dtype=None):
    """:func:`gated_bwd_kernel` over ``[N, I]`` row views; ``fp8_dtype`` is the format the
    ``"fp8"`` and ``"fp8_pairs"`` outputs store (as bytes: ``d_gate`` and ``d_up`` are then byte
    views)."""
    n_rows, n_cols = gate.shape
    grid, block_m, block_n, num_warps = _launch_config(n_rows, n_cols)
    launch(
        gated_bwd_kernel, grid,
        gate, up, dout, d_gate, d_up, scales,
        n_rows, n_cols,
        gate.stride(0), up.stride(0), dout.stride(0), d_gate.stride(0), d_up.stride(0),
        ACTIVATION=activation, STORE_OUT=store_out, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        OUTPUT=output, **(fp8_format(fp8_dtype) if fp8_dtype is not None else {}),
    )


def _gated_bwd_fake(dout, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@tigon_op("gated_bwd", fake=_gated_bwd_fake)
def gated_bwd(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dout, gate, up [N, I]`` row views → ``(d_gate, d_up)``, new contiguous ``[N, I]``."""
    d_gate, d_up = gate.new_empty(gate.shape), gate.new_empty(gate.shape)
    _launch_bwd(dout, gate, up, d_gate, d_up, activation)
    return d_gate, d_up


@tigon_op("gated_bwd_inplace", mutates_args=("gate", "up"))
def gated_bwd_inplace(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    """As :func:`gated_bwd`, but ``d_gate`` overwrites ``gate`` and ``d_up`` overwrites ``up``."""
    _launch_bwd(dout, gate, up, gate, up, activation)


def _gated_bwd_fp8_fake(dout, gate, up, activation, dtype, power_of_2):
    d_gate, d_up = (gate.new_empty(gate.shape, dtype=dtype) for _ in range(2))
    return d_gate, d_up, gate.new_empty(2, dtype=torch.float32)


@tigon_op("gated_bwd_fp8", fake=_gated_bwd_fp8_fake)
def gated_bwd_fp8(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, dtype: torch.dtype,
    power_of_2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`gated_bwd`, each gradient cast as torchao's tensorwise cast makes it from the
    gradient rounded to ``gate``'s dtype (see :func:`gated_fwd_fp8`): ``(d_gate, d_up)`` in FP8
    ``dtype [N, I]`` (contiguous) and their scales ``[2]`` (fp32). Two reads of the inputs; the
    16-bit gradients are never stored."""
    d_gate, d_up = (gate.new_empty(gate.shape, dtype=dtype) for _ in range(2))
    scales = _gated_bwd_fp8_scales(dout, gate, up, activation, dtype, power_of_2)
    _launch_bwd(dout, gate, up, d_gate.view(torch.uint8), d_up.view(torch.uint8), activation, output="fp8",
                scales=scales, fp8_dtype=dtype)
    return d_gate, d_up, scales


def _gated_bwd_fp8_scales(dout, gate, up, activation, dtype, power_of_2):
    """The scales ``[2]`` (fp32) of the tensorwise casts of ``d_gate`` and ``d_up``: one read of
    the inputs for their largest magnitudes."""
    amax = gate.new_zeros(2, dtype=torch.float32)
    _launch_bwd(dout, gate, up, amax, amax, activation, output="amax", scales=amax)
    scales, _ = fp8_scales(amax, torch.finfo(dtype).max, power_of_2)
    return scales


def _gated_bwd_fp8_inplace_fake(dout, gate, up, activation, dtype, power_of_2):
    return gate.new_empty(2, dtype=torch.float32)


@tigon_op("gated_bwd_fp8_inplace", fake=_gated_bwd_fp8_inplace_fake, mutates_args=("dout",))
def gated_bwd_fp8_inplace(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, dtype: torch.dtype,
    power_of_2: bool,
) -> torch.Tensor:
    """As :func:`gated_bwd_fp8`, but the two FP8 gradients overwrite ``dout`` (16-bit, rows that do
    not overlap): element ``(r, c)`` of each takes one of ``dout[r, c]``'s two bytes, which the
    same program has just read (:func:`fp8_pairs_of` gives them as tensors). Returns the scales
    ``[2]``; nothing of ``[N, I]`` is allocated."""
    scales = _gated_bwd_fp8_scales(dout, gate, up, activation, dtype, power_of_2)
    pairs = dout.view(torch.uint8)
    _launch_bwd(dout, gate, up, pairs, pairs, activation, output="fp8_pairs", scales=scales, fp8_dtype=dtype)
    return scales


def fp8_pairs_of(dout: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_gate, d_up)``, FP8 ``dtype [N, I]`` views (column stride 2) of the bytes
    :func:`gated_bwd_fp8_inplace` wrote over ``dout [N, I]``. A matmul takes them through a
    contiguous copy, which exists only while it runs."""
    pairs = dout.view(dtype)
    return pairs[:, 0::2], pairs[:, 1::2]


def _gated_bwd_recompute_fake(dout, gate, up, activation, inplace):
    return gate.new_empty(0 if inplace else gate.shape), gate.new_empty(0 if inplace else gate.shape)


@tigon_op("gated_bwd_recompute", fake=_gated_bwd_recompute_fake, mutates_args=("dout", "gate", "up"))
def gated_bwd_recompute(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, inplace: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`gated_bwd`, and ``dout [N, I]`` (contiguous) is overwritten by the forward's
    output ``act(gate) · up``. With ``inplace``, ``d_gate`` and ``d_up`` overwrite ``gate`` and
    ``up`` and the returned tensors are empty."""
    d_gate, d_up = (gate, up) if inplace else (gate.new_empty(gate.shape), gate.new_empty(gate.shape))
    _launch_bwd(dout, gate, up, d_gate, d_up, activation, store_out=True)
    return (gate.new_empty(0), up.new_empty(0)) if inplace else (d_gate, d_up)


def _swiglu_clamped_fwd_fake(gate_up, alpha, limit):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@tigon_op("swiglu_clamped_fwd", fake=_swiglu_clamped_fwd_fake)
def swiglu_clamped_fwd(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``gate_up [N, 2I]`` row view (unit column stride, interleaved) → ``out [N, I]``, contiguous."""
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((n_rows, n_cols))
    grid, block_m, block_n, num_warps = _launch_config(n_rows, n_cols)
    launch(
        swiglu_clamped_fwd_kernel, grid,
        gate_up, out,
        n_rows, n_cols,
        gate_up.stride(0), out.stride(0),
        alpha, limit,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out


def _launch_swiglu_clamped_bwd(dout, gate_up, d_gate_up, alpha, limit):
    n_rows, n_cols = dout.shape
    grid, block_m, block_n, num_warps = _launch_config(n_rows, n_cols)
    launch(
        swiglu_clamped_bwd_kernel, grid,
        gate_up, dout, d_gate_up,
        n_rows, n_cols,
        gate_up.stride(0), dout.stride(0), d_gate_up.stride(0),
        alpha, limit,
        PASS_AT_LIMIT=clamp_passes_at_limit(), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )


def _swiglu_clamped_bwd_fake(dout, gate_up, alpha, limit):
    return gate_up.new_empty(gate_up.shape)


@tigon_op("swiglu_clamped_bwd", fake=_swiglu_clamped_bwd_fake)
def swiglu_clamped_bwd(dout: torch.Tensor, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``dout [N, I]``, ``gate_up [N, 2I]`` row views → ``d_gate_up [N, 2I]`` (interleaved), new and contiguous."""
    d_gate_up = gate_up.new_empty(gate_up.shape)
    _launch_swiglu_clamped_bwd(dout, gate_up, d_gate_up, alpha, limit)
    return d_gate_up


@tigon_op("swiglu_clamped_bwd_inplace", mutates_args=("gate_up",))
def swiglu_clamped_bwd_inplace(dout: torch.Tensor, gate_up: torch.Tensor, alpha: float, limit: float) -> None:
    """As :func:`swiglu_clamped_bwd`, but ``d_gate_up`` overwrites ``gate_up``."""
    _launch_swiglu_clamped_bwd(dout, gate_up, gate_up, alpha, limit)


def _relu2_fwd_fake(x):
    return x.new_empty(x.shape)


@tigon_op("relu2_fwd", fake=_relu2_fwd_fake)
def relu2_fwd(x: torch.Tensor) -> torch.Tensor:
    """``x [N, I]`` row view (unit column stride) → ``relu(x)² [N, I]``, contiguous."""
    n_rows, n_cols = x.shape
    out = x.new_empty((n_rows, n_cols))
    grid, block_m, block_n, num_warps = _launch_config(n_rows, n_cols)
    launch(
        relu2_fwd_kernel, grid,
        x, out, n_rows, n_cols, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out


def _launch_relu2_bwd(dout, x, dx):
    n_rows, n_cols = x.shape
    grid, block_m, block_n, num_warps = _launch_config(n_rows, n_cols)
    launch(
        relu2_bwd_kernel, grid,
        x, dout, dx, n_rows, n_cols, x.stride(0), dout.stride(0), dx.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )


def _relu2_bwd_fake(dout, x):
    return x.new_empty(x.shape)


@tigon_op("relu2_bwd", fake=_relu2_bwd_fake)
def relu2_bwd(dout: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dout, x [N, I]`` row views → ``dx [N, I]``, new and contiguous."""
    dx = x.new_empty(x.shape)
    _launch_relu2_bwd(dout, x, dx)
    return dx


@tigon_op("relu2_bwd_inplace", mutates_args=("x",))
def relu2_bwd_inplace(dout: torch.Tensor, x: torch.Tensor) -> None:
    """As :func:`relu2_bwd`, but ``dx`` overwrites ``x``."""
    _launch_relu2_bwd(dout, x, x)


def _gated_grads(ctx, dout):
    """The backward of :class:`GatedFunction` and :class:`GatedFp8Function`: ``d_gate`` and
    ``d_up`` (over the saved ``gate`` and ``up`` with ``inplace_backward``), ``None`` for the rest."""
    gate_rows, up_rows = ctx.saved_tensors
    dout_rows = as_rows(dout)
    if ctx.inplace_backward:
        gated_bwd_inplace(dout_rows, gate_rows, up_rows, ctx.activation)
        d_gate, d_up = gate_rows, up_rows
    else:
        d_gate, d_up = gated_bwd(dout_rows, gate_rows, up_rows, ctx.activation)
    return (
        d_gate.view(dout.shape) if ctx.needs_input_grad[0] else None,
        d_up.view(dout.shape) if ctx.needs_input_grad[1] else None,
        *[None] * (len(ctx.needs_input_grad) - 2),
    )


class GatedFunction(torch.autograd.Function):
    """Saves ``gate`` and ``up`` as ``[rows, cols]`` views; ``act(gate)`` is recomputed in backward.

    The row views are taken here rather than in the launchers so that the in-place backward
    writes into the very tensors it returns as gradients (``as_rows`` copies only layouts that
    have no row view, and then the copy is private to this function).
    """

    @staticmethod
    def forward(ctx, gate, up, activation, inplace_backward):
        gate_rows, up_rows = as_rows(gate), as_rows(up)
        out = gated_fwd(gate_rows, up_rows, activation)
        ctx.save_for_backward(gate_rows, up_rows)
        ctx.activation = activation
        ctx.inplace_backward = inplace_backward
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, dout):
        return _gated_grads(ctx, dout)


# In torch.compile's graph as it is, as torchao's matmul: dynamo's own trace of the backward would
# guess the output's gradient to be an FP8 tensor like the output, where autograd gives 16 bits.
@torch._dynamo.allow_in_graph
class GatedFp8Function(torch.autograd.Function):
    """:class:`GatedFunction` whose output, or whose gradients, or both, are the FP8 operands of
    the matmuls next to it, cast in the gate's kernels as :class:`tigon.ops.fp8.Fp8Cast` objects say:

    - ``output_cast``: the product as the next matmul's input (:func:`gated_fwd_fp8`); the 16-bit
      product is never stored. Its gradient passes straight through the cast, as through
      torchao's own.
    - ``grad_casts``: ``d_gate`` and ``d_up`` (one FP8 dtype and scale rule) as the output gradients of the
      matmuls that made ``gate`` and ``up`` (:func:`gated_bwd_fp8`); the 16-bit gradients are never
      stored, and ``gate`` and ``up`` are freed with this function's backward. With
      ``inplace_backward`` both are written over the incoming gradient
      (:func:`gated_bwd_fp8_inplace`), which then holds them until their matmuls have run.

    ``None`` leaves that side in 16 bits. Saved: ``gate`` and ``up``, as :class:`GatedFunction`."""

    @staticmethod
    def forward(ctx, gate, up, activation, inplace_backward, output_cast, grad_casts):
        gate_rows, up_rows = as_rows(gate), as_rows(up)
        ctx.save_for_backward(gate_rows, up_rows)
        ctx.activation = activation
        ctx.inplace_backward = inplace_backward
        ctx.grad_casts = grad_casts
        if output_cast is None:
            return gated_fwd(gate_rows, up_rows, activation).view(gate.shape)
        data, scale = gated_fwd_fp8(gate_rows, up_rows, activation, output_cast.dtype, output_cast.power_of_2)
        return output_cast.wrap(data.view(gate.shape), scale)

    @staticmethod
    def backward(ctx, dout):
        if ctx.grad_casts is None:
            return _gated_grads(ctx, dout)
        gate_rows, up_rows = ctx.saved_tensors
        gate_cast, up_cast = ctx.grad_casts
        dout_rows = as_rows(dout)
        # Two FP8 bytes fit in each element of a 16-bit gradient whose rows do not overlap.
        if ctx.inplace_backward and dout_rows.element_size() == 2 and dout_rows.stride(0) >= dout_rows.shape[1]:
            scales = gated_bwd_fp8_inplace(
                dout_rows, gate_rows, up_rows, ctx.activation, gate_cast.dtype, gate_cast.power_of_2,
            )
            d_gate, d_up = fp8_pairs_of(dout_rows, gate_cast.dtype)
        else:
            d_gate, d_up, scales = gated_bwd_fp8(
                dout_rows, gate_rows, up_rows, ctx.activation, gate_cast.dtype, gate_cast.power_of_2,
            )
        return (
            gate_cast.wrap(d_gate.view(dout.shape), scales[0]) if ctx.needs_input_grad[0] else None,
            up_cast.wrap(d_up.view(dout.shape), scales[1]) if ctx.needs_input_grad[1] else None,
            None, None, None, None,
        )


class SwiGLUClampedFunction(torch.autograd.Function):
    """Saves ``gate_up`` as a ``[rows, 2I]`` view (see :class:`GatedFunction` on why here); the
    activation is recomputed in backward."""

    @staticmethod
    def forward(ctx, gate_up, alpha, limit, inplace_backward):
        gate_up_rows = as_rows(gate_up)
        out = swiglu_clamped_fwd(gate_up_rows, alpha, limit)
        ctx.save_for_backward(gate_up_rows)
        ctx.alpha, ctx.limit, ctx.inplace_backward = alpha, limit, inplace_backward
        return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dout):
        (gate_up_rows,) = ctx.saved_tensors
        dout_rows = as_rows(dout)
        if ctx.inplace_backward:
            swiglu_clamped_bwd_inplace(dout_rows, gate_up_rows, ctx.alpha, ctx.limit)
            d_gate_up = gate_up_rows
        else:
            d_gate_up = swiglu_clamped_bwd(dout_rows, gate_up_rows, ctx.alpha, ctx.limit)
        return d_gate_up.view(*dout.shape[:-1], 2 * dout.shape[-1]), None, None, None


class ReLU2Function(torch.autograd.Function):
    """Saves ``x`` as a ``[rows, cols]`` view (see :class:`GatedFunction`); ``relu(x)`` is
    recomputed in backward."""

    @staticmethod
    def forward(ctx, x, inplace_backward):
        x_rows = as_rows(x)
        out = relu2_fwd(x_rows)
        ctx.save_for_backward(x_rows)
        ctx.inplace_backward = inplace_backward
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dout):
        (x_rows,) = ctx.saved_tensors
        dout_rows = as_rows(dout)
        if ctx.inplace_backward:
            relu2_bwd_inplace(dout_rows, x_rows)
            dx = x_rows
        else:
            dx = relu2_bwd(dout_rows, x_rows)
        return dx.view(dout.shape), None


class GatedLinearFunction(torch.autograd.Function):
    """``(act(gate) · up) @ weightᵀ (+ bias)``; saves ``gate``, ``up`` and ``weight`` only (the
    product is recomputed in backward, see the module docstring)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, activation, inplace_backward):
        gate_rows, up_rows = as_rows(gate), as_rows(up)
        out = torch.nn.functional.linear(gated_fwd(gate_rows, up_rows, activation), weight, bias)
        ctx.save_for_backward(gate_rows, up_rows, weight)
        ctx.activation, ctx.inplace_backward = activation, inplace_backward
        ctx.has_bias = bias is not None
        return out.view(*gate.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dout):
        gate_rows, up_rows, weight = ctx.saved_tensors
        dout_rows = as_rows(dout)
        # dh, then h itself in the same buffer once the kernel has read dh.
        dh_then_h = dout_rows @ weight
        d_gate, d_up = gated_bwd_recompute(dh_then_h, gate_rows, up_rows, ctx.activation, ctx.inplace_backward)
        if ctx.inplace_backward:
            d_gate, d_up = gate_rows, up_rows
        grad_weight = dout_rows.T @ dh_then_h if ctx.needs_input_grad[2] else None
        grad_bias = dout_rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        shape = (*dout.shape[:-1], gate_rows.shape[1])
        return (
            d_gate.view(shape) if ctx.needs_input_grad[0] else None,
            d_up.view(shape) if ctx.needs_input_grad[1] else None,
            grad_weight, grad_bias, None, None,
        )


class GatedMLPFunction(torch.autograd.Function):
    """``down(act(x @ gateᵀ) · (x @ upᵀ))`` keeping nothing but its inputs (see :func:`gated_mlp`),
    each projection with an optional LoRA adapter (:mod:`tigon.ops.lora`).

    Backward recomputes the projections one slice of the intermediate dimension at a time, so
    its working set is a few ``[N, slice]`` tensors instead of four ``[N, I]`` ones. Per slice
    ``s`` (rows of ``gate`` and ``up``, columns of ``down``)::

        [g | u]  = x @ [gate_s; up_s]ᵀ           one matmul over the concatenated weight slices
        dh       = dout @ down_s
        dg, du   = gated backward (over g, u);   h = act(g) · u (over dh)
        d_down_s = doutᵀ @ h,   d_gate_s = dgᵀ @ x,   d_up_s = duᵀ @ x
        dx      += [dg | du] @ [gate_s; up_s]

    The weight gradients are exact slices (each reduces over all ``N`` rows); only ``dx`` is a
    sum over slices. The adapters' terms are in :class:`_GatedMLPBackward`.

    With ``tile_rows`` (long sequences), forward and backward run over tiles of that many rows
    (tokens), so no ``[N, I]`` tensor exists, only ``[tile_rows, I]`` ones: each row's output and
    ``dx`` are computed within its tile, and the weight gradients are summed over the tiles in fp32.
    """

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, gate_a, gate_b, up_a, up_b, down_a, down_b,
                scalings, activation, slice_width, tile_rows):
        save_inputs(ctx, x, gate_weight, up_weight, down_weight, gate_a, gate_b, up_a, up_b, down_a, down_b)
        ctx.scalings, ctx.activation, ctx.slice_width, ctx.tile_rows = scalings, activation, slice_width, tile_rows
        x_rows = as_rows(x)
        gate_adapter, up_adapter, down_adapter = _lora.adapters(
            x.dtype, (gate_a, gate_b, up_a, up_b, down_a, down_b), scalings
        )
        out = x_rows.new_empty(x_rows.shape[0], down_weight.shape[0])
        for rows in token_tiles(x_rows.shape[0], tile_rows):
            x_tile = x_rows[rows]
            gate, up = x_tile @ gate_weight.T, x_tile @ up_weight.T
            u_gate, u_up = _lora.down_project(x_tile, gate_adapter, up_adapter)
            _lora.add_adapter_(gate, u_gate, gate_adapter)
            _lora.add_adapter_(up, u_up, up_adapter)
            h = gated_fwd(gate, up, activation)
            del gate, up
            torch.mm(h, down_weight.T, out=out[rows])
            _lora.add_adapter_(out[rows], *_lora.down_project(h, down_adapter), down_adapter)
        return out.view(*x.shape[:-1], down_weight.shape[0])

    @staticmethod
    def backward(ctx, dout):
        x, *tensors = kept_tensors(ctx)
        x_rows, dout_rows = as_rows(x), as_rows(dout)
        tiles = token_tiles(x_rows.shape[0], ctx.tile_rows)
        if len(tiles) == 1:
            grad_x, grads = _GatedMLPBackward(ctx, x_rows, dout_rows, tensors).run()
        else:
            grad_x = x_rows.new_empty(x_rows.shape) if kept_x_needs_grad(ctx) else None
            totals: list = []
            for rows in tiles:
                tile_out = None if grad_x is None else grad_x[rows]
                _, tile_grads = _GatedMLPBackward(ctx, x_rows[rows], dout_rows[rows], tensors, tile_out).run()
                # Each tile's weight gradients are exact over its rows; their sum over tiles is in fp32.
                if not totals:
                    totals = [None if grad is None else grad.float() for grad in tile_grads]
                else:
                    for total, grad in zip(totals, tile_grads):
                        if grad is not None:
                            total.add_(grad)
            grads = [None if total is None else total.to(t.dtype) for total, t in zip(totals, tensors)]
        grad_x = None if grad_x is None else grad_x.view(x.shape)
        return grad_x, *grads, None, None, None, None


class _GatedMLPBackward:
    """The backward of :class:`GatedMLPFunction`, one slice of the intermediate dimension at a time.

    With an adapter ``y = x Wᵀ + s·(x Aᵀ) Bᵀ`` on a projection whose output gradient is ``dy``::

        dB = s · dyᵀ (x Aᵀ),   dA = s · (dy B)ᵀ x,   dx += s · (dy B) A

    For gate and up, ``dy`` (``dg``, ``du``) exists one slice at a time: ``dB``'s rows are exact
    slices and ``dy B`` (``[N, r]``) is summed over the slices, then ``dA`` and the ``dx`` term
    follow once. For down, ``dy = dout`` is whole and ``h`` comes in slices: ``dout B`` is
    computed first (it adds ``s · (dout B) A_s`` to each slice's ``dh``), ``dA``'s columns are exact
    slices and ``h Aᵀ`` is summed over the slices for ``dB``.
    """

    def __init__(self, ctx, x, dout, tensors, grad_x_out=None):
        self.activation, self.slice_width, self.grad_x_out = ctx.activation, ctx.slice_width, grad_x_out
        self.x_rows, self.dout_rows = as_rows(x), as_rows(dout)
        self.x_shape, self.need_x = x.shape, kept_x_needs_grad(ctx)
        self.weights, self.lora_tensors = tensors[:3], tensors[3:]
        self.gate, self.up, self.down = _lora.adapters(x.dtype, self.lora_tensors, ctx.scalings)
        needs = ctx.needs_input_grad[1:10]
        self.grads = [torch.empty_like(w) if need else None for w, need in zip(self.weights, needs[:3])]
        # Adapter gradients in the compute dtype (cast to each adapter's own dtype at the end).
        self.lora_grads = [
            torch.empty(t.shape, dtype=x.dtype, device=x.device) if t is not None and need else None
            for t, need in zip(self.lora_tensors, needs[3:])
        ]
        self.grad_x = None
        self.u_gate, self.u_up = _lora.down_project(self.x_rows, self.gate, self.up)
        self.dy_b_gate, self.dy_b_up = (
            None if adapter is None else self.x_rows.new_zeros(self.x_rows.shape[0], adapter.rank)
            for adapter in (self.gate, self.up)
        )
        if self.down is not None:
            self.dout_b = self.dout_rows @ self.down.b * self.down.scaling
            self.u_down = self.x_rows.new_zeros(self.x_rows.shape[0], self.down.rank)

    def add_slice(self, rows):
        gate_weight, up_weight, down_weight = self.weights
        grad_gate, grad_up, grad_down = self.grads
        x_rows, dout_rows = self.x_rows, self.dout_rows
        gate_up_weight = torch.cat((gate_weight[rows], up_weight[rows]))
        width = gate_up_weight.shape[0] // 2
        gate_up = x_rows @ gate_up_weight.T
        gate, up = gate_up[:, :width], gate_up[:, width:]
        _lora.add_adapter_(gate, self.u_gate, self.gate, rows)
        _lora.add_adapter_(up, self.u_up, self.up, rows)
        dh_then_h = dout_rows @ down_weight[:, rows]
        if self.down is not None:
            dh_then_h.addmm_(self.dout_b, self.down.a[:, rows])
        gated_bwd_recompute(dh_then_h, gate, up, self.activation, True)  # gate_up is now [d_gate | d_up]
        if grad_down is not None:
            grad_down[:, rows] = dout_rows.T @ dh_then_h
        if self.down is not None:
            if self.lora_grads[4] is not None:
                self.lora_grads[4][:, rows] = self.dout_b.T @ dh_then_h
            self.u_down.addmm_(dh_then_h, self.down.a[:, rows].T)
        if grad_gate is not None:
            torch.mm(gate.T, x_rows, out=grad_gate[rows])
        if grad_up is not None:
            torch.mm(up.T, x_rows, out=grad_up[rows])
        for adapter, dy, u, dy_b, grad_b in (
            (self.gate, gate, self.u_gate, self.dy_b_gate, self.lora_grads[1]),
            (self.up, up, self.u_up, self.dy_b_up, self.lora_grads[3]),
        ):
            if adapter is not None:
                if grad_b is not None:
                    torch.mm(dy.T, u, out=grad_b[rows])
                dy_b.addmm_(dy, adapter.b[rows])
        if self.need_x:
            self.grad_x = (
                torch.mm(gate_up, gate_up_weight, out=self.grad_x_out) if self.grad_x is None
                else self.grad_x.addmm_(gate_up, gate_up_weight)
            )

    def run(self):
        """``(grad_x, grads of the 3 weights and 6 adapter tensors)``: every slice, then :meth:`finish`."""
        for start in range(0, self.weights[0].shape[0], self.slice_width):
            # In a call of its own, so that a slice's tensors are freed before the next one's exist.
            self.add_slice(slice(start, start + self.slice_width))
        return self.finish()

    def finish(self):
        """``(grad_x, grads of the 3 weights and 6 adapter tensors)`` once every slice is in."""
        grad_a_gate, grad_b_gate, grad_a_up, grad_b_up, grad_a_down, grad_b_down = self.lora_grads
        for adapter, dy_b, grad_a, grad_b in (
            (self.gate, self.dy_b_gate, grad_a_gate, grad_b_gate), (self.up, self.dy_b_up, grad_a_up, grad_b_up),
        ):
            if adapter is None:
                continue
            dy_b.mul_(adapter.scaling)
            if grad_b is not None:
                grad_b.mul_(adapter.scaling)
            if grad_a is not None:
                torch.mm(dy_b.T, self.x_rows, out=grad_a)
            if self.need_x:
                self.grad_x.addmm_(dy_b, adapter.a)
        if self.down is not None and grad_b_down is not None:
            torch.mm(self.dout_rows.T, self.u_down, out=grad_b_down).mul_(self.down.scaling)
        lora_grads = [
            None if grad is None else grad.to(tensor.dtype) for grad, tensor in zip(self.lora_grads, self.lora_tensors)
        ]
        grad_x = None if self.grad_x is None else self.grad_x.view(self.x_shape)
        return grad_x, [*self.grads, *lora_grads]


# Rows per tile of a tiled MLP with tile_tokens="auto": as many as keep one [rows, I] tensor within
# this many bytes (at least MIN_AUTO_TILE_ROWS, in multiples of it: the matmuls stay wide).
AUTO_TILE_BYTES = 256 * 2**20
MIN_AUTO_TILE_ROWS = 1024


def auto_tile_rows(n_inter: int, element_size: int) -> int:
    """The rows per tile that ``tile_tokens="auto"`` picks for an MLP of ``n_inter`` intermediate
    features in a dtype of ``element_size`` bytes."""
    rows = AUTO_TILE_BYTES // (n_inter * element_size)
    return max(MIN_AUTO_TILE_ROWS, rows // MIN_AUTO_TILE_ROWS * MIN_AUTO_TILE_ROWS)


def token_tiles(n_rows: int, tile_rows: int | None) -> list[slice]:
    """Consecutive row ranges of ``tile_rows`` rows (one range of all ``n_rows`` for ``None``)."""
    if tile_rows is None or tile_rows >= n_rows:
        return [slice(0, n_rows)]
    return [slice(start, min(start + tile_rows, n_rows)) for start in range(0, n_rows, tile_rows)]


def gated_mlp(x, gate_weight, up_weight, down_weight, activation, adapters=(None, None, None), tile_rows=None):
    """A gated MLP on ``x [..., H]`` (weights ``[I, H], [I, H], [H, I]``) that keeps only its
    inputs for backward; ``adapters`` holds an optional ``(lora_a, lora_b, scaling)`` per
    projection (gate, up, down); ``tile_rows`` (or ``None``) the rows of ``x`` per tile.
    Inputs validated by :mod:`tigon.functional`.

    The backward's slices of the intermediate dimension are as wide as ``H`` at most (rounded to
    a multiple of 64), so each slice's tensors are no larger than ``x`` (than a tile of it).
    """
    n_inter, n_hidden = gate_weight.shape
    n_slices = cdiv(n_inter, n_hidden)
    slice_width = cdiv(cdiv(n_inter, n_slices), 64) * 64
    lora_tensors = [t for adapter in adapters for t in (adapter[:2] if adapter else (None, None))]
    scalings = tuple(float(adapter[2]) if adapter else 0.0 for adapter in adapters)
    x_kept = keep_for_backward(x, gate_weight, up_weight, down_weight, *lora_tensors)
    return GatedMLPFunction.apply(
        x_kept, gate_weight, up_weight, down_weight, *lora_tensors, scalings, activation, slice_width, tile_rows
    )


def gated_linear(gate, up, weight, bias, activation, inplace_backward):
    """``(act(gate) · up) @ weightᵀ (+ bias)``; inputs validated by :mod:`tigon.functional`."""
    return GatedLinearFunction.apply(gate, up, weight, bias, activation, inplace_backward)


def swiglu(gate, up, inplace_backward):
    """``silu(gate) · up`` for ``gate, up [...]``; inputs validated by :mod:`tigon.functional`."""
    return GatedFunction.apply(gate, up, GATE_KINDS["swiglu"], inplace_backward)


def geglu(gate, up, inplace_backward):
    """``gelu_tanh(gate) · up`` for ``gate, up [...]``; inputs validated by :mod:`tigon.functional`."""
    return GatedFunction.apply(gate, up, GATE_KINDS["geglu"], inplace_backward)


def gated_fp8(gate, up, gate_kind, inplace_backward, output_cast, grad_casts):
    """``act(gate) · up`` (``gate_kind`` ``"swiglu"`` or ``"geglu"``) with its output, or its
    gradients, or both, cast to FP8 with one scale a tensor (:class:`GatedFp8Function`). With
    ``inplace_backward`` the backward writes over ``gate`` and ``up`` (16-bit gradients) or over
    the incoming gradient (FP8 ones)."""
    return GatedFp8Function.apply(gate, up, GATE_KINDS[gate_kind], inplace_backward, output_cast, grad_casts)


def swiglu_clamped(gate_up, alpha, limit, inplace_backward):
    """GPT-OSS's clamped SwiGLU of interleaved ``gate_up [..., 2I]`` → ``[..., I]``; inputs
    validated by :mod:`tigon.functional`."""
    return SwiGLUClampedFunction.apply(gate_up, alpha, limit, inplace_backward)


def relu2(x, inplace_backward):
    """``relu(x)²`` for ``x [...]``; inputs validated by :mod:`tigon.functional`."""
    return ReLU2Function.apply(x, inplace_backward)
