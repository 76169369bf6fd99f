"""Every family, patched both ways, trains as the plain Hugging Face model does."""

import importlib

import pytest

from tigon.transformers import FAMILIES, PATCHERS, apply_tigon, layers
from tiny_models import tiny_model, train
from utils import relative_error

# fp32 against Hugging Face's eager fp32: one step agrees to rounding. Adam divides each update by
# the gradient's running RMS, which magnifies those rounding differences in weights whose gradient
# is tiny, so later steps get a looser bound (a real error is of order 1).
FIRST_STEP = 1e-5
LATER_STEPS = 1e-3


def assert_uses_tigon(model, model_type):
    family = FAMILIES[model_type]
    module = importlib.import_module(family.module)
    for class_name, mixin in ((family.rms_norm, layers.TigonRMSNorm), (family.mlp, layers.TigonMLP)):
        if class_name is None:
            continue
        found = [m for m in model.modules() if class_name in type(m).__name__]
        assert found and all(isinstance(m, mixin) for m in found), f"{class_name} not patched"
    assert getattr(module, family.rope) is layers.apply_rotary_pos_emb
    assert hasattr(model.forward, "tigon_wraps")


def assert_same_run(run, truth, steps):
    for step in range(steps):
        limit = FIRST_STEP if step == 0 else LATER_STEPS
        assert relative_error(run.losses[step], truth.losses[step]) <= limit, f"loss at step {step}"
        assert run.grads[step].keys() == truth.grads[step].keys()
        for name, grad in truth.grads[step].items():
            error = relative_error(run.grads[step][name], grad)
            assert error <= limit, f"grad of {name} at step {step}: relative error {error:.3g}"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_trains_like_plain(model_type):
    truth = train(tiny_model(model_type))

    # A built model, patched in place.
    patched = apply_tigon(tiny_model(model_type))
    assert_uses_tigon(patched, model_type)
    assert_same_run(train(patched, steps=1), truth, steps=1)

    # The modeling module, patched before the model is built: same initial weights, same run.
    PATCHERS[model_type]()
    model = tiny_model(model_type)
    assert_uses_tigon(model, model_type)
    run = train(model)
    assert_same_run(run, truth, steps=len(truth.losses))
    assert relative_error(run.eval_logits, truth.eval_logits) <= LATER_STEPS
