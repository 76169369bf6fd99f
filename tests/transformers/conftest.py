import pytest


@pytest.fixture(autouse=True)
def hugging_face_modules_restored_after_each_test(hugging_face_modules_restored):
    """Every test here starts from, and leaves behind, Hugging Face's modeling modules
    (tests/conftest.py)."""
    yield
