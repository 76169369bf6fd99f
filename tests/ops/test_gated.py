import pytest
import torch
import triton
import triton.language as tl
from torch.utils.checkpoint import checkpoint

from tigon.testing import reference
import tigon.functional as tf
import tigon.nn as tnn
from tigon.ops import gated as gated_ops
from tigon.ops.fp8 import E4M3, E5M2, Fp8Cast
from utils import (
    DEVICE, DTYPES, ON_GPU, MatmulFlops, assert_close, assert_tensorwise_cast, leaf_copies, pick, randn,
)

SHAPES = pick(
    cpu=[(7, 33), (3, 5, 128), (300, 40), (9, 2500)],
    gpu=[(4096, 14336), (2, 1000, 11008), (257, 5000), (8192, 24)],
)
GATES = {"swiglu": (tf.swiglu, reference.swiglu), "geglu": (tf.geglu, reference.geglu)}
MLPS = {"swiglu": (tnn.SwiGLUMLP, reference.swiglu), "geglu": (tnn.GeGLUMLP, reference.geglu)}


def _transposed(shape, dtype):
    """A tensor of ``shape`` whose dimensions are all reversed in memory (no row view exists)."""
    reversed_dims = list(range(len(shape)))[::-1]
    return randn(*shape[::-1], dtype=dtype).permute(reversed_dims)


def _inputs(shape, dtype, layout):
    """``gate, up`` leaves requiring grad, laid out as ``layout``."""
    if layout == "fused_halves":
        # The two halves of one fused gate/up projection [..., 2I]: rows are read in place.
        fused = randn(*shape[:-1], 2 * shape[-1], dtype=dtype)
        gate, up = fused.split(shape[-1], dim=-1)
    elif layout == "transposed":
        gate, up = _transposed(shape, dtype), _transposed(shape, dtype)
    else:
        gate, up = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    return gate.requires_grad_(), up.requires_grad_()


def _activations(*tensors):
    """The tensors as an MLP's gates are, outputs of an op (here a multiplication by 1, which
    keeps the layout): ``inplace_backward`` may not overwrite a leaf that requires grad, as
    torch's in-place ops may not. Views of a tensor that does not require grad are kept."""
    return tuple(t * 1 if t.is_leaf else t for t in tensors)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "fused_halves", "transposed"])
@pytest.mark.parametrize("gate_name", GATES)
def test_gated(gate_name, shape, dtype, layout):
    op, truth_op = GATES[gate_name]
    gate, up = _inputs(shape, dtype, layout)
    gate64, up64 = leaf_copies(gate, up)
    out = op(gate, up)
    truth = truth_op(gate64, up64)
    assert out.dtype == dtype and out.shape == gate.shape
    assert_close(out, truth, dtype, "output")

    dout = _transposed(shape, dtype) if layout == "transposed" else randn(*shape, dtype=dtype)
    out.backward(dout)
    truth.backward(dout.double())
    assert_close(gate.grad, gate64.grad, dtype, "grad of gate")
    assert_close(up.grad, up64.grad, dtype, "grad of up")


@pytest.mark.parametrize("layout", ["contiguous", "fused_halves"])
@pytest.mark.parametrize("gate_name", GATES)
def test_inplace_backward_reuses_inputs(gate_name, layout):
    op = GATES[gate_name][0]
    shape, dtype = SHAPES[1], torch.bfloat16
    gate, up = _activations(*_inputs(shape, dtype, layout))
    dout = randn(*shape, dtype=dtype)
    expected = torch.autograd.grad(op(gate, up), (gate, up), dout)
    gate_ptr, up_ptr = gate.data_ptr(), up.data_ptr()

    d_gate, d_up = torch.autograd.grad(op(gate, up, inplace_backward=True), (gate, up), dout)
    assert d_gate.data_ptr() == gate_ptr and d_up.data_ptr() == up_ptr
    assert torch.equal(d_gate, expected[0]) and torch.equal(d_up, expected[1])


