import pytest
import torch

from tigon.testing import reference
import tigon.functional as tf
import tigon.nn as tnn
from tigon.ops import layer_norm as layer_norm_ops
from utils import DEVICE, DTYPES, ON_GPU, assert_close, leaf_copies, pick, randn

SHAPES = pick(
    # (211, 40) and (9, 5000) give the backward several programs, each looping over several row
    # blocks; rows of 16K or more take the backward whose weight is reloaded at each step.
    cpu=[(7, 33), (3, 5, 128), (2, 300), (211, 40), (9, 5000), (5, 16400)],
    gpu=[(4096, 4096), (3, 1000, 5120), (257, 8192), (4096, 1024), (1000, 16384)],
)


def _x(shape, dtype, layout):
    if layout == "strided":
        # Rows of a wider buffer: any row stride must be read in place.
        return randn(*shape[:-1], shape[-1] + 8, dtype=dtype)[..., 3 : 3 + shape[-1]].requires_grad_()
    return randn(*shape, dtype=dtype, requires_grad=True)


def _params(n_cols, dtype, weight=True, bias=True, requires_grad=True):
    def make(present):
        return randn(n_cols, dtype=dtype, requires_grad=requires_grad) if present else None

    return make(weight), make(bias)


def _check_against_reference(x, weight, bias, eps=1e-5):
    """Runs tigon and the fp64 reference on the same values and the same output gradient, then
    compares the output and the gradient of every input that requires one."""
    dtype = x.dtype
    truth_inputs = leaf_copies(x, weight, bias)
    out = tf.layer_norm(x, weight, bias, eps=eps)
    truth = reference.layer_norm(*truth_inputs, eps=eps)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, truth, dtype, "output")

    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    truth.backward(grad_out.to(truth.dtype))
    for name, tensor, truth_tensor in zip(("x", "weight", "bias"), (x, weight, bias), truth_inputs):
        if tensor is not None and tensor.requires_grad:
            assert tensor.grad.dtype == tensor.dtype
            assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_layer_norm(shape, dtype, layout):
    x = _x(shape, dtype, layout)
    _check_against_reference(x, *_params(shape[-1], dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight, bias", [(True, False), (False, True), (False, False)])
def test_layer_norm_without_params(dtype, weight, bias):
    shape = SHAPES[0]
    x = randn(*shape, dtype=dtype, requires_grad=True)
    _check_against_reference(x, *_params(shape[-1], dtype, weight, bias))


@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_frozen_param_gets_no_grad(frozen):
    shape = SHAPES[0]
    x = randn(*shape, requires_grad=True)
    weight, bias = _params(shape[-1], torch.float32)
    frozen_param = weight if frozen == "weight" else bias
    frozen_param.requires_grad_(False)
    _check_against_reference(x, weight, bias)
    assert frozen_param.grad is None


def test_layer_norm_fp32_params_with_half_input():
    # Mixed precision: bf16 activations, fp32 parameters whose gradients stay fp32.
    shape = SHAPES[1]
    x = randn(*shape, dtype=torch.bfloat16, requires_grad=True)
    _check_against_reference(x, *_params(shape[-1], torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_large_mean_and_eps(dtype):
    # A mean far above the spread: a one-pass E[x²] − mean² variance misses the fp32 tolerance here.
    shape = SHAPES[2]
    x = (randn(*shape) * 0.5 + 16.0).to(dtype).requires_grad_()
    _check_against_reference(x, *_params(shape[-1], dtype), eps=0.1)


def test_layer_norm_leading_dims_not_mergeable():
    # A transposed batch cannot be viewed as rows: the launcher copies it and still answers right.
    shape = SHAPES[1]
    x = randn(shape[1], shape[0], shape[2]).transpose(0, 1).requires_grad_()
    _check_against_reference(x, *_params(shape[-1], torch.float32))


def test_nan_propagates():
    x = randn(4, 64, requires_grad=True)
    with torch.no_grad():
        x[1, 5] = float("nan")
    weight, bias = _params(64, torch.float32)
    out = tf.layer_norm(x, weight, bias)
    assert out[1].isnan().all() and out[[0, 2, 3]].isfinite().all()
    out.backward(torch.ones_like(out))
    assert x.grad[1].isnan().all() and x.grad[[0, 2, 3]].isfinite().all()
    assert weight.grad.isnan().all() and bias.grad.isfinite().all()


@pytest.mark.parametrize("weight, bias", [(True, True), (False, True), (True, False)])
def test_custom_ops_fake_matches_real(weight, bias):
    # The fake functions must give the real outputs' shapes, dtypes and strides, or
    # torch.compile miscompiles whatever follows the op.
    x = randn(3, 5, 48, dtype=torch.bfloat16)[:, :, :40]
    weight, bias = _params(40, torch.bfloat16, weight, bias, requires_grad=False)
    offset = 1.0 if weight is not None else 0.0
    y, mean, rstd = layer_norm_ops.layer_norm_fwd(x, weight, bias, 1e-5, offset)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(layer_norm_ops.layer_norm_fwd.op, (x, weight, bias, 1e-5, offset), test_utils=checks)
    bias_dtype = None if bias is None else bias.dtype
    bwd_args = (torch.randn_like(x), x, weight, mean, rstd, offset, weight is not None, bias is not None, bias_dtype)
    torch.library.opcheck(layer_norm_ops.layer_norm_bwd.op, bwd_args, test_utils=checks)


def test_torch_compile_fullgraph():
    shape = SHAPES[1]
    x = randn(*shape, requires_grad=True)
    weight, bias = _params(shape[-1], torch.float32)
    # Off the GPU, aot_eager traces through the fake functions without needing a C++ toolchain.
    compiled = torch.compile(tf.layer_norm, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    out = compiled(x, weight, bias)
    eager_inputs = leaf_copies(x, weight, bias, dtype=torch.float32)
    eager = tf.layer_norm(*eager_inputs)
    assert_close(out, eager, torch.float32, "compiled output")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    eager.backward(grad_out)
    for name, tensor, eager_tensor in zip(("x", "weight", "bias"), (x, weight, bias), eager_inputs):
        assert_close(tensor.grad, eager_tensor.grad, torch.float32, f"compiled grad of {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_layer_norm_offset(shape, dtype):
    # Nemotron's weight + 1, with small weights as such a model keeps them: the sum rounds to
    # the weight's dtype in both.
    x = _x(shape, dtype, "strided")
    weight = randn(shape[-1], dtype=dtype, requires_grad=True, scale=0.1)
    bias = randn(shape[-1], dtype=dtype, requires_grad=True)
    truth_inputs = leaf_copies(x, weight, bias)
    out = tf.layer_norm(x, weight, bias, offset=1.0)
    truth = reference.layer_norm(*truth_inputs, offset=1.0)
    assert_close(out, truth, dtype, "output")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    truth.backward(grad_out.to(truth.dtype))
    for name, tensor, truth_tensor in zip(("x", "weight", "bias"), (x, weight, bias), truth_inputs):
        assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_1p_matches_hugging_face(dtype):
    """Nemotron's NemotronLayerNorm1P itself (weights copied): outputs bit for bit in 16-bit
    dtypes but for the rare last-place difference of fp32 statistics, gradients within tolerance."""
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    shape = pick(cpu=(3, 5, 96), gpu=(4, 1024, 4096))
    module = NemotronLayerNorm1P(shape[-1], eps=1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(randn(shape[-1], scale=0.1))
        module.bias.copy_(randn(shape[-1]))
    x = randn(*shape, dtype=dtype, requires_grad=True)
    weight, bias = (p.detach().clone().requires_grad_() for p in (module.weight, module.bias))
    out = tf.layer_norm(x, weight, bias, module.eps, offset=1.0)
    expected = module(x)
    assert_close(out, expected, dtype, "output against the module")
    if dtype != torch.float32:
        assert (out != expected).float().mean().item() <= 0.01, "16-bit outputs differ from the module's roundings"
    dy = randn(*shape, dtype=dtype)
    grads = torch.autograd.grad(out, (x, weight, bias), dy)
    expected_grads = torch.autograd.grad(expected, (x, module.weight, module.bias), dy)
    for name, grad, expected_grad in zip(("x", "weight", "bias"), grads, expected_grads):
        assert_close(grad, expected_grad, dtype, f"grad of {name} against the module")


def test_layer_norm_1p_module_loads_hugging_face_weights():
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    hf = NemotronLayerNorm1P(40).to(DEVICE)
    with torch.no_grad():
        hf.weight.copy_(randn(40, scale=0.1))
        hf.bias.copy_(randn(40))
    module = tnn.LayerNorm(40, eps=hf.eps, offset=1.0, device=DEVICE)
    module.load_state_dict(hf.state_dict())
    x = randn(2, 7, 40)
    assert_close(module(x), hf(x), torch.float32, "module output")


def test_layer_norm_offset_needs_a_weight():
    with pytest.raises(ValueError, match="offset=1.0 is added to the weight, but weight is None"):
        tf.layer_norm(randn(3, 8), None, randn(8), offset=1.0)
