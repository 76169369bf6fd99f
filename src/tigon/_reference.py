"""Access to the plain-PyTorch references in the source checkout's ``tests/reference.py``.

The references are the truth for tests, ``tigon check`` and the ``torch`` provider of
``tigon bench``; they live with the tests, so these commands run from a source checkout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "tests" / "reference.py"


def load_reference() -> ModuleType:
    """The module, registered in ``sys.modules`` (torch.compile looks functions' modules up there)."""
    if "tigon_reference" in sys.modules:
        return sys.modules["tigon_reference"]
    if not REFERENCE_PATH.is_file():
        raise RuntimeError(
            f"the references were not found at {REFERENCE_PATH}: run this command from a source checkout "
            "of tigon installed with `pip install -e .`"
        )
    spec = importlib.util.spec_from_file_location("tigon_reference", REFERENCE_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tigon_reference"] = module
    spec.loader.exec_module(module)
    return module
