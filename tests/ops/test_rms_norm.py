import pytest
import torch

from tigon.testing import reference
import tigon.functional as tf
from tigon.ops import rms_norm as rms_norm_ops
from utils import DTYPES, assert_close, leaf_copies, pick, randn

SHAPES = pick(
    cpu=[(7, 33), (3, 5, 128), (2, 300)],
    gpu=[(4096, 4096), (3, 1000, 5120), (257, 8192), (64, 16384)],
)


def _x(shape, dtype, layout):
    if layout == "strided":
        # Rows of a wider buffer: any row stride must be read in place.
        return randn(*shape[:-1], shape[-1] + 8, dtype=dtype)[..., 3 : 3 + shape[-1]].requires_grad_()
    return randn(*shape, dtype=dtype, requires_grad=True)


def _check(outputs, truths, inputs, truth_inputs, dtype):
    grads_out = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(outputs, grads_out)
    torch.autograd.backward(truths, [g.to(t.dtype) for g, t in zip(grads_out, truths)])
    for i, (out, truth) in enumerate(zip(outputs, truths)):
        assert out.dtype == dtype
        assert_close(out, truth, dtype, f"output {i}")
    for name, tensor, truth in inputs_and_truths(inputs, truth_inputs):
        assert_close(tensor.grad, truth.grad, dtype, f"grad of {name}")


def inputs_and_truths(inputs, truth_inputs):
    return [(name, t, r) for (name, t), r in zip(inputs.items(), truth_inputs) if t is not None and t.requires_grad]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_rms_norm(shape, dtype, layout):
    x = _x(shape, dtype, layout)
    weight = randn(shape[-1], dtype=dtype, requires_grad=True)
    x64, w64 = leaf_copies(x, weight)
    out = tf.rms_norm(x, weight, eps=1e-6)
    truth = reference.rms_norm(x64, w64, eps=1e-6)
    _check([out], [truth], {"x": x, "weight": weight}, [x64, w64], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting_mode", ["llama", "gemma"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_options(dtype, casting_mode, offset):
    shape = SHAPES[1]
    x = randn(*shape, dtype=dtype, requires_grad=True)
    weight = randn(shape[-1], dtype=dtype, requires_grad=True, scale=0.1)
    x64, w64 = leaf_copies(x, weight)
    out = tf.rms_norm(x, weight, eps=1e-5, offset=offset, casting_mode=casting_mode)
    truth = reference.rms_norm(x64, w64, eps=1e-5, offset=offset, casting_mode=casting_mode)
    _check([out], [truth], {"x": x, "weight": weight}, [x64, w64], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_weight(dtype):
    x = randn(*SHAPES[0], dtype=dtype, requires_grad=True)
    (x64,) = leaf_copies(x)
    _check([tf.rms_norm(x)], [reference.rms_norm(x64)], {"x": x}, [x64], dtype)


def test_rms_norm_frozen_weight_gets_no_grad():
    x = randn(*SHAPES[0], requires_grad=True)
    weight = randn(SHAPES[0][-1])
    tf.rms_norm(x, weight).sum().backward()
    assert weight.grad is None and x.grad is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(shape, dtype):
    x = randn(*shape, dtype=dtype, requires_grad=True)
    residual = randn(*shape, dtype=dtype, requires_grad=True)
    weight = randn(shape[-1], dtype=dtype, requires_grad=True)
    x64, r64, w64 = leaf_copies(x, residual, weight)
    normed, summed = tf.fused_add_rms_norm(x, residual, weight)
    truth_normed, truth_summed = reference.fused_add_rms_norm(x64, r64, w64)
    _check(
        [normed, summed], [truth_normed, truth_summed],
        {"x": x, "residual": residual, "weight": weight}, [x64, r64, w64], dtype,
    )


def test_nan_propagates():
    x = randn(4, 64)
    x[1, 5] = float("nan")
    out = tf.rms_norm(x, randn(64))
    assert out[1].isnan().all() and out[[0, 2, 3]].isfinite().all()


@pytest.mark.parametrize("with_residual", [False, True])
def test_custom_ops_fake_matches_real(with_residual):
    # Fake outputs must match the real ones in shape, dtype and strides (also for a column-major
    # input, which the launcher copies), or torch.compile miscompiles whatever follows the op.
    x = randn(64, 40, dtype=torch.bfloat16).t()
    residual = randn(40, 64, dtype=torch.bfloat16) if with_residual else None
    weight = randn(64, dtype=torch.bfloat16)
    checks = ("test_schema", "test_faketensor")
    fwd_args = (x, residual, weight, 1e-6, 0.0, "llama")
    torch.library.opcheck(rms_norm_ops.rms_norm_fwd.op, fwd_args, test_utils=checks)
    _, summed, rstd = rms_norm_ops.rms_norm_fwd(*fwd_args)
    normed_input = summed if with_residual else x
    bwd_args = (torch.randn_like(x), residual, normed_input, weight, rstd, 0.0, True)
    torch.library.opcheck(rms_norm_ops.rms_norm_bwd.op, bwd_args, test_utils=checks)
