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
    fixture leaves behind the modules as Hugging Face wrote them."""
    import importlib

    from tigon.transformers import FAMILIES

    saved = []
    for family in FAMILIES.values():
        module = importlib.import_module(family.module)
        head = getattr(module, family.head) if family.head else None
        saved.append((module, dict(vars(module)), head, dict(vars(head)) if head else {}))
    yield
    for module, names, head, class_names in saved:
        vars(module).update(names)
        for method in ("forward", "post_init") if head else ():
            if method in class_names:
                setattr(head, method, class_names[method])
            elif method in vars(head):
                delattr(head, method)