@pytest.mark.parametrize("casts", ["output", "grads", "both"])
@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "fused_halves"])
@pytest.mark.parametrize("gate_name", GATES)
def test_gated_fp8_casts_are_tensorwise_casts_of_the_16_bit_values(gate_name, layout, power_of_2,
                                                                   inplace_backward, casts):
    # The gate's kernels cast its product (e4m3: the down projection's input) and its gradients
    # (e5m2: the gate and up projections' output gradients) as torchao casts the bf16 tensors the
    # 16-bit gate gives: the same bytes and scales. What is not cast stays the 16-bit gate's. In
    # place, the FP8 gradients are the incoming gradient's bytes, two per element.
    float8_training_tensor = pytest.importorskip("torchao.float8.float8_training_tensor")
    op = GATES[gate_name][0]
    shape = SHAPES[2]
    gate, up = _inputs(shape, torch.bfloat16, layout)
    dout = randn(*shape, dtype=torch.bfloat16)
    product = op(gate, up)
    grads = torch.autograd.grad(product, (gate, up), dout)
    mm_config = float8_training_tensor.LinearMMConfig()
    roles = float8_training_tensor.GemmInputRole

    def fp8_cast(dtype, role):
        return Fp8Cast(dtype, power_of_2, torch.bfloat16, mm_config, role)

    output_cast = None if casts == "grads" else fp8_cast(E4M3, roles.INPUT)
    grad_casts = None if casts == "output" else (fp8_cast(E5M2, roles.GRAD_OUTPUT),) * 2
    out = gated_ops.gated_fp8(gate, up, gate_name, inplace_backward, output_cast, grad_casts)
    incoming = dout.clone()
    out_grads = torch.autograd.grad(out, (gate, up), incoming)
    if inplace_backward and grad_casts is not None:
        assert all(g._data.untyped_storage().data_ptr() == incoming.data_ptr() for g in out_grads)
    pairs = [(out, product, output_cast), *zip(out_grads, grads, grad_casts or (None, None))]
    for ours, value, cast in pairs:
        if cast is None:  # the 16-bit gate's
            assert type(ours) is torch.Tensor and torch.equal(ours, value)
            continue
        assert ours._gemm_input_role == cast.role and ours._linear_mm_config == mm_config
        assert ours._data.dtype == cast.dtype and ours._scale.shape == ()
        assert_tensorwise_cast(ours._data, ours._scale, value, power_of_2)


def test_gated_fp8_gradients_of_a_32_bit_gate_are_new_tensors():
    # Two FP8 bytes fit in a 16-bit gradient's element, not in a 32-bit one's half: there the
    # backward writes new tensors, whatever inplace_backward says.
    float8_training_tensor = pytest.importorskip("torchao.float8.float8_training_tensor")
    gate, up = _inputs(SHAPES[0], torch.float32, "contiguous")
    dout = randn(*SHAPES[0], dtype=torch.float32)
    grads = torch.autograd.grad(gated_ops.gated_fp8(gate, up, "swiglu", False, None, None), (gate, up), dout)
    cast = Fp8Cast(E5M2, False, torch.float32, float8_training_tensor.LinearMMConfig(),
                   float8_training_tensor.GemmInputRole.GRAD_OUTPUT)
    incoming = dout.clone()
    out = gated_ops.gated_fp8(gate, up, "swiglu", True, None, (cast, cast))
    out_grads = torch.autograd.grad(out, (gate, up), incoming)
    assert torch.equal(incoming, dout)
    for ours, value in zip(out_grads, grads):
        assert_tensorwise_cast(ours._data, ours._scale, value)


def test_inplace_backward_cannot_run_twice():
    gate, up = _activations(*_inputs(SHAPES[0], torch.float32, "contiguous"))
    out = tf.swiglu(gate, up, inplace_backward=True)
    out.sum().backward(retain_graph=True)
    # gate and up now hold gradients: autograd's version counter refuses to reuse them.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 7), (17,)])
def test_degenerate_shapes(shape):
    gate, up = _inputs(shape, torch.float32, "contiguous")
    gate64, up64 = leaf_copies(gate, up)
    out, truth = tf.swiglu(gate, up), reference.swiglu(gate64, up64)
    assert_close(out, truth, torch.float32, "output")
    out.backward(torch.ones_like(out))
    truth.backward(torch.ones_like(truth))
    assert_close(gate.grad, gate64.grad, torch.float32, "grad of gate")
    assert_close(up.grad, up64.grad, torch.float32, "grad of up")


def test_only_requested_gradients():
    gate, up = _inputs(SHAPES[0], torch.float32, "contiguous")
    up.requires_grad_(False)
    tf.geglu(gate, up).sum().backward()
    assert gate.grad is not None and up.grad is None


# The interpreter does the kernel's math in numpy, which warns about the -inf·0 below.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("gate_name", GATES)
def test_non_finite_inputs_propagate(gate_name):
    op, truth_op = GATES[gate_name]
    gate, up = randn(4, 64), randn(4, 64)
    gate[0, 3], gate[1, 7], gate[2, 9], up[3, 1] = float("nan"), float("inf"), -float("inf"), float("nan")
    out = op(gate, up)
    # Non-finite entries must match the reference exactly (silu(-inf) = -inf·0 is NaN in both).
    assert_close(out, truth_op(gate.double(), up.double()), torch.float32, "output")
    assert out[0, 3].isnan() and out[1, 7].isinf() and out[2, 9].isnan() and out[3, 1].isnan()
    assert out.isfinite().sum() == out.numel() - 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mlp_name", MLPS)
