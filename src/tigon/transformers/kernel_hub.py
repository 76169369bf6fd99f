"""transformers' kernel hub, served by tigon: :func:`kernel_config` and :func:`export_kernels`.

transformers 5.17 lets the ``kernels`` library swap the ``forward`` of the layers it has marked: a
class decorated ``use_kernel_forward_from_hub(name)`` (the RMSNorms, as ``"RMSNorm"``), or a
function that decorator turned into a module and attached to its callers with
``use_kernelized_func`` (the rotary ``apply_rotary_pos_emb``, as ``"rotary_pos_emb"``).
``kernelize`` gives each such module, in place, the ``forward`` of a layer class loaded from a
kernel repository; the module keeps its class, parameters and attributes, which that ``forward``
reads.

tigon answers those two names from a kernel repository on local disk that :func:`export_kernels`
writes (``tigon export-kernels DIR``): one noarch build per backend, whose ``layers`` module
re-exports :class:`RMSNorm` and :class:`ApplyRotaryPosEmb` from the installed tigon. The
repository holds no kernel code, so it always runs the tigon installed beside it, and nothing is
fetched from the Hub. :func:`kernel_config` returns the ``transformers.KernelConfig`` that names it.

One name stands for the layers of many models, and tigon is exact for the rows of
:data:`~tigon.transformers.families.FAMILIES` only: a layer of any other model keeps its own
forward. An RMSNorm is served with its row's epsilon attribute, offset and casting, a rotary
function with its row's drop-in (rotate-half, GPT-OSS's half tables, GLM's interleaved pairs).

What the hub does not reach in transformers 5.17, and :func:`~tigon.transformers.apply_tigon`
does: the MLP (no MLP class is registered; only its activation, as ``"SiLU"``, which tigon has no
kernel for alone), the loss (models call their ``loss_function`` on the logits, and no layer is
registered as ``"ForCausalLMLoss"``, though transformers' default mapping names it, so the fused
linear cross entropy has nothing to replace), and the norms and rotary functions a family does not
register (the Gemma line's RMSNorms, Phi-3's rotary function, ...: ``tests/transformers/
test_kernel_hub.py`` lists them).
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from pathlib import Path

from torch import nn
from transformers import KernelConfig

import tigon
from tigon import functional as F
from tigon.transformers import layers
from tigon.transformers.families import FAMILIES, Norm, Rope

# transformers' name for a layer -> the class serving it in the exported repository's `layers`.
HUB_LAYERS = {"RMSNorm": "RMSNorm", "rotary_pos_emb": "ApplyRotaryPosEmb"}
# The noarch builds written, and the device types the mapping names: Triton's GPU backends that
# tigon targets, and the CPU, where tigon's kernels run through Triton's interpreter (tests, not
# speed). Every build holds the same few lines.
BACKENDS = ("cuda", "rocm", "cpu")
KERNEL_NAME = "tigon"

# The rotary forms whose drop-in has the hub's ``rotary_pos_emb`` signature (q, k, cos, sin, unsqueeze_dim).
HUB_ROPE_FORMS = ("rotate_half", "half_table", "glm", "glm4v")
_ROW_OF_CLASS: dict[type, Norm | Rope | None] = {}


def hub_row(module: nn.Module) -> Norm | Rope | None:
    """The RMSNorm sub-row of ``FAMILIES`` naming ``module``'s class, or the rotary sub-row naming
    the function ``module`` is, else ``None``. (``kernels`` makes each decorated function a
    one-off ``nn.Module`` class and puts an instance of it in the function's place in its modeling
    module.) Found once per class; a miss is looked up again, as apply_tigon may have put its own
    function in that place."""
    cls = type(module)
    if _ROW_OF_CLASS.get(cls) is None:
        original = getattr(cls, "tigon_replaces", cls)  # a class apply_tigon patched
        _ROW_OF_CLASS[cls] = next(
            (
                row for family in FAMILIES.values() for row in (*family.norms, *family.ropes)
                if (isinstance(row, Norm) and row.kind == "rms"
                    and (original.__module__, original.__name__) == (family.module, row.name))
                or (isinstance(row, Rope) and row.form in HUB_ROPE_FORMS
                    and getattr(sys.modules.get(family.module), row.name, None) is module)
            ),
            None,
        )
    return _ROW_OF_CLASS[cls]


# ``kernels`` accepts a layer class only without ``__init__`` or attributes beyond these two flags,
# and with the ``forward`` signature of the module it serves; the forward runs bound to that module.
class RMSNorm(nn.Module):
    """``forward`` of the modules registered as ``"RMSNorm"``: :func:`tigon.functional.rms_norm`
    over the module's ``weight``, with its family's epsilon attribute, offset and casting."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states):
        row = hub_row(self)
        if not isinstance(row, Norm):
            return type(self).forward(self, hidden_states)
        weight = getattr(self, "weight", None)
        return F.rms_norm(hidden_states, weight, getattr(self, row.eps), row.offset, row.casting)


