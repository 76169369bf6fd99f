"""Offloaded checkpoints: a recomputed layer's saved input waits in host memory for its backward.

Under gradient checkpointing each recomputed decoder layer keeps one tensor from its forward to
its backward: its input hidden states, ``T × H`` values per sequence (8 KiB per token per layer
for an 8B model in bf16: 64 GiB at 256K tokens over 32 layers). That is what limits the sequence
length once everything else is checkpointed or chunked. :class:`ActivationOffloader` moves it to
host memory instead, and back before the layer recomputes:

- **Forward**: as the layer's checkpoint saves its input, a copy to a pinned host buffer is queued
  on a side stream, after the compute stream's work that produced it; the device tensor is freed
  once that copy is done (``record_stream``), while the compute stream runs the next layers.
- **Backward**: layers recompute in the reverse order. When one asks for its input (waiting for
  it if it is still on its way), the copy back of the next one to recompute starts on the side
  stream, overlapped with this layer's recomputation and backward. At most two layers' inputs are
  on the device at a time.
- **Buffers**: pinned host buffers are allocated as needed the first step and reused by later
  ones (a buffer is free again once the autograd graph that saved it is freed); buffers smaller
  than a new request are released first, so a run whose sequences grow does not keep the short
  ones' buffers. The buffers are host memory of their own, pinned with ``cudaHostRegister`` (not
  PyTorch's pinned-memory cache, which keeps what it once allocated): a released buffer goes back to
  the host. :attr:`ActivationOffloader.host_bytes` is what is held. A buffer that would leave
  the host with less than 5% of its memory available is refused (:class:`HostMemoryError`, which
  says how much the step needs), rather than letting the kernel kill the process.

The copies are exact: the gradients are bitwise those of the same checkpointing without offload.
On a CPU model the same path runs without streams: a copy into a separate host buffer and back.

Only the layer's first positional argument (the hidden states) moves; what a layer gets by keyword
(rotary tables, masks, shared by all layers) stays where Hugging Face keeps it.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch


# Host memory left available after any pinned buffer, as a fraction of the host's total.
HOST_RESERVE_FRACTION = 0.05


class HostMemoryError(MemoryError):
    """Offloaded checkpoints need more pinned host memory than the host has available."""


def host_memory() -> tuple[int, int]:
    """``(available, total)`` host memory in bytes (Linux's ``MemAvailable``; elsewhere free pages)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024, total
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), total


def _check_cuda(status, call: str) -> None:
    if int(status) != 0:
        raise RuntimeError(f"offloaded checkpoints: {call} failed with CUDA error {int(status)} ({status})")


def _unpin(buffers: list[torch.Tensor], pinned: set[int]) -> None:
    if pinned:
        torch.cuda.synchronize()
    for buffer in buffers:
        if buffer.data_ptr() in pinned:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    pinned.clear()


class _HostCopy:
    """A saved tensor while it is in host memory: its buffer, and its device copy once fetched."""

    def __init__(self, buffer: torch.Tensor, shape: torch.Size, dtype: torch.dtype, device: torch.device):
        self.buffer, self.shape, self.dtype, self.device = buffer, shape, dtype, device
        self.fetched: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def host_view(self) -> torch.Tensor:
        return self.buffer[: self.shape.numel() * self.dtype.itemsize].view(self.dtype).view(self.shape)


