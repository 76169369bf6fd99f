import pytest

from tigon.trl import unpatch_trl


@pytest.fixture(autouse=True)
def hugging_face_modules_restored_after_each_test(hugging_face_modules_restored):
    """apply_tigon(model) changes Llama's modeling module (its rotary function) for the whole
    process: each test here leaves Hugging Face's modules behind (tests/conftest.py)."""
    yield


@pytest.fixture(autouse=True)
def trl_head_restored():
    """patch_trl() replaces TRL's fused LM head for the whole process: each test leaves TRL's own."""
    yield
    unpatch_trl()
