"""Every family, patched both ways, trains as the plain Hugging Face model does."""

import importlib

import pytest
import torch

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


# bf16 against fp32: Hugging Face's own bf16 run is the yardstick, and tigon's bf16 run must stay
# as close to the fp32 run as it does. Every step's loss: within twice Hugging Face's distance (or
# 2^-10, a quarter of bf16's resolution, where Hugging Face happens to land closer). The first
# step's gradients, computed from the same weights: all together within 1.25 times Hugging Face's
# distance, each parameter's within 4 times (or 4 · 2^-8). Later steps' gradients are not compared
# in bf16: Adam moves every weight by about ±lr at first whatever its gradient's size, so where a
# gradient entry is near zero the rounding noise of either run picks the sign, and both runs'
# later gradients scatter 3-20% around fp32's by chance; the losses show whether training agrees.
BF16_LOSS_FACTOR, BF16_LOSS_FLOOR = 2.0, 2.0**-10
BF16_GRADS_FACTOR, BF16_GRAD_FACTOR, BF16_GRAD_FLOOR = 1.25, 4.0, 2.0**-8


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


def _flat_grads(grads):
    return torch.cat([grad.flatten().double() for _, grad in sorted(grads.items())])


def assert_bf16_as_close_to_fp32_as_plain(patched, plain, truth):
    for step in range(len(truth.losses)):
        plain_error = relative_error(plain.losses[step], truth.losses[step])
        error = relative_error(patched.losses[step], truth.losses[step])
        assert error <= max(BF16_LOSS_FACTOR * plain_error, BF16_LOSS_FLOOR), (
            f"loss at step {step}: {error:.3g} from fp32, Hugging Face bf16 {plain_error:.3g}"
        )
    truth_grads, plain_grads, grads = truth.grads[0], plain.grads[0], patched.grads[0]
    plain_error = relative_error(_flat_grads(plain_grads), _flat_grads(truth_grads))
    error = relative_error(_flat_grads(grads), _flat_grads(truth_grads))
    assert error <= BF16_GRADS_FACTOR * plain_error, (
        f"gradients: {error:.3g} from fp32, Hugging Face bf16 {plain_error:.3g}"
    )
    for name, grad in truth_grads.items():
        plain_error = relative_error(plain_grads[name], grad)
        error = relative_error(grads[name], grad)
        assert error <= BF16_GRAD_FACTOR * max(plain_error, BF16_GRAD_FLOOR), (
            f"grad of {name}: {error:.3g} from fp32, Hugging Face bf16 {plain_error:.3g}"
        )


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_bf16_as_close_to_fp32_as_plain(model_type):
    truth = train(tiny_model(model_type))
    plain = train(tiny_model(model_type).to(torch.bfloat16))
    patched = train(apply_tigon(tiny_model(model_type).to(torch.bfloat16)))
    assert_bf16_as_close_to_fp32_as_plain(patched, plain, truth)


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_checkpointed_bf16_as_close_to_fp32_as_plain(model_type):
    # Under non-reentrant checkpointing the patched MLPs recompute their projections slice by slice
    # in backward (tigon.functional.swiglu_mlp / geglu_mlp), summing the input's gradient in bf16.
    truth = train(tiny_model(model_type))
    plain = train(tiny_model(model_type).to(torch.bfloat16))
    model = apply_tigon(tiny_model(model_type).to(torch.bfloat16))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_bf16_as_close_to_fp32_as_plain(train(model), plain, truth)
