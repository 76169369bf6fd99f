"""Without a GPU every test runs the real kernels through Triton's interpreter on CPU tensors."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def hugging_face_modules_restored():
    """Patching before a model is built changes Hugging Face's modeling modules for the whole
    process (and patching a model changes its module's rotary function): a test using this
    fixture leaves behind the modules as Hugging Face wrote them. PEFT's LoRA layers, which tigon's
    patches route through tigon for the whole process, start and end with PEFT's own forward."""
    from utils import hugging_face_state, restore_hugging_face

    state = hugging_face_state()
    restore_hugging_face(state)
    yield
    restore_hugging_face(state)
