"""The chunk loop behind every loss computed from ``x @ Wᵀ (+ b)`` without holding all the logits.

The rows of ``x [N, H]`` are processed in chunks; one ``[C, V]`` buffer, reused by every chunk,
holds the chunk's logits and then their gradient::

    logits     = x_c @ Wᵀ (+ b)                   cuBLAS, fp32 accumulation, stored in x's dtype
    row_scale  = head(chunk, logits)              the loss: computes the chunk's losses and
                                                  writes dlogits over the logits
    dx_c       = (dlogits @ W) · row_scale
    dW        += dlogitsᵀ @ (x_c · row_scale)     (the first chunk writes, the others accumulate)
    db        += row_scaleᵀ @ dlogits             fp32

``row_scale`` (fp32 ``[C]``, or ``None`` for 1) is a factor per row that the head may only know
after the logits have been reduced, such as a preference loss's derivative with respect to a
whole sequence's log-probability: applying it to ``x_c`` and ``dx_c`` (``[C, H]``) rather than to
``dlogits`` (``[C, V]``) spares a pass over the chunk's logits. ``matmul_scale``, a host number,
multiplies every gradient, applied by the matmuls in fp32 (a small factor such as a mean's
``1 / N`` would otherwise be stored into 16-bit ``dlogits`` and flush small entries to zero).
A mean over the non-ignored rows, whose count ``n_valid`` lives on the device, takes its factor
from :func:`mean_scales`.

A chunk is one range of rows (a view of ``x``, no copy) or several ranges that must be in the same
chunk, such as a preference pair's chosen and rejected sequences (gathered into one block, so that
each chunk costs one matmul of each kind whatever its shape). Cost per chunk: ``6·C·H·V`` matmul
FLOPs and one read and write of the ``[V, H]`` weight gradient by the accumulating matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tigon.ops._launch import host_sync_allowed
from tigon.ops.fp8 import Fp8HeadMatmuls
from tigon.ops.cross_entropy import mean_grad_scale

# Logits memory per chunk by default, for vocabularies up to DEFAULT_CHUNK_VOCAB and in proportion
# to V beyond it. Smaller chunks hold less but make the [V, H] weight gradient be read and written
# once more per chunk, and make the matmuls thinner: see docs/perf-notes/cross_entropy.md.
DEFAULT_CHUNK_MEMORY_BYTES = 512 * 2**20
# 512 MiB hold the 2048 rows of bf16 logits measured best at Llama 3's V = 128256, but only ~1700
# at V = 151936 and 1024 at V = 262144, where the matmuls get thinner and the weight gradient's
# round trips more. Scaled by V / 128256 the default keeps 2048 rows there, at 594 MiB and 1 GiB of
# bf16 logits (fp32 logits keep 1024 rows, as at 128256).
DEFAULT_CHUNK_VOCAB = 128256
# Under CUDA-graph capture a mean's 1 / n_valid is split between the matmuls and the head's kernel:
# see mean_scales.
MEAN_SCALE_ROWS = 2**14
# Chunks larger than this many rows are rounded down to a multiple of it, a whole number of
# matmul tiles.
CHUNK_ROW_MULTIPLE = 64

RowRanges = Sequence[tuple[int, int]]
# head(ranges, logits) → row_scale: computes the losses of the chunk's rows from their logits
# [C, V] and writes dlogits over them (when gradients are wanted); returns [C] fp32 or None.
ChunkHead = Callable[[RowRanges, torch.Tensor], torch.Tensor | None]


def chunk_rows_for(n_rows: int, n_classes: int, element_size: int, chunk_memory_bytes: int | None) -> int:
    """Rows per chunk: as many ``[V]`` logits rows (``element_size`` bytes each) as fit in
    ``chunk_memory_bytes``, at least 1 and at most ``n_rows``. ``None`` is
    :data:`DEFAULT_CHUNK_MEMORY_BYTES`, times ``V / DEFAULT_CHUNK_VOCAB`` for a larger ``V``."""
    if chunk_memory_bytes is None:
        budget = DEFAULT_CHUNK_MEMORY_BYTES * max(n_classes, DEFAULT_CHUNK_VOCAB) // DEFAULT_CHUNK_VOCAB
    else:
        budget = int(chunk_memory_bytes)
    rows = max(1, budget // (n_classes * element_size))
    if rows > CHUNK_ROW_MULTIPLE:
        rows -= rows % CHUNK_ROW_MULTIPLE
    return max(1, min(rows, n_rows))


def row_chunks(n_rows: int, chunk_rows: int) -> list[RowRanges]:
    """Consecutive chunks of ``chunk_rows`` rows, each one range."""
    return [((start, min(start + chunk_rows, n_rows)),) for start in range(0, n_rows, chunk_rows)]


def gather_rows(x2d: torch.Tensor, ranges: RowRanges) -> torch.Tensor:
    """The rows of ``ranges`` as one block: a view for one range, a copy for several."""
    if len(ranges) == 1:
        start, end = ranges[0]
        return x2d[start:end]
    return torch.cat([x2d[start:end] for start, end in ranges])


def scatter_rows(block: torch.Tensor, out: torch.Tensor, ranges: RowRanges) -> None:
    """The inverse of :func:`gather_rows`: ``out[ranges] = block``."""
    offset = 0
    for start, end in ranges:
        out[start:end].copy_(block[offset : offset + end - start])
        offset += end - start


def linear_logits(x_chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor):
    """``out = x_chunk @ weightᵀ (+ bias)`` in place."""
    if bias is None:
        torch.mm(x_chunk, weight.t(), out=out)
    else:
        torch.addmm(bias, x_chunk, weight.t(), out=out)
    return out


def new_grads(x2d, weight, grad_input_needed, grad_weight_needed, grad_bias_needed):
    """Gradient buffers for what is needed, ``None`` for the rest (``grad_bias`` accumulates in fp32)."""
    # The first chunk's matmul writes grad_weight; without rows there is no chunk to do it. Made
    # from the weight's shape and dtype, not like it: a weight may be a tensor subclass (torchao's
    # FP8 weight, all-gathered in FP8 by FSDP2) whose gradient is a plain tensor.
    new_weight_grad = torch.empty if x2d.shape[0] > 0 else torch.zeros
    return (
        torch.empty_like(x2d, memory_format=torch.contiguous_format) if grad_input_needed else None,
        new_weight_grad(weight.shape, dtype=weight.dtype, device=weight.device) if grad_weight_needed else None,
        torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if grad_bias_needed else None,
    )


def mean_scales(n_valid: torch.Tensor, n_rows: int) -> tuple[torch.Tensor | None, float]:
    """``(grad_scale, matmul_scale)`` for a mean over ``n_valid`` (an int64 device scalar) of
    ``n_rows`` rows: the head's kernel multiplies ``dlogits`` by ``grad_scale`` (an fp32 ``[1]``
    device tensor, or ``None`` for 1) and the matmuls by the host number ``matmul_scale``.

    Where the host may wait for the GPU, ``n_valid`` is read (one sync) and the whole
    ``1 / n_valid`` is the matmuls' fp32 ``alpha``: the stored ``dlogits`` are the unscaled ones.
    Under CUDA-graph capture nothing may wait, and a matmul's ``alpha`` must be a host number, so
    the factor is split: the matmuls apply ``1 / m`` and the kernel ``m / n_valid``, with
    ``m = min(n_rows, MEAN_SCALE_ROWS)``. In fp16 that keeps the stored ``dlogits`` no smaller than
    unscaled ones up to ``MEAN_SCALE_ROWS`` rows (``p / n_valid`` would flush small entries to zero
    for a few thousand rows) and at most ``m`` times larger (no overflow for gradients of order 1).

    With ``n_valid = 0`` every row's ``dlogits`` is zero, and both factors stay finite (``n_valid``
    taken as 1) so that the gradients are 0, PyTorch's; the loss's own 0 / 0 = NaN is the
    reduction's, on the device (:func:`~tigon.ops.cross_entropy.reduce_rows`).
    """
    if host_sync_allowed(n_valid):
        return None, 1.0 / max(int(n_valid), 1)
    split = max(1, min(n_rows, MEAN_SCALE_ROWS))
    return mean_grad_scale(n_valid, split), 1.0 / split


class HeadMatmuls:
    """The chunk loop's three matmuls over ``weight [V, H]`` in its dtype (cuBLAS, fp32
    accumulation); :class:`tigon.ops.fp8.Fp8HeadMatmuls` is the FP8 one."""

    # Whether a cross entropy head hands over dlogits already cast (only FP8 ones cast).
    casts_cross_entropy_grad = False

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def logits(self, x_chunk: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        linear_logits(x_chunk, self.weight, bias, out)

    def grad_input(self, dlogits: torch.Tensor, out: torch.Tensor | None, alpha: float) -> torch.Tensor:
        """``alpha · dlogits @ W`` into ``out`` (a new tensor when ``None``)."""
        if out is None:
            out = torch.mm(dlogits, self.weight)
            return out.mul_(alpha) if alpha != 1.0 else out
        # beta = 0 ignores what the output held (torch.empty); alpha is applied in fp32.
        return out.addmm_(dlogits, self.weight, beta=0, alpha=alpha)

    def accumulate_grad_weight(self, grad_weight: torch.Tensor, dlogits: torch.Tensor, x_chunk: torch.Tensor,
                               first: bool, alpha: float) -> None:
        grad_weight.addmm_(dlogits.t(), x_chunk, beta=0 if first else 1, alpha=alpha)

    def finish_grad_weight(self, grad_weight: torch.Tensor | None, alpha: float) -> None:
        """Nothing is left after the last chunk (the FP8 matmuls may leave a group of chunks)."""


def head_matmuls(weight: torch.Tensor, fp8: str | None, grad_input_needed: bool = True,
                 grad_weight_needed: bool = True):
    """The chunk loop's matmuls over ``weight``: in FP8 by the recipe ``fp8`` (see
    :mod:`tigon.ops.fp8`; what is not needed is not cast for), else in the weight's dtype."""
    if fp8 is None:
        return HeadMatmuls(weight)
    return Fp8HeadMatmuls(weight, fp8, grad_input_needed, grad_weight_needed)