def test_mlp_matches_plain_pytorch(mlp_name, dtype):
    mlp_class, truth_gate = MLPS[mlp_name]
    hidden, intermediate = pick(cpu=(48, 72), gpu=(1024, 2816))
    mlp = mlp_class(hidden, intermediate, device=DEVICE, dtype=dtype)
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    truth_mlp = mlp_class(hidden, intermediate, device=DEVICE, dtype=torch.float64)
    truth_mlp.load_state_dict(mlp.state_dict())

    x = randn(2, pick(cpu=5, gpu=512), hidden, dtype=dtype, requires_grad=True)
    (x64,) = leaf_copies(x)
    out = mlp(x)
    truth = truth_mlp.down_proj(truth_gate(truth_mlp.gate_proj(x64), truth_mlp.up_proj(x64)))
    # Three matmuls each round to the dtype around the gate's own single rounding.
    factor = 2.0
    assert_close(out, truth, dtype, "output", factor)
    dout = randn(*out.shape, dtype=dtype)
    out.backward(dout)
    truth.backward(dout.double())
    assert_close(x.grad, x64.grad, dtype, "grad of x", factor)
    for name, param in mlp.named_parameters():
        assert_close(param.grad, truth_mlp.get_parameter(name).grad, dtype, f"grad of {name}", factor)


@pytest.mark.parametrize("inplace_backward", [False, True])
def test_compiles_without_graph_breaks(inplace_backward):
    gate, up = _inputs(SHAPES[1], torch.float32, "contiguous")
    gate64, up64 = leaf_copies(gate, up)

    @torch.compile(fullgraph=True)
    def mlp_tail(gate, up):
        return tf.swiglu(gate * 2.0, up + 1.0, inplace_backward=inplace_backward).square()

    out = mlp_tail(gate, up)
    truth = reference.swiglu(gate64 * 2.0, up64 + 1.0).square()
    assert_close(out, truth, torch.float32, "output")
    out.sum().backward()
    truth.sum().backward()
    assert_close(gate.grad, gate64.grad, torch.float32, "grad of gate")
    assert_close(up.grad, up64.grad, torch.float32, "grad of up")


LINEAR_GATES = {
    "swiglu": (tf.swiglu_linear, reference.swiglu), "geglu": (tf.geglu_linear, reference.geglu),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "fused_halves"])
@pytest.mark.parametrize("gate_name", LINEAR_GATES)
def test_gated_linear(gate_name, layout, bias, dtype):
    fn, truth_gate = LINEAR_GATES[gate_name]
    shape = pick(cpu=(3, 37, 72), gpu=(2, 1000, 2816))
    out_features = pick(cpu=48, gpu=1024)
    gate, up = _inputs(shape, dtype, layout)
    weight = randn(out_features, shape[-1], dtype=dtype, requires_grad=True, scale=shape[-1] ** -0.5)
    b = randn(out_features, dtype=dtype, requires_grad=True) if bias else None
    gate64, up64, weight64 = leaf_copies(gate, up, weight)
    b64 = leaf_copies(b)[0] if bias else None
    out = fn(gate, up, weight, b)
    truth = torch.nn.functional.linear(truth_gate(gate64, up64), weight64, b64)
    # The product rounds to the dtype before the matmul, which rounds again.
    assert_close(out, truth, dtype, "output", 2.0)
    dout = randn(*out.shape, dtype=dtype)
    out.backward(dout)
    truth.backward(dout.double())
    pairs = [("gate", gate, gate64), ("up", up, up64), ("weight", weight, weight64)] + [("bias", b, b64)] * bias
    for name, tensor, truth_tensor in pairs:
        assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}", 2.0)