class ActivationOffloader:
    """Moves saved layer inputs to host memory in forward and back ahead of their recomputation
    (see the module docstring). One per model; :func:`offloaded_checkpoint` makes a layer's
    checkpoint function use it."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._free: list[torch.Tensor] = []  # uint8 host buffers no saved tensor uses
        self._pinned: set[int] = set()  # the data pointers of the buffers registered with CUDA
        # Buffers in use belong to saved tensors, which keep the offloader alive: when it goes, its
        # buffers are all free, and are unregistered before their memory is freed.
        weakref.finalize(self, _unpin, self._free, self._pinned)
        self._held = 0
        self._in_use = 0
        self.peak_in_use = 0  # bytes in use at most since reset_peak()
        # The saved inputs in host memory, in the order their layers ran, until fetched.
        self._waiting: list[weakref.ref[_HostCopy]] = []

    @property
    def host_bytes(self) -> int:
        """Host memory held by the buffers, in use or free (bytes)."""
        return self._held

    def reset_peak(self) -> None:
        """Start counting :attr:`peak_in_use` again (from what is in use now)."""
        self.peak_in_use = self._in_use

    def keep_free(self, max_bytes: int) -> None:
        """Release the largest free buffers until the free ones hold at most ``max_bytes``."""
        self._free.sort(key=torch.Tensor.numel)
        kept = 0
        for index, buffer in enumerate(self._free):
            if kept + buffer.numel() > max_bytes:
                self._drop(self._free[index:])
                del self._free[index:]
                break
            kept += buffer.numel()

    @contextlib.contextmanager
    def saving(self, tensor: torch.Tensor) -> Iterator[None]:
        """Inside, a save of ``tensor`` by autograd (a checkpoint saving its input) goes to host memory."""
        # Autograd keeps the pack hook as long as what it saved: a weak reference, or the hook
        # would keep the device tensor alive that it moves to the host.
        target = weakref.ref(tensor)

        def pack(saved: torch.Tensor) -> Any:
            return self._offload(saved) if saved is target() else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        self._in_use += nbytes
        self.peak_in_use = max(self.peak_in_use, self._in_use)
        fitting = [buffer for buffer in self._free if buffer.numel() >= nbytes]
        if fitting:
            buffer = min(fitting, key=torch.Tensor.numel)
            self._free.remove(buffer)
            return buffer
        # Nothing free is large enough: the free buffers are from shorter sequences; let them go.
        self._drop(self._free)
        self._free.clear()
        available, total = host_memory()
        if available - nbytes < HOST_RESERVE_FRACTION * total:
            self._in_use -= nbytes
            raise HostMemoryError(
                f"offloaded checkpoints: {self._in_use / 2**30:.2f} GiB of host memory are in use for this step and "
                f"another {nbytes / 2**30:.2f} GiB are needed, but the host has {available / 2**30:.2f} GiB "
                f"available of {total / 2**30:.1f} GiB (5% is kept free): keep more layers on the device, offload "
                "fewer, or train shorter sequences"
            )
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if pin:
            _check_cuda(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0), "cudaHostRegister")
            self._pinned.add(buffer.data_ptr())
        self._held += nbytes
        return buffer

    def _drop(self, buffers: list[torch.Tensor]) -> None:
        """Give free buffers back to the host, once no copy may still use them."""
        pinned = [buffer for buffer in buffers if buffer.data_ptr() in self._pinned]
        if pinned and self._stream is not None:
            self._stream.synchronize()
        for buffer in pinned:
            self._pinned.remove(buffer.data_ptr())
            _check_cuda(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()), "cudaHostUnregister")
        self._held -= sum(buffer.numel() for buffer in buffers)

    def _release(self, buffer: torch.Tensor, nbytes: int) -> None:
        self._in_use -= nbytes
        self._free.append(buffer)

    def _offload(self, tensor: torch.Tensor) -> _HostCopy:
        stream = self._side_stream(tensor.device)
        saved = _HostCopy(self._buffer(tensor.nbytes, pin=stream is not None), tensor.shape, tensor.dtype, tensor.device)
        weakref.finalize(saved, self._release, saved.buffer, tensor.nbytes)
        if stream is None:
            saved.host_view().copy_(tensor)
        else:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                saved.host_view().copy_(tensor.detach(), non_blocking=True)
            # The compute stream may free the tensor now; its memory is not reused before the copy ends.
            tensor.record_stream(stream)
        self._waiting = [ref for ref in self._waiting if ref() is not None] + [weakref.ref(saved)]
        return saved

    def _fetch(self, saved: _HostCopy) -> None:
        """Queue the copy of ``saved`` back to its device (on the side stream on a GPU)."""
        fetched = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
        stream = self._side_stream(saved.device)
        if stream is None:
            fetched.copy_(saved.host_view())
        else:
            stream.wait_stream(torch.cuda.current_stream(saved.device))
            with torch.cuda.stream(stream):
                fetched.copy_(saved.host_view(), non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(stream)
            # Should the graph be freed before the layer asks for it, its memory waits for the copy.
            fetched.record_stream(stream)
        saved.fetched = fetched

    def _unpack(self, saved: Any) -> Any:
        if not isinstance(saved, _HostCopy):
            return saved
        if saved.fetched is None:
            self._fetch(saved)
        tensor, saved.fetched = saved.fetched, None
        if saved.ready is not None:
            torch.cuda.current_stream(saved.device).wait_event(saved.ready)
            saved.ready = None
        self._prefetch_before(saved)
        return tensor

    def _prefetch_before(self, saved: _HostCopy) -> None:
        """Drop ``saved`` from the waiting list and start fetching the input saved just before it:
        the next layer that backward recomputes."""
        alive = [ref() for ref in self._waiting]
        index = next((i for i, other in enumerate(alive) if other is saved), None)
        if index is not None:
            previous = next((other for other in reversed(alive[:index]) if other is not None), None)
            if previous is not None and previous.fetched is None:
                self._fetch(previous)
        self._waiting = [ref for ref, other in zip(self._waiting, alive) if other is not None and other is not saved]


class OffloadedCheckpoint:
    """A layer's checkpoint function (Hugging Face's ``_gradient_checkpointing_func``) whose saved
    input goes to host memory through ``offloader``. ``keywords`` are the wrapped function's (tigon's
    MLP reads ``use_reentrant`` there)."""

    def __init__(self, checkpoint: Callable[..., Any], offloader: ActivationOffloader):
        self.checkpoint, self.offloader = checkpoint, offloader

    @property
    def keywords(self) -> dict[str, Any]:
        return getattr(self.checkpoint, "keywords", {})

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not args or not isinstance(args[0], torch.Tensor):
            return self.checkpoint(function, *args, **kwargs)
        with self.offloader.saving(args[0]):
            return self.checkpoint(function, *args, **kwargs)
