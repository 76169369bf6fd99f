"""The machine a bench command runs on, and where its results go: the device and the GPU's name,
the versions installed, whether the modules a command needs are, the memory counters of a device
(none on the CPU), the default folder.

Shared by ``tigon bench`` (:mod:`tigon.bench.command`), its subcommands and ``tigon demo``; it
imports nothing of theirs, so the dependencies run one way: command → e2e, moe → machine.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import torch

# The modules of tigon's "bench" extra: the plots and the progress bars of tigon bench and tigon demo.
BENCH_EXTRA = {"matplotlib": "bench", "tqdm": "bench"}

# What the results record the versions of, when installed.
DISTRIBUTIONS = (
    "tigon", "torch", "triton", "transformers", "accelerate", "peft", "trl", "datasets", "liger-kernel",
)


def require_modules(command: str, modules: Mapping[str, str]) -> None:
    """Exit, before any training or timing, with one line naming the modules of ``modules`` (each
    mapped to the extra of tigon that installs it) that are missing and the command installing
    them (by name: tigon is installed from a checkout or a wheel, not from the index); rather than a
    traceback once the work is done and the results are plotted."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        extras = ",".join(dict.fromkeys(modules[name] for name in missing))
        raise SystemExit(
            f"{command} needs {', '.join(missing)}, not installed here: pip install {' '.join(missing)} "
            f"(tigon's {extras} extra; in a checkout: pip install -e \".[{extras}]\")"
        )


def slug(name: str) -> str:
    """``name`` as a folder or file name: lower case, runs of other characters as one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_device(smoke: bool) -> tuple[bool, torch.device, str | None]:
    """Whether the run is a smoke run (asked for, or no GPU), its device and the GPU's name."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    return smoke or not on_gpu, device, torch.cuda.get_device_name(device) if on_gpu else None


def default_out(smoke: bool, gpu: str | None) -> Path:
    """The results folder when ``--out`` is not given: ``tigon-out/bench-smoke`` or
    ``tigon-out/bench-<gpu>`` of the working directory, wherever tigon is installed (results
    committed to a checkout's ``benchmarks/results/<gpu>`` are written there by ``--out``)."""
    return Path.cwd() / "tigon-out" / ("bench-smoke" if smoke or gpu is None else f"bench-{slug(gpu)}")


def version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict:
    """The device's name, Python's and CUDA's versions and those of ``DISTRIBUTIONS`` (``None``
    where not installed)."""
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "python": sys.version.split()[0],
        "cuda": torch.version.cuda, **{name: version(name) for name in DISTRIBUTIONS},
    }


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    """The peak memory allocated since the last :func:`reset_peak`; ``None`` on the CPU, which
    keeps no such counter."""
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
