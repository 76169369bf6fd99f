"""Helpers shared by every kernel family: launch geometry, a cheaper kernel launch, row views,
the norms' final sum of per-program partials and custom-op registration."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

try:
    from triton import knobs
except ImportError:  # Triton before 3.4
    knobs = None

# Widest row a single program holds in registers (elements); longer rows loop over blocks.
MAX_FUSED_ROW = 65536


def interpreting() -> bool:
    """True when kernels run through Triton's CPU interpreter rather than on a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code: ``triton.cdiv`` is a ``constexpr_function`` (Triton 3.6), whose
    wrapper costs ~10 µs of host time per call from Python."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0, as ``triton.next_power_of_2``), for host code
    (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def row_launch_config(n_cols: int, element_size: int) -> tuple[int, int]:
    """Block width and warp count for a kernel that holds one row of ``n_cols`` elements.

    The block is the next power of two of the row; warps grow with the row's bytes so that each
    thread keeps roughly 8-16 elements in flight (16-byte vectors for 16-bit dtypes).
    """
    block_n = next_power_of_2(n_cols)
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
    return max(1, min(max_rows, min_elements // next_power_of_2(n_cols)))


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


# The final sum of per-program partials: a program sums PARTIALS_BLOCK_N columns over all
# programs' rows, PARTIALS_BLOCK_P rows a step.
PARTIALS_BLOCK_N = 64
PARTIALS_BLOCK_P = 64


@triton.jit
def sum_partials_kernel(
    PARTIALS, OUT, OUT_2,
    n_partials, n_cols, stride_partial,
    TWO_OUTPUTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # OUT[j] = Σ_p PARTIALS[p, j] in fp32, stored in OUT's dtype. With TWO_OUTPUTS the partials are
    # [P, 2, H] and the grid's second axis picks (PARTIALS[:, 0], OUT) or (PARTIALS[:, 1], OUT_2).
    output = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    partials = PARTIALS + output * n_cols + cols[None, :]
    total = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        total += tl.load(partials + rows.to(tl.int64)[:, None] * stride_partial, mask=mask, other=0.0)
    total = tl.sum(total, axis=0)
    if TWO_OUTPUTS:
        if output == 1:
            tl.store(OUT_2 + cols, total.to(OUT_2.dtype.element_ty), mask=col_mask)
        else:
            tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=col_mask)
    else:
        tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=col_mask)


def sum_partials(partials: torch.Tensor, *dtypes: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The sums over programs of a norm backward's fp32 partials, ``[P, H]`` (rows may be strided)
    or ``[P, 2, H]`` (two sums, contiguous in the last two dimensions), as ``[H]`` tensors in
    ``dtypes`` (one per sum): one launch instead of ``partials.sum(0)`` and a cast per sum, each
    two host calls and a kernel."""
    n_partials, n_cols = partials.shape[0], partials.shape[-1]
    outs = tuple(partials.new_empty(n_cols, dtype=dtype) for dtype in dtypes)
    block_n = min(PARTIALS_BLOCK_N, next_power_of_2(n_cols))
    launch(
        sum_partials_kernel, (cdiv(n_cols, block_n), len(outs)),
        partials, outs[0], outs[1] if len(outs) == 2 else None,
        n_partials, n_cols, partials.stride(0),
        TWO_OUTPUTS=len(outs) == 2, BLOCK_P=PARTIALS_BLOCK_P, BLOCK_N=block_n, num_warps=4,
    )
    return outs


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs_for(device: torch.device, programs_per_sm: int = 1) -> int:
    """Size of a persistent grid on ``device``: a few programs per multiprocessor."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * programs_per_sm


_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63
# The Triton whose launch path :func:`launch` reproduces (``JITFunction.run``, its specialisation
# and the CUDA and HIP launchers' arguments were read for 3.6); any other takes Triton's own path.
_FAST_LAUNCH_TRITON = tuple(triton.__version__.split(".")[:2]) == ("3", "6")


class _KernelLaunches:
    """What :func:`launch` keeps per kernel: the kernel Triton compiled for each specialisation key
    (see :meth:`key`) and the constexpr values that go with it."""

    def __init__(self, n_runtime: int):
        self.n_runtime = n_runtime  # parameters before the constexprs
        self.compiled: dict[tuple, tuple] = {}

    @staticmethod
    def of(kernel) -> _KernelLaunches | None:
        """``None`` where every launch takes Triton's path: another Triton version than the one read
        (``_FAST_LAUNCH_TRITON``), the interpreter (the kernel is then not a ``JITFunction``), or
        constexpr parameters that do not all come last, or one with a default."""
        if not _FAST_LAUNCH_TRITON or type(kernel) is not JITFunction:
            return None
        params = kernel.params
        n_runtime = sum(not param.is_constexpr for param in params)
        if not all(param.is_constexpr and not param.has_default for param in params[n_runtime:]):
            return None
        return _KernelLaunches(n_runtime)

    def key(self, args: tuple, kwargs: dict, device: int) -> tuple | None:
        """A key that determines Triton's own cache key (``compute_cache_key``): equal keys, same
        compiled kernel. Triton specialises a tensor on its dtype and on whether its address is a
        multiple of 16, an int on its type (i32, i64 or u64), on whether it is 1 (a constexpr then)
        and on whether it is a multiple of 16; floats and bools not at all; constexprs and options
        (the keywords) by value. The keywords' types are in the key too, finer than Triton (which
        takes ``True`` for ``1``) but never coarser. ``None`` for an argument kind not handled
        here (then Triton decides)."""
        parts = [
            device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            tuple(kwargs.items()), tuple(map(type, kwargs.values())),
        ]
        append = parts.append
        for value in args:
            kind = value.__class__
            if kind is int:
                append(1 if value == 1 else (value & 15 == 0, _I32_MIN <= value <= _I32_MAX, value >= _U64_MIN))
            elif isinstance(value, torch.Tensor):
                append((value.dtype, value.data_ptr() & 15 == 0))
            elif kind is float or kind is bool or value is None:
                append(kind)
            else:
                return None
        return tuple(parts)


_MISSING = object()


def _hooks_idle(kernel: JITFunction) -> bool:
    """No launch hook (a profiler's), pre-run hook or changed global that Triton's own path would
    act on."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # an empty HookChain does nothing
            return False
    if kernel.pre_run_hooks:
        return False
    for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
        if globals_dict.get(name, _MISSING) != value:
            return False
    return True


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` with the non-constexpr arguments positional and the
    constexprs and launch options (``num_warps``...) as keywords, skipping Triton's Python launch
    path once it has compiled the kernel for arguments like these.

    Triton's ``JITFunction.run`` binds every argument, specialises each one, builds its cache key
    and launch metadata for hooks, then calls two empty hook chains: 13 µs of Python per launch of
    RMSNorm's forward on a development CPU (8.7 µs here), several times that on a slow host, more
    than many of these kernels run on the GPU. Here the key is computed from what Triton specialises on
    (:meth:`_KernelLaunches.key`), the kernel Triton compiled at the first call with that key is
    kept, and later calls with the key launch it directly on the current stream, as Triton's own
    path then would. Everything else takes Triton's path unchanged: the interpreter, an argument
    kind not handled, a launch hook set (profilers), a pre-run hook, or a global read by the
    kernel that has changed since it was compiled (Triton then raises).
    """
    launches = getattr(kernel, "_tigon_launches", _MISSING)
    if launches is _MISSING:
        launches = kernel._tigon_launches = _KernelLaunches.of(kernel)
    if launches is None or len(args) != launches.n_runtime or not _hooks_idle(kernel):
        kernel[grid](*args, **kwargs)
        return
    active = driver.active
    device = active.get_current_device()
    key = launches.key(args, kwargs, device)
    cached = launches.compiled.get(key) if key is not None else None
    if cached is None:
        compiled = kernel[grid](*args, **kwargs)
        # A future (Triton's asynchronous compilation) is not kept: the next call asks again.
        if key is not None and hasattr(compiled, "packed_metadata") and not hasattr(compiled, "result"):
            constexprs = tuple(kwargs[param.name] for param in kernel.params[launches.n_runtime:])
            launches.compiled[key] = (compiled, constexprs)
        return
    compiled, constexprs = cached
    compiled.run(
        grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
        active.get_current_stream(device), compiled.function, compiled.packed_metadata, None, None, None,
        *args, *constexprs,
    )


def host_sync_allowed(tensor: torch.Tensor) -> bool:
    """False where the host must not wait for the GPU: under torch.compile and while a CUDA graph
    is being captured."""
    if torch.compiler.is_compiling():
        return False
    return not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def range_to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``(values.min(), values.max())`` of a non-empty integer tensor to the host
    without waiting; :func:`read_range` waits for them. An argument check that queues the kernels
    using ``values`` in between keeps the GPU busy while the host waits (kernels that read only
    valid memory whatever the values)."""
    pending = torch.stack(torch.aminmax(values)).to("cpu", non_blocking=True)
    event = None
    if values.is_cuda:
        event = torch.cuda.Event()
        event.record()
    return pending, event


def read_range(copy: tuple[torch.Tensor, torch.cuda.Event | None]) -> tuple[int, int]:
    """``(lowest, highest)`` from :func:`range_to_host`, once the copy has landed."""
    values, event = copy
    if event is not None:
        event.synchronize()
    lowest, highest = values.tolist()
    return lowest, highest


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


# The dispatch modes under which tensors are traced, not computed: torch.compile runs a function
# it keeps whole in its graph (torchao's matmul, tigon's FP8 gate: ``allow_in_graph``) on fake
# tensors, and torch 2.11 does not say ``is_compiling()`` then.
_TRACING_MODES = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY,
                  torch._C._TorchDispatchModeKey.FUNCTIONAL)


def _tracing() -> bool:
    """Whether tensors are being traced (by torch.compile, or under a fake or functional mode)."""
    return torch.compiler.is_compiling() or any(
        torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


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
            if _tracing():
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
