"""Access to the plain-PyTorch references in the source checkout's ``tests/reference.py``.

The references are the truth for tests, ``tigon check`` and the ``torch`` provider of
``tigon bench``; they live with the tests, so these commands run from a source checkout.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "tests" / "reference.py"


def load_reference() -> ModuleType:
    if not REFERENCE_PATH.is_file():
        raise RuntimeError(
            f"the references were not found at {REFERENCE_PATH}: run this command from a source checkout "
            "of tigon installed with `pip install -e .`"
        )
    spec = importlib.util.spec_from_file_location("tigon_reference", REFERENCE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