def test_gated_linear_keeps_no_product():
    """Saved for backward: gate, up and the weight, not the [N, I] product a separate linear keeps."""
    gate, up = _activations(*_inputs((40, 96), torch.float32, "contiguous"))
    weight = randn(24, 96, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tf.swiglu_linear(gate, up, weight, inplace_backward=True)
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert saved_bytes == sum(t.numel() * t.element_size() for t in (gate, up, weight))
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.nn.functional.linear(tf.swiglu(gate, up, inplace_backward=True), weight)
    assert sum(t.numel() * t.element_size() for t in saved) == saved_bytes + 40 * 96 * 4


def test_mlp_calls_a_hooked_down_proj():
    """A down projection with hooks (or wrapped, e.g. by PEFT) is called as a module, not fused."""
    mlp = tnn.SwiGLUMLP(32, 48, device=DEVICE)
    x = randn(5, 32)
    fused = mlp(x)
    calls = []
    mlp.down_proj.register_forward_hook(lambda module, args, out: calls.append(out))
    assert torch.allclose(mlp(x), fused, rtol=1e-5, atol=1e-6) and len(calls) == 1


@pytest.mark.parametrize("mlp_name, config_class, activation", [
    ("swiglu", "LlamaConfig", "silu"), ("geglu", "GemmaConfig", "gelu_pytorch_tanh"),
    ("geglu", "Gemma2Config", "gelu_pytorch_tanh"),
])
def test_mlp_takes_a_hugging_face_config(mlp_name, config_class, activation):
    """``SwiGLUMLP(config)`` as ``LlamaMLP(config)`` (and Liger's MLPs): the sizes, the bias and
    the activation read from the config; an activation the gate does not compute is refused."""
    transformers = pytest.importorskip("transformers")
    mlp_class = MLPS[mlp_name][0]
    config = getattr(transformers, config_class)(hidden_size=32, intermediate_size=48)
    mlp = mlp_class(config, device=DEVICE)
    assert (mlp.hidden_size, mlp.intermediate_size) == (32, 48)
    assert mlp.gate_proj.weight.shape == (48, 32) and mlp.down_proj.bias is None
    assert (getattr(config, "hidden_activation", None) or config.hidden_act) == activation
    if hasattr(config, "mlp_bias"):
        config.mlp_bias = True
        assert all(getattr(mlp_class(config), name).bias is not None for name in ("gate_proj", "up_proj", "down_proj"))
    other = next(name for name in MLPS if name != mlp_name)
    with pytest.raises(ValueError, match=rf"^{MLPS[other][0].__name__} computes .* but the config's activation is "
                                         rf"'{activation}'"):
        MLPS[other][0](config)
    with pytest.raises(TypeError, match=rf"{mlp_class.__name__} takes \(hidden_size, intermediate_size\)"):
        mlp_class(32)


def test_gated_linear_bad_weight_is_named():
    gate, up = _inputs((4, 16), torch.float32, "contiguous")
    with pytest.raises(ValueError, match=r"weight must have shape \(8, 16\).*got \(8, 15\)"):
        tf.swiglu_linear(gate, up, randn(8, 15))
    with pytest.raises(TypeError, match="gate torch.float32, weight torch.bfloat16"):
        tf.swiglu_linear(gate, up, randn(8, 16, dtype=torch.bfloat16))


MLP_FUNCTIONS = {"swiglu": (tf.swiglu_mlp, reference.swiglu), "geglu": (tf.geglu_mlp, reference.geglu)}


def _mlp_weights(hidden, inter, dtype, requires_grad=True):
    """``gate [I, H], up [I, H], down [H, I]``, scaled so that activations stay of order one."""
    return (
        randn(inter, hidden, dtype=dtype, requires_grad=requires_grad, scale=hidden**-0.5),
        randn(inter, hidden, dtype=dtype, requires_grad=requires_grad, scale=hidden**-0.5),
        randn(hidden, inter, dtype=dtype, requires_grad=requires_grad, scale=inter**-0.5),
    )


def _plain_mlp(x, gate_weight, up_weight, down_weight, gate_fn):
    linear = torch.nn.functional.linear
    return linear(gate_fn(linear(x, gate_weight), linear(x, up_weight)), down_weight)


# Hidden and intermediate sizes whose slices (at most H wide, a multiple of 64) leave a short last one.
MLP_SIZES = pick(cpu=[(72, 200), (64, 64)], gpu=[(1024, 2816), (4096, 14336)])


# Tokens per tile of the tiled MLP: a short last tile of the 3 × 37 (3 × 1000) rows below.
TILE_TOKENS = pick(cpu=29, gpu=1024)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", MLP_SIZES)
@pytest.mark.parametrize("gate_name", MLP_FUNCTIONS)
@pytest.mark.parametrize("tile_tokens", [None, TILE_TOKENS], ids=["whole", "tiled"])
def test_gated_mlp(gate_name, sizes, dtype, tile_tokens):
    fn, truth_gate = MLP_FUNCTIONS[gate_name]
    hidden, inter = sizes
    x = randn(3, pick(cpu=37, gpu=1000), hidden, dtype=dtype, requires_grad=True)
    weights = _mlp_weights(hidden, inter, dtype)
    x64, *weights64 = leaf_copies(x, *weights)
    out = fn(x, *weights, tile_tokens=tile_tokens)
    truth = _plain_mlp(x64, *weights64, truth_gate)
    # Gate and up round to the dtype before the gate, the product again before the down matmul.
    assert_close(out, truth, dtype, "output", 2.0)
    dout = randn(*out.shape, dtype=dtype)
    out.backward(dout)
    truth.backward(dout.double())
    # Every gradient passes through two rounded intermediates (dh, then d_gate / d_up); the input's
    # is in addition a sum of per-slice matmuls rounded to the dtype. Tiled, the weights' are sums
    # over the tiles in fp32, of partial sums each rounded to the dtype.
    for name, tensor, truth_tensor in zip(("x", "gate", "up", "down"), (x, *weights), (x64, *weights64)):
        assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}", 3.0 if name == "x" else 2.0)