def fused_linear_chunks(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunks: Sequence[RowRanges],
    head: ChunkHead, grad_input: torch.Tensor | None = None, grad_weight: torch.Tensor | None = None,
    grad_bias: torch.Tensor | None = None, matmul_scale: float = 1.0, logits_buffer: torch.Tensor | None = None,
    first_chunk_computed: bool = False, matmuls: HeadMatmuls | None = None,
    grad_input_written: Callable[[RowRanges], None] | None = None,
) -> None:
    """Run ``head`` over the logits of every chunk and accumulate the gradients that are given.

    Args:
        x2d: ``[N, H]`` with unit column stride. weight: ``[V, H]``. bias: ``[V]`` or ``None``.
        chunks: row ranges per chunk (:func:`row_chunks` for consecutive chunks).
        head: see :data:`ChunkHead`; it must write dlogits whenever a gradient is given.
        grad_input ``[N, H]``, grad_weight ``[V, H]``, grad_bias ``[V]`` fp32: outputs, or ``None``.
            ``grad_input`` rows outside every chunk are left untouched; ``grad_weight`` is
            overwritten by the first chunk.
        logits_buffer: ``[≥ C, V]`` in ``x2d``'s dtype for each chunk's logits (allocated when
            ``None``). After the loop it holds the last chunk's logits, or what the head wrote.
        first_chunk_computed: the buffer already holds the first chunk's logits, kept from an
            earlier loop over the same rows: that chunk's matmul is skipped.
        matmuls: the three matmuls (:func:`head_matmuls`; by default in the weight's dtype).
        grad_input_written: called with a chunk's ranges once their ``grad_input`` rows are
            enqueued (a vocabulary-parallel loss starts their all-reduce there).
    """
    compute_grad = grad_input is not None or grad_weight is not None or grad_bias is not None
    matmuls = HeadMatmuls(weight) if matmuls is None else matmuls
    if logits_buffer is None:
        largest = max((sum(end - start for start, end in ranges) for ranges in chunks), default=0)
        logits_buffer = x2d.new_empty((largest, weight.shape[0]))
    for index, ranges in enumerate(chunks):
        x_chunk = gather_rows(x2d, ranges)
        logits = logits_buffer[: x_chunk.shape[0]]
        if not (index == 0 and first_chunk_computed):
            matmuls.logits(x_chunk, bias, logits)
        row_scale = head(ranges, logits)
        if not compute_grad:
            continue
        # From here on the buffer holds dlogits.
        if grad_input is not None:
            if len(ranges) == 1 and row_scale is None:
                start, end = ranges[0]
                matmuls.grad_input(logits, grad_input[start:end], matmul_scale)
            else:
                grad_chunk = matmuls.grad_input(logits, None, 1.0)
                if row_scale is not None:
                    grad_chunk.mul_(row_scale.unsqueeze(1) * matmul_scale)
                elif matmul_scale != 1.0:
                    grad_chunk.mul_(matmul_scale)
                scatter_rows(grad_chunk, grad_input, ranges)
            if grad_input_written is not None:
                grad_input_written(ranges)
        if grad_weight is not None:
            scaled_x = x_chunk if row_scale is None else x_chunk * row_scale.unsqueeze(1).to(x_chunk.dtype)
            matmuls.accumulate_grad_weight(grad_weight, logits, scaled_x, index == 0, matmul_scale)
        if grad_bias is not None:
            if row_scale is None:
                grad_bias.add_(logits.sum(0, dtype=torch.float32), alpha=matmul_scale)
            else:
                grad_bias.add_(row_scale.to(logits.dtype) @ logits, alpha=matmul_scale)
    if grad_weight is not None:
        matmuls.finish_grad_weight(grad_weight, matmul_scale)


class GradInputSum:
    """All-reduces of ``grad_input [N, H]`` over ``group``, one per chunk, for a head split over
    ranks (a vocabulary-parallel loss): :meth:`rows_written`, passed to :func:`fused_linear_chunks`
    as ``grad_input_written``, starts a chunk's as soon as its rows are enqueued, so that the sum
    runs under the next chunks' matmuls; :meth:`wait` joins them. Nothing is reduced for
    ``grad_input=None``."""

    def __init__(self, grad_input: torch.Tensor | None, group: dist.ProcessGroup):
        self.grad_input, self.group, self.pending = grad_input, group, []

    def rows_written(self, ranges: RowRanges) -> None:
        if self.grad_input is not None:
            self.pending += [
                dist.all_reduce(self.grad_input[start:end], group=self.group, async_op=True) for start, end in ranges
            ]

    def wait(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()
