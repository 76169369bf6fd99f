"""The releases tigon is tested with, and what it says of others.

``TESTED`` holds, for each library whose internals tigon calls or patches, the oldest and the
newest release (major.minor) that a test run covers: the oldest-set CI job (``.ci/compat``), the
main suite (``make test``), the newest-releases CI job (``.ci/newest``) and the GPU machine's
suite. An older release than the oldest is refused where tigon needs what it lacks (torch, triton
and transformers: ``pyproject.toml``'s lower bounds, and ``import tigon.transformers``); a newer
release than the newest is used, with an :class:`UntestedVersionWarning` that names it and the
tested range, since most new releases keep what tigon uses and the families table leaves what one
lacks to Hugging Face (:class:`tigon.transformers.MissingInTransformersWarning`).
"""

from __future__ import annotations

import importlib.metadata
import warnings

from packaging.version import Version

# package -> (oldest, newest) release tested, as (major, minor).
TESTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "torch": ((2, 11), (2, 14)),
    "triton": ((3, 6), (3, 8)),
    "transformers": ((5, 6), (5, 24)),
    "peft": ((0, 17), (0, 21)),
    "trl": ((1, 16), (1, 16)),
}


class UntestedVersionWarning(UserWarning):
    """A library newer than the newest release tigon is tested with: tigon runs with it, unchecked."""


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string; a pre-release or local build counts as its release
    (``"2.14.1+cu130"`` → ``(2, 14)``)."""
    major, minor, *_ = (*Version(version).release, 0)
    return major, minor


def tested_range(package: str) -> str:
    """``TESTED[package]`` as people write it: ``"2.11 to 2.14"``."""
    (old_major, old_minor), (new_major, new_minor) = TESTED[package]
    return f"{old_major}.{old_minor} to {new_major}.{new_minor}"


def installed_version(package: str) -> str | None:
    """The installed distribution's version, read without importing it; ``None`` if absent."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def warn_if_newer(package: str, version: str | None = None, stacklevel: int = 2) -> bool:
    """Warn (:class:`UntestedVersionWarning`) if ``package`` at ``version`` (default: the installed
    one) is newer than the newest release tigon is tested with; returns whether it warned."""
    version = version if version is not None else installed_version(package)
    newest = TESTED[package][1]
    if version is None or release(version) <= newest:
        return False
    warnings.warn(
        f"tigon is tested with {package} {tested_range(package)}, and {package} {version} is installed: "
        f"tigon runs with it, but unchecked; if something fails, install {package} "
        f"{newest[0]}.{newest[1]} and report the failure with `tigon --version`",
        UntestedVersionWarning,
        stacklevel=stacklevel + 1,
    )
    return True


def check_interpreter_numpy(triton_version: str, numpy_version: str) -> None:
    """Refuse, before any kernel runs, numpy 2.4 or newer under the interpreter of Triton 3.6 or
    older, which converts 1-element arrays with ``int()`` (numpy 2.4 removed that): each kernel
    would fail with a TypeError deep inside Triton. Triton 3.8's interpreter runs with numpy 2.4."""
    if release(numpy_version) >= (2, 4) and release(triton_version) < (3, 7):
        raise ImportError(
            f"tigon runs its kernels through Triton's interpreter here (no CUDA device), and Triton "
            f"{triton_version}'s interpreter fails with numpy {numpy_version}: install numpy below 2.4 "
            f'(pip install "numpy<2.4") or Triton 3.8 or newer with its torch'
        )