@pytest.mark.parametrize("gate_name", MLP_FUNCTIONS)
def test_gated_mlp_forward_is_the_plain_mlp(gate_name):
    fn, _ = MLP_FUNCTIONS[gate_name]
    x = randn(2, 19, 72, dtype=torch.bfloat16)
    weights = _mlp_weights(72, 200, torch.bfloat16, requires_grad=False)
    assert torch.equal(fn(x, *weights), _plain_mlp(x, *weights, GATES[gate_name][0]))


def test_tiled_mlp_forward_is_the_whole_one_and_holds_one_tile(monkeypatch):
    x = randn(2, 45, 72, requires_grad=True)
    weights = _mlp_weights(72, 200, torch.float32)
    whole = tf.swiglu_mlp(x, *weights)
    rows_seen = []
    for name in ("gated_fwd", "gated_bwd_recompute"):
        kernel = getattr(gated_ops, name)
        monkeypatch.setattr(
            gated_ops, name, lambda dout_or_gate, *args, kernel=kernel: rows_seen.append(dout_or_gate.shape[0])
            or kernel(dout_or_gate, *args)
        )
    tiled = tf.swiglu_mlp(x, *weights, tile_tokens=32)
    assert torch.equal(tiled, whole)
    tiled.sum().backward()
    # Forward: tiles of 32 and 90 − 64 = 26 tokens; backward: the same tiles, two slices of the 200 features each.
    assert rows_seen == [32, 32, 26] + [32, 32] * 2 + [26, 26]


@pytest.mark.parametrize("tile_tokens", [0, -4, 2.5, True, "auto"])
def test_gated_mlp_bad_tile_tokens_is_named(tile_tokens):
    x = randn(4, 16)
    weights = _mlp_weights(16, 40, torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match=rf"tile_tokens must be a positive int or None, got {tile_tokens!r}"):
        tf.swiglu_mlp(x, *weights, tile_tokens=tile_tokens)


def test_gated_mlp_keeps_only_its_inputs():
    x = randn(40, 64, requires_grad=True)
    weights = _mlp_weights(64, 160, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tf.swiglu_mlp(x, *weights)
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in (x, *weights)]


def test_gated_mlp_under_checkpointing_recomputes_no_matmul():
    """Non-reentrant checkpointing recomputes a layer up to the last tensor it saved. The MLP saves
    its input before its matmuls, so checkpointing it costs the FLOPs of checkpointing the plain
    MLP (whose recomputation runs gate and up and stops at the down projection's input), not a
    whole forward more."""

    def flops(mlp):
        x = randn(3, 40, 64, requires_grad=True)
        weights = _mlp_weights(64, 160, torch.float32)
        with MatmulFlops() as counter:
            checkpoint(mlp, x, *weights, use_reentrant=False).sum().backward()
        return counter.flops

    plain = flops(lambda x, *weights: _plain_mlp(x, *weights, tf.swiglu))
    assert flops(tf.swiglu_mlp) == plain
    # Something saved after the MLP makes the recomputation run it whole: three matmuls more.
    assert flops(lambda x, *weights: tf.swiglu_mlp(x, *weights).sin()) == plain + 3 * 2 * 120 * 64 * 160


def test_gated_mlp_only_requested_gradients():
    x = randn(20, 64, requires_grad=True)
    gate_weight, up_weight, down_weight = _mlp_weights(64, 160, torch.float32)
    down_weight.requires_grad_(False)
    tf.swiglu_mlp(x, gate_weight, up_weight, down_weight).sum().backward()
    assert x.grad is not None and gate_weight.grad is not None and up_weight.grad is not None
    assert down_weight.grad is None


