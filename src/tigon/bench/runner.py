"""Timing and memory of one op call, and the ceilings they are compared to.

**What a time means.** The GPU time of the call as it runs inside a training step, where the
host is ahead of the GPU: before each timed call the GPU is kept busy by a sleep kernel longer
than the host needs to enqueue the call, so the events around it measure the kernels and the
gaps between them, not the host's Python and launch overhead (which a plain ``do_bench`` of a
sub-millisecond op mostly measures on the H100 machine: 0.3 to 1 ms of host time per call).
A provider that synchronises with the host inside its call (a ``.item()``) still pays for it:
the host then waits, and everything it enqueues afterwards runs at the host's pace. The host
time of one call is recorded beside it (``host_ms``, measured with the GPU idle). Each time is
the median over many calls after warm-up.

**Launch-inclusive time.** What the call costs when nothing else hides its host time: the events
enclose K calls made back to back (no sleep ahead of them), so the GPU waits whenever the host is
behind, and the time is divided by K (``launch_ms``; the median of a few such runs). It is about
``max(GPU time, host time)``: an op whose host side is slower than its kernels shows it here, and
``launch_ratio = launch_ms / time_ms`` says by how much.

L2 (50 MB on an H100) must not flatter small shapes: every measurement rotates through several
copies of its inputs, as many as needed for the copies together to exceed 4× the L2 size (at most
``MAX_INPUT_SETS``; one set when a single set is already that large), so no call finds its
operands left in cache by the previous one.

Backward alone is timed by running forward once per input set and re-running
``torch.autograd.backward(..., retain_graph=True)``. Providers that write gradients during forward
cannot be re-run that way: for them forward and full are timed and backward is full − forward.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from triton.testing import do_bench

from tigon.bench.specs import Case

WARMUP_MS = 25
REP_MS = 100
WARMUP_CALLS = 3
MIN_CALLS, MAX_CALLS = 10, 200
BACK_TO_BACK_RUNS = 3
BACK_TO_BACK_MIN_CALLS = 5  # a slow op's host time is hidden after its first call: few calls suffice
MAX_INPUT_SETS = 16
L2_FALLBACK_BYTES = 50 * 2**20
COPY_BYTES = 2 * 2**30  # source of the ceiling copy (as much again is written)
MATMUL_SIZE = 8192

DERIVED_BACKWARD_NOTE = "backward = full - forward"


@dataclass
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written
    matmul_tflops: float  # bf16 8192³ matmul


@dataclass
class Measurement:
    status: str  # "ok", "smoke" (no timing claimed), "oom" or "error"
    time_ms: float | None = None
    peak_mib: float | None = None
    host_ms: float | None = None
    launch_ms: float | None = None  # launch-inclusive: calls back to back, host time not hidden
    notes: list[str] = field(default_factory=list)


def measure_ceilings(device: torch.device) -> Ceilings:
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    copy_ms = do_bench(lambda: destination.copy_(source), warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    del source, destination
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16) for _ in range(2))
    product = torch.empty_like(a)
    matmul_ms = do_bench(lambda: torch.mm(a, b, out=product), warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    del a, b, product
    _release_memory()
    return Ceilings(
        copy_gbps=2 * COPY_BYTES / (copy_ms * 1e6),
        matmul_tflops=2 * MATMUL_SIZE**3 / (matmul_ms * 1e9),
    )


def l2_cache_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size or L2_FALLBACK_BYTES


def _as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _backward(outputs, case: Case, retain_graph: bool = False) -> None:
    torch.autograd.backward(_as_tuple(outputs), case.grad_outputs, retain_graph=retain_graph)


def _full_step(fn, case: Case) -> None:
    _backward(fn(case.args), case)


def _clear_grads(cases: list[Case]) -> None:
    for case in cases:
        for leaf in case.leaves():
            leaf.grad = None


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_extra_mib(fn, case: Case) -> float:
    """Memory one forward+backward allocates beyond what exists before it (inputs, their output
    gradients): outputs, saved activations, workspaces and the input gradients."""
    _clear_grads([case])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _full_step(fn, case)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    _clear_grads([case])
    return peak / 2**20


def _host_ms(step: Callable[[], Any]) -> float:
    """Median host time of ``step`` with the GPU idle, so that nothing waits on it."""
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[1] * 1e3


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_ms() -> float:
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # first call loads the kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def _clear_grads_of(cases: list[Case]) -> Callable[[], None]:
    """Sets every leaf's gradient to ``None``, so that each call allocates fresh gradients instead of
    accumulating (as a training step after ``zero_grad(set_to_none=True)``)."""
    leaves = [leaf for case in cases for leaf in case.leaves()]

    def clear_grads():
        for leaf in leaves:
            leaf.grad = None

    return clear_grads


def _median_ms(step: Callable[[], Any], cases: list[Case]) -> tuple[float, float]:
    """(median GPU ms of ``step`` enqueued behind a sleep, host ms of one ``step``)."""
    clear_grads = _clear_grads_of(cases)
    for _ in range(WARMUP_CALLS):
        clear_grads()
        step()
    clear_grads()
    host_ms = _host_ms(step)
    sleep_cycles = int(_sleep_cycles_per_ms() * (2 * host_ms + 0.1))
    times = []
    while len(times) < MIN_CALLS or (sum(times) < REP_MS and len(times) < MAX_CALLS):
        clear_grads()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], host_ms


def _back_to_back_ms(step: Callable[[], Any], cases: list[Case], per_call_ms: float) -> float:
    """Launch-inclusive ms of one ``step``: the median over ``BACK_TO_BACK_RUNS`` runs of K calls
    made back to back between two events (nothing ahead of them on the GPU), divided by K.
    ``per_call_ms``, the larger of the GPU and host times, sizes K to about ``REP_MS`` in all."""
    clear_grads = _clear_grads_of(cases)
    calls = max(BACK_TO_BACK_MIN_CALLS, min(MAX_CALLS, math.ceil(REP_MS / BACK_TO_BACK_RUNS / max(per_call_ms, 1e-3))))
    times = []
    for _ in range(BACK_TO_BACK_RUNS):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            clear_grads()
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return times[len(times) // 2]


def _timings(step: Callable[[], Any], cases: list[Case]) -> tuple[float, float, float]:
    """(GPU ms, host ms, launch-inclusive ms) of ``step``."""
    time_ms, host_ms = _median_ms(step, cases)
    return time_ms, host_ms, _back_to_back_ms(step, cases, max(time_ms, host_ms))


def _forward_step(fn, cases):
    rotation = itertools.cycle(cases)
    return lambda: fn(next(rotation).args)


def _full_step_rotating(fn, cases):
    rotation = itertools.cycle(cases)
    return lambda: _full_step(fn, next(rotation))


def _backward_step(fn, cases):
    graphs = itertools.cycle([(fn(case.args), case) for case in cases])

    def step():
        outputs, case = next(graphs)
        _backward(outputs, case, retain_graph=True)

    return step


def _time_forward(fn, cases):
    return _median_ms(_forward_step(fn, cases), cases)


def _time_full(fn, cases):
    return _median_ms(_full_step_rotating(fn, cases), cases)


def _time_backward(fn, cases):
    return _median_ms(_backward_step(fn, cases), cases)


def input_sets(build: Callable[[], Case], l2_bytes: int) -> list[Case]:
    """Enough input sets that, rotated, they exceed 4× the L2 cache."""
    first = build()
    count = min(MAX_INPUT_SETS, max(1, math.ceil(4 * l2_bytes / first.nbytes())))
    return [first] + [build() for _ in range(count - 1)]


def measure(fn, build: Callable[[], Case], mode: str, grads_in_forward: bool, l2_bytes: int) -> Measurement:
    """Median time of ``mode`` and the peak extra memory of one forward+backward, on a GPU."""
    cases = []
    try:
        cases = input_sets(build, l2_bytes)
        _full_step(fn, cases[0])  # compiles (Triton JIT, torch.compile, autotuning) outside the timing
        peak_mib = _peak_extra_mib(fn, cases[0])
        notes = []
        time_ms = host_ms = launch_ms = None
        if mode == "forward":
            time_ms, host_ms, launch_ms = _timings(_forward_step(fn, cases), cases)
        elif mode == "full":
            time_ms, host_ms, launch_ms = _timings(_full_step_rotating(fn, cases), cases)
        else:
            if grads_in_forward:
                notes.append(f"{DERIVED_BACKWARD_NOTE} (gradients written during forward)")
            else:
                try:
                    time_ms, host_ms, launch_ms = _timings(_backward_step(fn, cases), cases)
                except torch.cuda.OutOfMemoryError:
                    raise
                except RuntimeError as error:  # e.g. torch.compile's donated buffers forbid retain_graph
                    notes.append(f"{DERIVED_BACKWARD_NOTE} (backward cannot be re-run: {_first_line(error, 80)})")
            if time_ms is None:
                full = _timings(_full_step_rotating(fn, cases), cases)
                forward = _timings(_forward_step(fn, cases), cases)
                time_ms, launch_ms = full[0] - forward[0], full[2] - forward[2]
        return Measurement("ok", time_ms, peak_mib, host_ms, launch_ms, notes)
    except torch.cuda.OutOfMemoryError:
        return Measurement("oom", notes=["out of memory"])
    except Exception as error:  # a provider failing on one shape must not end the run
        return Measurement("error", notes=[f"{type(error).__name__}: {_first_line(error)}"])
    finally:
        del cases
        _release_memory()


def smoke(fn, build: Callable[[], Case], mode: str, device: torch.device) -> Measurement:
    """One call of ``mode`` on tiny inputs: exercises the provider and the harness, times nothing
    (the wall-clock is recorded for the record, flagged ``smoke``)."""
    try:
        case = build()
        if mode == "backward":
            outputs = fn(case.args)
            start = time.perf_counter()
            _backward(outputs, case)
        else:
            start = time.perf_counter()
            outputs = fn(case.args)
            if mode == "full":
                _backward(outputs, case)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return Measurement("smoke", (time.perf_counter() - start) * 1e3)
    except Exception as error:
        return Measurement("error", notes=[f"{type(error).__name__}: {_first_line(error)}"])


def _first_line(error: Exception, limit: int = 160) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else "")[:limit]
