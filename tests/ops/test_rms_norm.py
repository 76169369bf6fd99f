import inspect

import pytest
import torch

from tigon.testing import reference
import tigon.functional as tf
import tigon.nn as tnn
from tigon.ops import rms_norm as rms_norm_ops
from utils import DEVICE, DTYPES, assert_close, assert_tensorwise_cast, leaf_copies, pick, randn

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


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize(("casting_mode", "offset"), [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_fp8_is_the_tensorwise_cast_of_the_16_bit_output(shape, layout, casting_mode, offset, power_of_2):
    # The norm's kernels cast its output to FP8 as torchao's tensorwise cast makes it from the
    # 16-bit output: the same bytes and scale. That output is the one the saved rstd gives (equal
    # to the 16-bit norm's but in a last bit, another compiled reduction on the GPU). The gradient
    # arrives in 16 bits, and the backward is the 16-bit norm's.
    float8_training_tensor = pytest.importorskip("torchao.float8.float8_training_tensor")
    from tigon.ops.fp8 import E4M3, Fp8Cast

    x = _x(shape, torch.bfloat16, layout)
    weight = randn(shape[-1], dtype=torch.bfloat16, requires_grad=True)
    data, rstd, scale = rms_norm_ops.rms_norm_fwd_fp8(x, weight, 1e-6, offset, casting_mode, E4M3, power_of_2)
    _, rstd_16_bit = rms_norm_ops.rms_norm_fwd(x, weight, 1e-6, offset, casting_mode)
    torch.testing.assert_close(rstd, rstd_16_bit, rtol=1e-6, atol=0)
    x_hat = x.detach().float() * rstd.view(*shape[:-1], 1)
    if casting_mode == "llama":
        x_hat = x_hat.to(torch.bfloat16).float()
    y = (x_hat * (weight.detach().float() + offset)).to(torch.bfloat16)
    assert data.dtype == E4M3
    assert_tensorwise_cast(data, scale, y, power_of_2)

    cast = Fp8Cast(E4M3, power_of_2, torch.bfloat16, float8_training_tensor.LinearMMConfig(),
                   float8_training_tensor.GemmInputRole.INPUT)
    y8 = rms_norm_ops.rms_norm_fp8(x, weight, 1e-6, offset, casting_mode, cast)
    assert isinstance(y8, float8_training_tensor.Float8TrainingTensor) and y8._gemm_input_role == cast.role
    assert y8._orig_dtype == torch.bfloat16 and torch.equal(y8._data.view(torch.uint8), data.view(torch.uint8))
    dy = torch.randn_like(y)
    dx, dw = rms_norm_ops.rms_norm_bwd(dy, None, x.detach(), weight.detach(), rstd, offset, True)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(torch.autograd.grad(y8, (x, weight), dy), (dx, dw)))


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
    if with_residual:
        fwd, fwd_args = rms_norm_ops.fused_add_rms_norm_fwd, (x, residual, weight, 1e-6, 0.0, "llama")
    else:
        fwd, fwd_args = rms_norm_ops.rms_norm_fwd, (x, weight, 1e-6, 0.0, "llama")
    torch.library.opcheck(fwd.op, fwd_args, test_utils=checks)
    *_, rstd = outputs = fwd(*fwd_args)
    normed_input = outputs[1] if with_residual else x
    bwd_args = (torch.randn_like(x), residual, normed_input, weight, rstd, 0.0, True)
    torch.library.opcheck(rms_norm_ops.rms_norm_bwd.op, bwd_args, test_utils=checks)


# --- Gated RMSNorm ---------------------------------------------------------------------------


def _n_groups(hidden):
    """The smallest divisor of ``hidden`` from 3 up: groups of odd and of power-of-two widths."""
    return next(d for d in range(3, hidden + 1) if hidden % d == 0)


def _gated_inputs(shape, dtype, layout="contiguous"):
    x, gate = _x(shape, dtype, layout), _x(shape, dtype, layout)
    weight = randn(shape[-1], dtype=dtype, requires_grad=True)
    return x, gate, weight


def _check_gated(x, gate, weight, **options):
    inputs = {"x": x, "gate": gate, "weight": weight}
    truth_inputs = leaf_copies(x, gate, weight)
    out = tf.rms_norm_gated(x, gate, weight, 1e-6, **options)
    truth = reference.rms_norm_gated(*truth_inputs, 1e-6, **options)
    assert out.shape == x.shape
    _check([out], [truth], inputs, truth_inputs, x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_rms_norm_gated(shape, dtype, layout):
    _check_gated(*_gated_inputs(shape, dtype, layout))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("casting_mode", ["llama", "gemma"])
@pytest.mark.parametrize("grouped", [False, True])
def test_rms_norm_gated_options(dtype, norm_before_gate, casting_mode, grouped):
    shape = SHAPES[0]  # H = 33: three groups of 11
    group_size = shape[-1] // _n_groups(shape[-1]) if grouped else None
    x, gate, weight = _gated_inputs(shape, dtype, "strided")
    _check_gated(x, gate, weight, group_size=group_size, norm_before_gate=norm_before_gate, casting_mode=casting_mode)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_gated_groups(shape):
    # Every shape cut into groups (widths 11, 32 and 100 on the CPU): each group its own rstd.
    x, gate, weight = _gated_inputs(shape, torch.float32)
    _check_gated(x, gate, weight, group_size=shape[-1] // _n_groups(shape[-1]))


@pytest.mark.parametrize("grouped", [False, True])
def test_rms_norm_gated_without_gate_or_weight(grouped):
    shape = SHAPES[2]
    group_size = shape[-1] // _n_groups(shape[-1]) if grouped else None
    x, _, weight = _gated_inputs(shape, torch.float32)
    _check_gated(x, None, weight, group_size=group_size)
    x, gate, _ = _gated_inputs(shape, torch.float32)
    _check_gated(x, gate, None, group_size=group_size)


def test_rms_norm_gated_fp32_weight_with_half_input():
    # A wider weight: torch's weight * x̂ is then fp32 and not rounded before the gate.
    x, gate, _ = _gated_inputs(SHAPES[1], torch.bfloat16)
    weight = randn(SHAPES[1][-1], requires_grad=True)
    _check_gated(x, gate, weight)


def test_rms_norm_gated_frozen_inputs_get_no_grad():
    x, gate, weight = _gated_inputs(SHAPES[0], torch.float32)
    gate.requires_grad_(False)
    weight.requires_grad_(False)
    tf.rms_norm_gated(x, gate, weight).sum().backward()
    assert x.grad is not None and gate.grad is None and weight.grad is None


def test_rms_norm_gated_bad_input_is_named():
    x, gate, weight = _gated_inputs((4, 12), torch.float32)
    with pytest.raises(ValueError, match=r"group_size must be a positive int dividing x's last dimension 12; got 5"):
        tf.rms_norm_gated(x, gate, weight, group_size=5)
    with pytest.raises(ValueError, match=r"gate must have shape \(4, 12\) \(the shape of x\), got \(4, 13\)"):
        tf.rms_norm_gated(x, randn(4, 13), weight)
    with pytest.raises(TypeError, match="x torch.float32, gate torch.bfloat16"):
        tf.rms_norm_gated(x, gate.bfloat16(), weight)
    with pytest.raises(ValueError, match=r"weight must have shape \(12,\).*got \(6,\)"):
        tf.rms_norm_gated(x, gate, weight[:6])
    with pytest.raises(ValueError, match="casting_mode must be one of 'llama', 'gemma'; got 'qwen'"):
        tf.rms_norm_gated(x, gate, weight, casting_mode="qwen")


def _hf_gated_norms():
    """``(name, module factory, tigon options)``: each Hugging Face gated norm and the arguments
    of :func:`tigon.functional.rms_norm_gated` that compute it."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated
    from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNormGated

    def falcon(n_groups, norm_before_gate):
        return (
            f"falcon_h1-groups{n_groups}-{'norm' if norm_before_gate else 'gate'}_first",
            lambda hidden: FalconH1RMSNormGated(hidden, 1e-6, n_groups, norm_before_gate),
            lambda hidden: dict(group_size=hidden // n_groups, norm_before_gate=norm_before_gate, casting_mode="gemma"),
        )

    def mamba2(hidden):
        # transformers 5.24 added group_size before eps: one group, the whole row, as before it.
        if "group_size" in inspect.signature(MambaRMSNormGated).parameters:
            return MambaRMSNormGated(hidden, group_size=hidden, eps=1e-6)
        return MambaRMSNormGated(hidden, eps=1e-6)

    return [
        ("qwen3_next", lambda hidden: Qwen3NextRMSNormGated(hidden, 1e-6), lambda hidden: {}),
        *(falcon(n_groups, before) for n_groups in (1, 4) for before in (True, False)),
        ("mamba2", mamba2, lambda hidden: dict(norm_before_gate=False)),
        (
            "zamba2", lambda hidden: Zamba2RMSNormGated(hidden, hidden // 4, 1e-6),
            lambda hidden: dict(group_size=hidden // 4, norm_before_gate=False),
        ),
    ]


HF_GATED_NORMS = {name: (make, options) for name, make, options in _hf_gated_norms()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", HF_GATED_NORMS)
def test_rms_norm_gated_matches_hugging_face(name, dtype):
    """The module itself (weights copied) on the same inputs: fp32 within the tolerance, and in
    16-bit dtypes the same roundings in the same order, so the outputs agree bit for bit but for
    the rare value whose fp32 rstd differs in the last place (in a wrong casting order a third of
    them differ); gradients within the dtype's tolerance of autograd through the module."""
    make, options = HF_GATED_NORMS[name]
    shape = pick(cpu=(3, 5, 96), gpu=(4, 1024, 4096))
    module = make(shape[-1]).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(randn(shape[-1]))
    x, gate = randn(*shape, dtype=dtype, requires_grad=True), randn(*shape, dtype=dtype, requires_grad=True)
    weight = module.weight.detach().clone().requires_grad_()

    out = tf.rms_norm_gated(x, gate, weight, module.variance_epsilon, **options(shape[-1]))
    expected = module(x, gate)
    assert out.dtype == expected.dtype == dtype
    assert_close(out, expected, dtype, "output against the module")
    if dtype != torch.float32:
        assert (out != expected).float().mean().item() <= 0.01, "16-bit outputs differ from the module's roundings"

    dy = randn(*shape, dtype=dtype)
    grads = torch.autograd.grad(out, (x, gate, weight), dy)
    expected_grads = torch.autograd.grad(expected, (x, gate, module.weight), dy)
    for what, grad, expected_grad in zip(("x", "gate", "weight"), grads, expected_grads):
        assert_close(grad, expected_grad, dtype, f"grad of {what} against the module")


def test_rms_norm_gated_module_loads_hugging_face_weights():
    name = "falcon_h1-groups4-gate_first"
    make, options = HF_GATED_NORMS[name]
    hidden = 48
    hf = make(hidden).to(DEVICE)
    with torch.no_grad():
        hf.weight.copy_(randn(hidden))
    module = tnn.RMSNormGated(hidden, eps=1e-6, **options(hidden), device=DEVICE)
    module.load_state_dict(hf.state_dict())
    x, gate = randn(2, 3, hidden), randn(2, 3, hidden)
    assert_close(module(x, gate), hf(x, gate), torch.float32, "module output")
    assert_close(module(x), hf(x), torch.float32, "module output without a gate")


# Rows of 512 or fewer features stack many rows into a tile and, given rows enough, a backward
# program loops over several tiles (on the CPU: 33 tiles of 16 rows over 4 programs; groups of 40
# in 17 tiles of 32 over 2 programs a group; the few rows of SHAPES take the swept grid): a row
# count that is no multiple of any tile, widths and groups that are not powers of two, dw summed
# over several programs' partials.
SHORT_ROWS = pick(cpu=(515, 120), gpu=(70001, 120))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "gated", "gated_groups_of_40"])
def test_short_rows(op, dtype):
    if op.startswith("gated"):
        x, gate, weight = _gated_inputs(SHORT_ROWS, dtype)
        _check_gated(x, gate, weight, group_size=40 if op == "gated_groups_of_40" else None)
        return
    x, residual = (randn(*SHORT_ROWS, dtype=dtype, requires_grad=True) for _ in range(2))
    weight = randn(SHORT_ROWS[-1], dtype=dtype, requires_grad=True)
    if op == "rms_norm":
        x64, w64 = leaf_copies(x, weight)
        _check([tf.rms_norm(x, weight)], [reference.rms_norm(x64, w64)], {"x": x, "weight": weight}, [x64, w64], dtype)
        return
    x64, r64, w64 = leaf_copies(x, residual, weight)
    _check(
        list(tf.fused_add_rms_norm(x, residual, weight)), list(reference.fused_add_rms_norm(x64, r64, w64)),
        {"x": x, "residual": residual, "weight": weight}, [x64, r64, w64], dtype,
    )


def test_gated_custom_ops_fake_matches_real():
    x = randn(64, 40, dtype=torch.bfloat16).t()
    gate = randn(40, 64, dtype=torch.bfloat16)
    weight = randn(64, dtype=torch.bfloat16)
    checks = ("test_schema", "test_faketensor")
    for norm_before_gate in (True, False):
        fwd_args = (x, gate, weight, 1e-6, 16, norm_before_gate, "llama")
        torch.library.opcheck(rms_norm_ops.rms_norm_gated_fwd.op, fwd_args, test_utils=checks)
        _, rstd = rms_norm_ops.rms_norm_gated_fwd(*fwd_args)
        bwd_args = (torch.randn_like(x), x, gate, weight, rstd, 16, norm_before_gate, "llama", True)
        torch.library.opcheck(rms_norm_ops.rms_norm_gated_bwd.op, bwd_args, test_utils=checks)


def test_rms_norm_gated_compiles_without_graph_breaks():
    x, gate, weight = _gated_inputs(SHAPES[1], torch.float32)
    truth_inputs = leaf_copies(x, gate, weight)
    # Off the GPU, aot_eager traces through the fake functions without needing a C++ toolchain.
    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    compiled = torch.compile(lambda x, g, w: tf.rms_norm_gated(x + 1.0, g, w, group_size=32), fullgraph=True, backend=backend)
    out = compiled(x, gate, weight)
    truth = reference.rms_norm_gated(truth_inputs[0] + 1.0, *truth_inputs[1:], group_size=32)
    _check([out], [truth], {"x": x, "gate": gate, "weight": weight}, truth_inputs, torch.float32)