def test_gated_mlp_bad_weights_are_named():
    x = randn(4, 16)
    gate_weight, up_weight, down_weight = _mlp_weights(16, 40, torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match=r"gate_weight must have shape \(40, 16\).*got \(40, 15\)"):
        tf.swiglu_mlp(x, gate_weight[:, :15], up_weight, down_weight)
    with pytest.raises(ValueError, match=r"down_weight must have shape \(16, 40\).*got \(40, 16\)"):
        tf.geglu_mlp(x, gate_weight, up_weight, down_weight.T)
    with pytest.raises(TypeError, match="x torch.float32, gate_weight torch.float32, up_weight torch.bfloat16"):
        tf.swiglu_mlp(x, gate_weight, up_weight.bfloat16(), down_weight)


# --- Squared ReLU (Nemotron) -----------------------------------------------------------------


def _relu2_input(shape, dtype, layout):
    x = _transposed(shape, dtype) if layout == "transposed" else randn(*shape, dtype=dtype)
    x[..., ::7] = 0.0  # exact zeros, where relu's gradient is 0
    return x.requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_relu2(shape, dtype, layout):
    x = _relu2_input(shape, dtype, layout)
    (x64,) = leaf_copies(x)
    out, truth = tf.relu2(x), reference.relu2(x64)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, truth, dtype, "output")
    dout = randn(*shape, dtype=dtype)
    out.backward(dout)
    truth.backward(dout.double())
    assert_close(x.grad, x64.grad, dtype, "grad of x")


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu2_matches_hugging_face(dtype):
    """ACT2FN["relu2"] itself: relu is exact and the square one rounding, in both; so is the
    gradient 2·relu(x)·dout, so outputs and gradients agree bit for bit in every dtype."""
    from transformers.activations import ACT2FN

    x = _relu2_input(SHAPES[1], dtype, "contiguous")
    out, expected = tf.relu2(x), ACT2FN["relu2"](x)
    assert torch.equal(out, expected)
    dout = randn(*SHAPES[1], dtype=dtype)
    assert torch.equal(*(torch.autograd.grad(y, x, dout)[0] for y in (out, expected)))


@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 7), (17,)])
def test_relu2_degenerate_shapes(shape):
    x = randn(*shape, requires_grad=True)
    out = tf.relu2(x)
    out.backward(torch.ones_like(out))
    assert out.shape == x.shape and torch.equal(x.grad, 2 * x.detach().relu())


def test_relu2_inplace_backward_reuses_input():
    (x,) = _activations(randn(*SHAPES[1], dtype=torch.bfloat16, requires_grad=True))
    dout = randn(*SHAPES[1], dtype=torch.bfloat16)
    expected = torch.autograd.grad(tf.relu2(x), x, dout)[0]
    pointer = x.data_ptr()
    (dx,) = torch.autograd.grad(tf.relu2(x, inplace_backward=True), x, dout)
    assert dx.data_ptr() == pointer and torch.equal(dx, expected)


def test_relu2_non_finite_inputs_propagate():
    x = randn(4, 64, requires_grad=True)
    with torch.no_grad():
        x[0, 3], x[1, 7], x[2, 9] = float("nan"), float("inf"), -float("inf")
    out = tf.relu2(x)
    expected = reference.relu2(x.detach().double())
    assert_close(out, expected, torch.float32, "output")
    out.backward(torch.ones_like(out))
    # torch: NaN and inf pass through relu, -inf gives 0; the gradient 2·relu(x) likewise.
    assert x.grad[0, 3].isnan() and x.grad[1, 7].isinf() and x.grad[2, 9] == 0


# --- GPT-OSS's clamped SwiGLU ------------------------------------------------------------------

LIMIT = 7.0


def _gate_up(shape, dtype, layout="contiguous"):
    """``gate_up [..., 2I]`` spread past the limits (scale 5: about 16% of the gates above 7 and a
    third of the ups outside ±7), with some entries exactly at ±limit, where torch.clamp passes
    the gradient."""
    *lead, inter = shape
    wide = 2 * inter + (6 if layout == "strided" else 0)
    gate_up = randn(*lead, wide, scale=5.0)
    flat = gate_up.view(-1)
    flat[::11], flat[5::13], flat[2::17] = LIMIT, -LIMIT, LIMIT
    gate_up = gate_up.to(dtype)
    if layout == "strided":
        gate_up = gate_up[..., 4 : 4 + 2 * inter]  # rows of a wider buffer, read in place
    return gate_up.requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_swiglu_clamped(shape, dtype, layout):
    gate_up = _gate_up(shape, dtype, layout)
    (gate_up64,) = leaf_copies(gate_up)
    out, truth = tf.swiglu_clamped(gate_up), reference.swiglu_clamped(gate_up64)
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, truth, dtype, "output")
    dout = randn(*shape, dtype=dtype)
    out.backward(dout)
    truth.backward(dout.double())
    assert_close(gate_up.grad, gate_up64.grad, dtype, "grad of gate_up")


