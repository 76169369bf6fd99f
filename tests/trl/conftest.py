import importlib.util
from pathlib import Path

import pytest

from tigon.trl import unpatch_trl

# apply_tigon(model) changes Llama's modeling module (its rotary function) for the whole process:
# the fixture of tests/transformers restores Hugging Face's modules after each test here too.
_spec = importlib.util.spec_from_file_location(
    "tests_transformers_conftest", Path(__file__).parents[1] / "transformers" / "conftest.py"
)
_transformers_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_transformers_conftest)
hugging_face_modules_restored = _transformers_conftest.hugging_face_modules_restored


@pytest.fixture(autouse=True)
def trl_head_restored():
    """patch_trl() replaces TRL's fused LM head for the whole process: each test leaves TRL's own."""
    yield
    unpatch_trl()
