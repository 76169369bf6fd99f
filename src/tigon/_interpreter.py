"""Triton's interpreter (``TRITON_INTERPRET=1``) made to work whatever was imported first, and to
round as the GPU does.

Import order: ``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates. Triton's own library
functions (``tl.sum``, ``tl.max``, ``tl.cdiv``, ...) are decorated when ``triton.language`` is
first imported, which transformers, PEFT, TRL and ``torch._inductor`` do before ``import tigon``
can switch the interpreter on: those functions are then compiled-mode ``JITFunction`` objects,
which refuse to be called from an interpreted kernel ("Cannot call @triton.jit'd outside of the
scope of a kernel"). :func:`interpret_triton_library` re-decorates them as the interpreter would
have.

Rounding: Triton 3.6's interpreter casts fp32 to bf16 by truncating the mantissa (rounding toward
zero), whereas the GPU rounds to nearest even. Truncation doubles the error of every bf16 value a
kernel stores and biases it toward zero, so on CPU a bf16 kernel would look twice as far from its
fp64 reference as it is on the GPU. fp16 casts go through numpy, which already rounds to nearest.
"""

from __future__ import annotations

import sys

import numpy as np


def interpret_triton_library() -> int:
    """Re-decorate, for the interpreter, every ``triton.language`` function that was decorated in
    compiled mode (Triton imported before ``TRITON_INTERPRET`` was set): module attributes and the
    ``tl.tensor`` methods alike, one interpreted function per original. Returns how many."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted: dict[int, InterpretedFunction] = {}

    def as_interpreted(function: JITFunction) -> InterpretedFunction:
        if id(function) not in interpreted:
            interpreted[id(function)] = InterpretedFunction(
                function.fn, version=function.version, do_not_specialize=function.do_not_specialize,
                do_not_specialize_on_alignment=function.do_not_specialize_on_alignment, debug=function.debug,
                noinline=function.noinline, repr=function.repr, launch_metadata=function.launch_metadata,
            )
        return interpreted[id(function)]

    import triton.language as tl

    owners = [module for name, module in list(sys.modules.items()) if name.startswith("triton.language")]
    for owner in [*owners, tl.core.tensor]:
        for name, value in list(vars(owner).items()):
            if isinstance(value, JITFunction):
                setattr(owner, name, as_interpreted(value))
    return len(interpreted)


def _fp32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """``uint16`` bf16 bit patterns of ``values`` (fp32) rounded to nearest even; NaN stays NaN."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    # Adding 0x7FFF (plus the lowest kept bit, for ties to even) carries into the kept half exactly
    # when the dropped half is above (or at, for an odd kept half) one half of the last kept bit.
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = ((bits >> 16) & 0x8000) | 0x7FC0
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)


def round_bf16_casts_to_nearest() -> None:
    """Make the interpreter's fp32 → bf16 casts round to nearest even, as the GPU's do."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "rounds_to_nearest", False):
        return
    truncating_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits(src.data), tl.bfloat16)
        return truncating_cast(self, src, dst_type)

    cast_impl.rounds_to_nearest = True
    builder.cast_impl = cast_impl