def _at_the_limits():
    """``gate_up`` (interleaved) with gates and ups at, just past and inside the limits."""
    gate = torch.tensor([LIMIT, LIMIT + 1e-3, -50.0, 1.0, 1.0, 1.0, 1.0], device=DEVICE)
    up = torch.tensor([0.5, 0.5, 0.5, LIMIT, -LIMIT, LIMIT + 1e-3, -LIMIT - 1e-3], device=DEVICE)
    return torch.stack((gate, up), dim=-1).flatten().requires_grad_()


def test_swiglu_clamped_gradient_at_the_limits_is_the_installed_torchs():
    """torch.clamp's convention, whichever the installed torch has (torch 2.13 passes the gradient
    of an input equal to a limit, 2.14 stops it): as autograd through the reference computes."""
    gate_up = _at_the_limits()
    (gate_up64,) = leaf_copies(gate_up)
    tf.swiglu_clamped(gate_up).sum().backward()
    reference.swiglu_clamped(gate_up64).sum().backward()
    assert_close(gate_up.grad, gate_up64.grad, torch.float32, "grad of gate_up")
    x = torch.full((), LIMIT, requires_grad=True)
    (clamp_grad,) = torch.autograd.grad(x.clamp(max=LIMIT), x)
    assert gated_ops.clamp_passes_at_limit() == (clamp_grad == 1)