class ApplyRotaryPosEmb(nn.Module):
    """``forward`` of the functions registered as ``"rotary_pos_emb"``: the drop-in of
    :data:`tigon.transformers.layers.ROPE_FORMS` for the function's row. The function's module is
    shared by every model of its family in the process, so kernelizing one model swaps it for all
    of them, as ``apply_tigon``'s rotary patch does."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        row = hub_row(self)
        if not isinstance(row, Rope):
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
        return layers.ROPE_FORMS[row.form](q, k, cos, sin, unsqueeze_dim)


class TigonKernelConfig(KernelConfig):
    """A ``transformers.KernelConfig`` naming tigon's layers in the kernel repository at
    ``repo_path``, in transformers' local form (``use_local_kernel=True``, values
    ``"/abs/path:Layer"``).

    It replaces two of ``KernelConfig``'s steps, which in transformers 5.17 fail for this use:

    - ``sanitize_kernel_mapping`` keeps the names that ``model`` registers (transformers raises on
      any other, and Gemma registers no RMSNorm, Phi-3 no rotary function), rebuilding the mapping
      each time, so that one config serves any model and repeated calls;
    - ``create_compatible_mapping`` registers each layer for every device type of
      :data:`BACKENDS` and every mode (``kernels``' ``Mode.FALLBACK``). transformers' own registers
      the model's current device and mode only, so the layers go back to their own forward when
      the model later changes mode (``from_pretrained`` kernelizes in eval mode, and
      ``model.train()`` kernelizes again) or device; it also refuses the CPU, and fails on the
      ``(path, options)`` pairs that ``from_pretrained`` rewrites the mapping into.
    """

    def __init__(self, repo_path):
        self.repo_path = Path(repo_path).resolve()
        super().__init__(self._local_mapping(HUB_LAYERS), use_local_kernel=True)

    def _local_mapping(self, names):
        return {name: f"{self.repo_path}:{HUB_LAYERS[name]}" for name in names}

    def sanitize_kernel_mapping(self, model):
        self.store_registered_layer_names(model)
        registered = set(self.registered_layer_names.values())
        self.kernel_mapping = self._local_mapping(name for name in HUB_LAYERS if name in registered)
        others = {
            type(module).__name__ for module in model.modules()
            if getattr(type(module), "kernel_layer_name", None) in HUB_LAYERS and hub_row(module) is None
        }
        others |= {
            f"{type(module).__name__}.{name}" for module in model.modules()
            for name, function in getattr(module, "_kernel_funcs", {}).items()
            if function.kernel_layer_name in HUB_LAYERS and hub_row(function) is None
        }
        if others:
            warnings.warn(
                f"tigon: {', '.join(sorted(others))} belong to no family tigon supports and keep their own forward",
                stacklevel=2,
            )

    def create_compatible_mapping(self, model, compile=False):
        from kernels import LocalLayerRepository

        self.kernel_mapping = {
            name: dict.fromkeys(BACKENDS, LocalLayerRepository(repo_path=self.repo_path, layer_name=HUB_LAYERS[name]))
            for name in self.kernel_mapping
        }


def kernel_config(repo_path=None) -> TigonKernelConfig:
    """A ``transformers.KernelConfig`` for tigon's layers, loaded from disk by ``kernels``::

        model = AutoModelForCausalLM.from_pretrained(path, kernel_config=kernel_config())
        model.set_use_kernels(True, kernel_config=kernel_config())   # a model already built

    Args:
        repo_path: a kernel repository written by ``tigon export-kernels``; by default tigon
            exports one into its cache (``$XDG_CACHE_HOME/tigon``, else ``~/.cache/tigon``).
    """
    if repo_path is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        repo_path = export_kernels(cache / "tigon" / f"kernels-{tigon.__version__}")
    elif not (Path(repo_path) / "build").is_dir():
        raise FileNotFoundError(
            f"kernel_config: {repo_path} holds no kernel repository (no build/); "
            f"write one with `tigon export-kernels {repo_path}`"
        )
    return TigonKernelConfig(repo_path)


def export_kernels(directory) -> Path:
    """Write tigon as a kernel repository that the ``kernels`` library loads, into ``directory``
    (created if missing; an earlier export there is brought up to date). Returns its path.

    One noarch build per backend of :data:`BACKENDS` (the layout that replaced ``kernels``'
    ``torch-universal`` build of Python-only kernels)::

        README.md
        build/torch-<backend>/metadata.json
        build/torch-<backend>/tigon/__init__.py    checks that tigon is installed
        build/torch-<backend>/tigon/layers.py      re-exports tigon's layers

    ``python-depends`` is empty: ``kernels`` accepts there only the packages of its own list
    (einops, tvm-ffi, ...), so the package itself says when tigon is missing.
    """
    root = Path(directory).resolve()
    names = ", ".join(f"`{layer}` ({name!r})" for name, layer in HUB_LAYERS.items())
    classes = sorted(HUB_LAYERS.values())
    for backend in BACKENDS:
        build = root / "build" / f"torch-{backend}"
        _write(build / "metadata.json", json.dumps(_metadata(backend), indent=2) + "\n")
        _write(build / KERNEL_NAME / "__init__.py", _PACKAGE.format(version=tigon.__version__, names=names))
        _write(build / KERNEL_NAME / "layers.py", _LAYERS.format(classes=", ".join(classes), all=classes))
    _write(root / "README.md", _README.format(version=tigon.__version__, names=names))
    return root


def _metadata(backend: str) -> dict:
    return {
        "name": KERNEL_NAME,
        # The name kernels imports the package under: one per build and tigon version.
        "id": "_" + re.sub(r"\W", "_", f"{KERNEL_NAME}_{backend}_{tigon.__version__}"),
        # The layers' interface version (what a Hub user pins with version=1), not tigon's.
        "version": 1,
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": {"type": backend},
    }


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` unless it holds it already, through a temporary file and a
    rename, so that processes exporting at once (one per rank) never read a half-written file."""
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


_PACKAGE = '''"""tigon's layers for transformers' kernel hub, written by `tigon export-kernels` (tigon {version}).

Layers: {names}. They are imported from the installed tigon package, whose kernels they run:
this repository holds no kernel code.
"""

try:
    import tigon.transformers.kernel_hub  # noqa: F401
except ImportError as error:
    raise ImportError(
        "this kernel repository runs the tigon package, which is missing or too old: install tigon "
        ">= {version} with its transformers extra"
    ) from error

from . import layers

__all__ = ["layers"]
'''

_LAYERS = '''from tigon.transformers.kernel_hub import {classes}

__all__ = {all!r}
'''

_README = """# tigon kernels

tigon's layers for transformers' kernel hub (`kernels` 0.16), written by `tigon export-kernels`
(tigon {version}). Layers: {names}. Each build imports them from the tigon package installed
beside `kernels`: this repository holds no kernel code.

```python
from tigon.transformers import kernel_config

model = AutoModelForCausalLM.from_pretrained(path, kernel_config=kernel_config("path/to/this/repository"))
```
"""
