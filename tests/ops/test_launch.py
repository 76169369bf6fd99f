"""tigon's launch path (:func:`tigon.ops._launch.launch`) against Triton's own, without a GPU.

Triton's ``JITFunction.run`` runs for real against a stand-in CUDA driver; compiling is replaced
by a stand-in kernel that records its launches. Every launch must use the kernel Triton's own
cache holds for those arguments, whichever path took it.
"""

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import jit as triton_jit
from triton.runtime.driver import driver

from tigon.ops import _launch
from tigon.ops._launch import launch

# The stand-ins follow Triton 3.6's internals, the version whose launch path tigon reproduces.
needs_fast_path = pytest.mark.skipif(not _launch._FAST_LAUNCH_TRITON, reason="other Triton versions take their own path")


def _kernel(X, Y, n_rows, stride, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    pass  # never compiled: the stand-in below records launches instead


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 7

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _Compiled:
    """Stands for a compiled kernel; ``launches`` collects ``(kernel, grid, stream, args)``."""

    function = 0
    packed_metadata = (4, 1, 0)
    launches = []

    def __init__(self, triton_key):
        self.triton_key = triton_key

    def run(self, grid_0, grid_1, grid_2, stream, function, metadata, launch_metadata, enter, exit, *args):
        self.launches.append((self, (grid_0, grid_1, grid_2), stream, args))

    def launch_metadata(self, grid, stream, *args):
        return None


@pytest.fixture
def kernel(monkeypatch):
    """A fresh ``JITFunction`` of ``_kernel``, the stand-in driver and compiler, and a count of the
    launches that took Triton's own path."""
    monkeypatch.setattr(driver, "_active", _Driver())

    def compile(self, key, signature, device, constexprs, options, attrs, warmup):
        compiled = _Compiled(key)
        self.device_caches[device][0][key] = compiled
        return compiled

    monkeypatch.setattr(triton_jit.JITFunction, "_do_compile", compile)
    function = triton_jit.JITFunction(_kernel)
    function.triton_runs = 0
    run = function.run

    def counted_run(*args, **kwargs):
        function.triton_runs += 1
        return run(*args, **kwargs)

    function.run = counted_run
    _Compiled.launches = []
    return function


def _triton_choice(kernel, args, kwargs):
    """The kernel Triton's cache holds for these arguments (its binder and key, as ``run``)."""
    kernel_cache, key_cache, _, _, binder = kernel.device_caches[0]
    options = dict(
        kwargs, debug=kernel.debug or knobs.runtime.debug, instrumentation_mode=knobs.compilation.instrumentation_mode,
    )
    _, specialization, options = binder(*args, **options)
    return kernel_cache[triton_jit.compute_cache_key(key_cache, specialization, options)]


def _launch_and_check(kernel, grid, *args, **kwargs):
    launch(kernel, grid, *args, **kwargs)
    launched, full_grid, stream, launched_args = _Compiled.launches[-1]
    assert launched is _triton_choice(kernel, args, kwargs)
    assert full_grid == (*grid, *(1,) * (3 - len(grid))) and stream == 7
    assert launched_args == (*args, kwargs["FLAG"], kwargs["BLOCK"])


def _tensors(offset=0, dtype=torch.bfloat16):
    storage = torch.empty(64, dtype=dtype)
    return storage[offset:offset + 32], torch.empty(32, dtype=dtype)


@needs_fast_path
def test_second_call_skips_triton_and_launches_the_same_kernel(kernel):
    _launch_and_check(kernel, (4,), *_tensors(), 64, 128, 0.5, FLAG=True, BLOCK=32, num_warps=4)
    _launch_and_check(kernel, (4, 2), *_tensors(), 48, 128, 2.0, FLAG=True, BLOCK=32, num_warps=4)
    assert kernel.triton_runs == 1 and len(_Compiled.launches) == 2


@needs_fast_path
@pytest.mark.parametrize(
    "change",
    [
        dict(x_offset=1),  # an address no longer a multiple of 16 bytes
        dict(dtype=torch.float16),
        dict(n_rows=1),  # 1 is a constexpr to Triton
        dict(n_rows=17),  # not a multiple of 16
        dict(n_rows=2**31),  # i64
        dict(n_rows=2**63),  # u64
        dict(stride=8),
        dict(scale=1),  # an int where a float was
        dict(x=None),
        dict(flag=1),  # True and 1: one kernel to Triton, two keys here (finer is safe)
        dict(block=64),
        dict(num_warps=8),
    ],
)
def test_what_triton_specialises_on_takes_its_own_kernel(kernel, change):
    def call(x_offset=0, dtype=torch.bfloat16, n_rows=64, stride=128, scale=0.5, flag=True, block=32, num_warps=4,
             **replaced):
        x, y = _tensors(x_offset, dtype)
        x = replaced.get("x", x)
        _launch_and_check(kernel, (4,), x, y, n_rows, stride, scale, FLAG=flag, BLOCK=block, num_warps=num_warps)

    call()
    call(**change)
    assert kernel.triton_runs == 2, "the changed argument must reach Triton (a new key)"
    call(**change)
    call()
    assert kernel.triton_runs == 2, "both keys are kept"


@needs_fast_path
def test_launch_hooks_take_triton_path(kernel):
    calls = []
    knobs.runtime.launch_enter_hook.add(calls.append)
    try:
        for _ in range(2):
            launch(kernel, (4,), *_tensors(), 64, 128, 0.5, FLAG=True, BLOCK=32, num_warps=4)
    finally:
        knobs.runtime.launch_enter_hook.remove(calls.append)
    assert kernel.triton_runs == 2  # the C launcher (not this stand-in) calls the hooks
    for _ in range(2):
        launch(kernel, (4,), *_tensors(), 64, 128, 0.5, FLAG=True, BLOCK=32, num_warps=4)
    assert kernel.triton_runs == 3, "without hooks, the kernel is kept after one more call"


@needs_fast_path
def test_unhandled_argument_takes_triton_path(kernel):
    x, y = _tensors()
    for _ in range(2):
        _launch_and_check(kernel, (4,), (x, x), y, 64, 128, 0.5, FLAG=True, BLOCK=32, num_warps=4)
    assert kernel.triton_runs == 2


def test_interpreted_kernel_takes_triton_path():
    assert _launch._KernelLaunches.of(object()) is None


def test_host_helpers_match_triton():
    import triton

    for n in [0, 1, 2, 3, 16, 17, 1000, 4096, 4097]:
        assert _launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in [1, 3, 16, 128]:
            assert _launch.cdiv(n, d) == triton.cdiv(n, d)