@pytest.mark.parametrize("passes", [True, False], ids=["passes", "stops"])
def test_swiglu_clamped_gradient_at_the_limits(monkeypatch, passes):
    """Either rule at a limit; beyond it the gradient is exactly zero, inside it passes."""
    monkeypatch.setattr(gated_ops, "clamp_passes_at_limit", lambda: passes)
    gate_up = _at_the_limits()
    tf.swiglu_clamped(gate_up).sum().backward()
    d_gate, d_up = gate_up.grad[0::2], gate_up.grad[1::2]
    assert (d_gate[0] != 0) == passes and (d_up[3] != 0) == passes and (d_up[4] != 0) == passes
    assert d_gate[1] == 0 and d_gate[2] != 0 and d_up[5] == 0 and d_up[6] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_clamped_matches_hugging_face(dtype):
    """GptOssExperts._apply_gate itself. In fp32 within the tolerance; in 16-bit dtypes the module
    rounds each of its six steps while tigon rounds once, so it is the module that strays from
    the fp64 truth: both are checked against it, tigon at the dtype's tolerance and the module at
    twice that, and the two agree within the sum."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    shape = pick(cpu=(3, 5, 72), gpu=(4, 1024, 2880))
    config = GptOssConfig(hidden_size=8, intermediate_size=shape[-1], num_local_experts=2)
    experts = GptOssExperts(config).to(DEVICE)
    gate_up = _gate_up(shape, dtype)
    (gate_up64,) = leaf_copies(gate_up)
    out, expected = tf.swiglu_clamped(gate_up, alpha=experts.alpha, limit=experts.limit), experts._apply_gate(gate_up)
    truth = reference.swiglu_clamped(gate_up64, experts.alpha, experts.limit)
    factor = 1.0 if dtype == torch.float32 else 2.0
    assert_close(out, truth, dtype, "output")
    assert_close(expected, truth, dtype, "the module's output", factor)
    assert_close(out, expected, dtype, "output against the module", 1.0 + factor)
    dout = randn(*shape, dtype=dtype)
    grad, expected_grad = (torch.autograd.grad(y, gate_up, dout)[0] for y in (out, expected))
    (truth_grad,) = torch.autograd.grad(truth, gate_up64, dout.double())
    assert_close(grad, truth_grad, dtype, "grad of gate_up")
    assert_close(grad, expected_grad, dtype, "grad of gate_up against the module", 1.0 + factor)


def test_swiglu_clamped_options_and_inplace_backward():
    gate_up = _gate_up(SHAPES[1], torch.float32)
    (gate_up64,) = leaf_copies(gate_up)
    out = tf.swiglu_clamped(gate_up, alpha=1.0, limit=3.0)
    truth = reference.swiglu_clamped(gate_up64, 1.0, 3.0)
    assert_close(out, truth, torch.float32, "output")
    dout = randn(*out.shape)
    expected = torch.autograd.grad(out, gate_up, dout)[0]
    (gate_up,) = _activations(gate_up)
    pointer = gate_up.data_ptr()
    (d_gate_up,) = torch.autograd.grad(tf.swiglu_clamped(gate_up, alpha=1.0, limit=3.0, inplace_backward=True), gate_up, dout)
    assert d_gate_up.data_ptr() == pointer and torch.equal(d_gate_up, expected)
    assert_close(d_gate_up, torch.autograd.grad(truth, gate_up64, dout.double())[0], torch.float32, "grad of gate_up")


def test_swiglu_clamped_non_finite_inputs():
    # As torch.clamp: NaN propagates to the output and gets a zero gradient; inf is clamped.
    gate_up = randn(2, 16, requires_grad=True)
    with torch.no_grad():
        gate_up[0, 2], gate_up[0, 5], gate_up[1, 0], gate_up[1, 3] = float("nan"), float("nan"), float("inf"), -float("inf")
    (gate_up64,) = leaf_copies(gate_up)
    out, truth = tf.swiglu_clamped(gate_up), reference.swiglu_clamped(gate_up64)
    assert_close(out, truth, torch.float32, "output")
    dout = randn(*out.shape)
    out.backward(dout)
    truth.backward(dout.double())
    assert_close(gate_up.grad, gate_up64.grad, torch.float32, "grad of gate_up")


def test_swiglu_clamped_bad_input_is_named():
    with pytest.raises(ValueError, match=r"gate_up must have an even last dimension .* got shape \(3, 5\)"):
        tf.swiglu_clamped(randn(3, 5))
    with pytest.raises(ValueError, match=r"limit must be a number > 0, got -1.0"):
        tf.swiglu_clamped(randn(3, 4), limit=-1.0)
    with pytest.raises(ValueError, match=r"alpha must be a finite number, got nan"):
        tf.swiglu_clamped(randn(3, 4), alpha=float("nan"))


@triton.jit
def _fused_consumer_kernel(GATE, UP, OUT, n, alpha, limit, BLOCK: tl.constexpr):
    # Another kernel calling the helper on tiles it loaded itself (gate and up in separate
    # tensors here), as a fused MoE kernel will.
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    gate = tl.load(GATE + offsets, mask=mask).to(tl.float32)
    up = tl.load(UP + offsets, mask=mask).to(tl.float32)
    tl.store(OUT + offsets, gated_ops.swiglu_clamped_math(gate, up, alpha, limit), mask=mask)


def test_swiglu_clamped_math_is_callable_from_another_kernel():
    gate, up = randn(37, scale=5.0), randn(37, scale=5.0)
    out = torch.empty_like(gate)
    _fused_consumer_kernel[(1,)](gate, up, out, 37, 1.702, LIMIT, BLOCK=64)
    expected = reference.swiglu_clamped(torch.stack((gate, up), dim=-1).flatten().double())
    assert_close(out, expected, torch.float32, "output")


def test_swiglu_clamped_and_relu2_custom_ops_fake_matches_real():
    checks = ("test_schema", "test_faketensor")
    gate_up = randn(6, 40, dtype=torch.bfloat16)[:, 4:36]
    torch.library.opcheck(gated_ops.swiglu_clamped_fwd.op, (gate_up, 1.702, LIMIT), test_utils=checks)
    dout = randn(6, 16, dtype=torch.bfloat16)
    torch.library.opcheck(gated_ops.swiglu_clamped_bwd.op, (dout, gate_up, 1.702, LIMIT), test_utils=checks)
    x = randn(6, 40, dtype=torch.bfloat16)[:, :33]
    torch.library.opcheck(gated_ops.relu2_fwd.op, (x,), test_utils=checks)
    torch.library.opcheck(gated_ops.relu2_bwd.op, (randn(6, 33, dtype=torch.bfloat16), x), test_utils=checks)


@pytest.mark.parametrize("op_name", ["relu2", "swiglu_clamped"])
def test_relu2_and_swiglu_clamped_compile_without_graph_breaks(op_name):
    op, truth_op = getattr(tf, op_name), getattr(reference, op_name)
    x = _gate_up(SHAPES[1], torch.float32) if op_name == "swiglu_clamped" else _relu2_input(SHAPES[1], torch.float32, "contiguous")
    (x64,) = leaf_copies(x)
    # Off the GPU, aot_eager traces through the fake functions without needing a C++ toolchain.
    compiled = torch.compile(lambda x: op(x * 2.0).square(), fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    out, truth = compiled(x), truth_op(x64 * 2.0).square()
    assert_close(out, truth, torch.float32, "output")
    out.sum().backward()
    truth.sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, "grad of the input")
