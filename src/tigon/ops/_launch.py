"""Helpers shared by every kernel family: launch geometry, row views and custom-op registration."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable

import torch
import triton

# Widest row a single program holds in registers (elements); longer rows loop over blocks.
MAX_FUSED_ROW = 65536


def interpreting() -> bool:
    """True when kernels run through Triton's CPU interpreter rather than on a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def row_launch_config(n_cols: int, element_size: int) -> tuple[int, int]:
    """Block width and warp count for a kernel that holds one row of ``n_cols`` elements.

    The block is the next power of two of the row; warps grow with the row's bytes so that each
    thread keeps roughly 8-16 elements in flight (16-byte vectors for 16-bit dtypes).
    """
    block_n = triton.next_power_of_2(n_cols)
    row_bytes = block_n * element_size
    if row_bytes <= 2048:
        num_warps = 1 if row_bytes <= 512 else 2
    elif row_bytes <= 8192:
        num_warps = 4
    elif row_bytes <= 32768:
        num_warps = 8
    else:
        num_warps = 16
    return block_n, num_warps


def rows_per_block(n_cols: int, min_elements: int = 4096, max_rows: int = 16) -> int:
    """Rows a program handles together so that its tile holds at least ~``min_elements`` elements:
    short rows alone would leave most of a program's lanes idle."""
    return max(1, min(max_rows, min_elements // triton.next_power_of_2(n_cols)))


def norm_bwd_geometry(block_n: int) -> tuple[int, int, int]:
    """``(rows per step, num_warps, programs per SM)`` of a persistent norm backward whose rows are
    ``block_n`` wide (a power of two): tiles of 16K elements, 64 per thread (8 warps), one program
    per SM; rows of 1K or less take 8K-element tiles, 4 warps and two programs per SM.

    Swept on the H100 at [16384, H] bf16 (benchmarks/tune_kernels.py): RMSNorm's backward reaches
    62% of the copy ceiling at H = 1024, 77% at 2048, 89% at 4096 and at 16384.
    """
    if block_n <= 1024:
        block_m = rows_per_block(block_n, min_elements=8192)
        return block_m, 4, 2
    block_m = rows_per_block(block_n, min_elements=16384)
    return block_m, max(4, min(16, block_m * block_n // 2048)), 1


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs_for(device: torch.device, programs_per_sm: int = 1) -> int:
    """Size of a persistent grid on ``device``: a few programs per multiprocessor."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * programs_per_sm


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., H]`` as a 2-D ``[rows, H]`` view whose last dimension is contiguous.

    Copies only when no such view exists (a transposed last dimension, or leading dimensions
    that cannot be merged); any row stride is passed to the kernels as is.
    """
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def tigon_op(name: str, *, mutates_args: tuple[str, ...] = (), fake: Callable | None = None):
    """Register a launcher as the PyTorch custom op ``tigon::<name>``.

    Code traced by ``torch.compile`` calls the registered op, which is opaque to it (no graph
    break, no tracing into Triton; ``fake`` gives the output shapes). Eager code calls the
    launcher directly: the dispatcher's checks cost about 0.3 ms of host time per call on the
    H100 machine, more than most of these kernels take on the GPU. Like the op, the direct call
    bumps the version counter of each tensor it writes, so that autograd refuses to use a saved
    tensor overwritten since. The op is kept as ``.op``.
    """

    def register(launcher: Callable):
        op = torch.library.custom_op(f"tigon::{name}", mutates_args=mutates_args)(launcher)
        if fake is not None:
            op.register_fake(fake)
        signature = inspect.signature(launcher)

        @functools.wraps(launcher)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            result = launcher(*args, **kwargs)
            if mutates_args:
                bound = signature.bind(*args, **kwargs).arguments
                torch.autograd.graph.increment_version([bound[name] for name in mutates_args])
            return result

        call.op = op
        return call

    return register


def empty_tensor(device: torch.device) -> torch.Tensor:
    """A placeholder passed where an optional tensor is absent (custom ops take no ``None`` pointers
    into Triton; kernels are told by a constexpr flag not to touch it)."""
    return torch.empty(0, device=device)


class KeepForBackwardFunction(torch.autograd.Function):
    """The identity on ``x`` that saves ``x`` and ``tensors`` for the function applied after it.

    A custom function's tensors are packed for backward after its forward has run. Under
    non-reentrant checkpointing, which recomputes a layer until the last tensor the layer saved
    is saved again, a function that saves its inputs itself would have its own matmuls recomputed
    for nothing when it is the layer's last. This one saves them before that work; the function
    after it saves nothing and reads them back through this node (``x.grad_fn`` of its input,
    see :func:`save_inputs` and :func:`kept_tensors`).
    """

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.save_for_backward(x, *tensors)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return dx, *(None,) * (len(ctx.needs_input_grad) - 1)


def keep_for_backward(x: torch.Tensor, *tensors: torch.Tensor | None) -> torch.Tensor:
    """``x`` (a view) whose ``grad_fn`` holds ``(x, *tensors)`` for the function applied to it next,
    which calls :func:`save_inputs` in its forward. Under torch.compile, which traces no
    ``grad_fn`` (and recomputes by its own rules), ``x`` itself: that function saves its inputs."""
    if torch.compiler.is_compiling():
        return x
    return KeepForBackwardFunction.apply(x, *tensors)


def save_inputs(ctx, x: torch.Tensor, *tensors: torch.Tensor | None) -> None:
    """In the forward of a function whose input ``x`` came from :func:`keep_for_backward`: note the
    node that keeps ``(x, *tensors)``, or save them here under torch.compile."""
    if torch.compiler.is_compiling():
        ctx.kept_by = None
        ctx.save_for_backward(x, *tensors)
    else:
        ctx.kept_by = x.grad_fn


def kept_tensors(ctx) -> tuple:
    """The tensors :func:`save_inputs` recorded, in backward."""
    return ctx.saved_tensors if ctx.kept_by is None else ctx.kept_by.saved_tensors


def kept_x_needs_grad(ctx) -> bool:
    """Whether the ``x`` given to :func:`keep_for_backward` needs a gradient (its view always
    requires one when any kept tensor does)."""
    return ctx.needs_input_grad[0] if ctx.kept_by is None else ctx.kept_by.needs_input_grad[0]
