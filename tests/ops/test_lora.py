import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tigon.functional as tf
from tigon.testing import reference
from utils import DTYPES, MatmulFlops, assert_close, leaf_copies, pick, randn

# (rows, in, out, rank): a non-power-of-two everywhere, and a rank above the CPU's in/out ratio.
LINEAR_SHAPES = pick(cpu=[(37, 48, 40, 5), (2 * 19, 64, 24, 16)], gpu=[(16384, 4096, 14336, 16), (4000, 4096, 1024, 64)])
ADAPTER_DTYPES = {"same": None, "fp32": torch.float32}


def _linear_inputs(shape, dtype, adapter_dtype, *, bias=False, base_grad=False):
    rows, n_in, n_out, rank = shape
    adapter_dtype = adapter_dtype or dtype
    x = randn(rows, n_in, dtype=dtype, requires_grad=True)
    weight = randn(n_out, n_in, dtype=dtype, requires_grad=base_grad, scale=n_in**-0.5)
    lora_a = randn(rank, n_in, dtype=adapter_dtype, requires_grad=True, scale=n_in**-0.5)
    lora_b = randn(n_out, rank, dtype=adapter_dtype, requires_grad=True, scale=rank**-0.5)
    bias = randn(n_out, dtype=dtype, requires_grad=base_grad) if bias else None
    return x, weight, lora_a, lora_b, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("adapter_dtype", ADAPTER_DTYPES)
@pytest.mark.parametrize("dropout", [False, True])
def test_lora_linear(shape, dtype, adapter_dtype, dropout):
    x, weight, lora_a, lora_b, bias = _linear_inputs(shape, dtype, ADAPTER_DTYPES[adapter_dtype], bias=True)
    scaling = 2.0
    x_adapter = mask = None
    if dropout:
        # As PEFT: the dropout of x cast to the adapter's dtype, a tensor of its own in the graph
        # (the mask drawn here, for the reference: x may hold exact zeros).
        mask = torch.rand(x.shape, device=x.device) >= 0.25
        x_adapter = x.to(lora_a.dtype) * mask / 0.75
    out = tf.lora_linear(x, weight, lora_a, lora_b, scaling, bias=bias, x_adapter=x_adapter)
    x64, weight64, a64, b64, bias64 = leaf_copies(x, weight, lora_a, lora_b, bias)
    truth = reference.lora_linear(x64, weight64, a64, b64, scaling, bias64, None if mask is None else x64 * mask / 0.75)
    assert out.dtype == dtype and out.shape == (shape[0], shape[2])
    # The base and adapter products each round to the dtype before their sum is rounded.
    assert_close(out, truth, dtype, "output", 2.0)
    dout = randn(*out.shape, dtype=dtype)
    out.backward(dout)
    truth.backward(dout.double())
    assert lora_a.grad.dtype == lora_a.dtype and lora_b.grad.dtype == lora_b.dtype
    assert weight.grad is None and bias.grad is None
    # Each gradient passes through a rounded [N, r] intermediate (dy·B or x·Aᵀ) and its own rounding.
    for name, tensor, truth_tensor in (("x", x, x64), ("lora_a", lora_a, a64), ("lora_b", lora_b, b64)):
        assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}", 2.0)


def test_lora_linear_trains_a_base_that_requires_grad():
    x, weight, lora_a, lora_b, bias = _linear_inputs(LINEAR_SHAPES[0], torch.float32, None, bias=True, base_grad=True)
    x64, weight64, a64, b64, bias64 = leaf_copies(x, weight, lora_a, lora_b, bias)
    tf.lora_linear(x, weight, lora_a, lora_b, 0.5, bias=bias).square().sum().backward()
    reference.lora_linear(x64, weight64, a64, b64, 0.5, bias64).square().sum().backward()
    assert_close(weight.grad, weight64.grad, torch.float32, "grad of weight")
    assert_close(bias.grad, bias64.grad, torch.float32, "grad of bias")


def test_lora_linear_keeps_only_its_inputs_and_checkpointing_recomputes_no_matmul():
    x, weight, lora_a, lora_b, _ = _linear_inputs(LINEAR_SHAPES[0], torch.float32, None)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tf.lora_linear(x, weight, lora_a, lora_b, 2.0)
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in (x, weight, lora_a, lora_b)]

    def flops(fn):
        with MatmulFlops() as counter:
            fn(x, weight, lora_a, lora_b).sum().backward()
        return counter.flops

    plain = flops(lambda *args: tf.lora_linear(*args, 2.0))
    assert flops(lambda *args: checkpoint(tf.lora_linear, *args, 2.0, use_reentrant=False)) == plain


def test_lora_linear_no_input_gradient_when_x_needs_none():
    """A frozen embedding's output (x without grad) costs no ``dy·W`` matmul."""
    rows, n_in, n_out, rank = LINEAR_SHAPES[0]
    x, weight, lora_a, lora_b, _ = _linear_inputs(LINEAR_SHAPES[0], torch.float32, None)
    x = x.detach()
    with MatmulFlops() as counter:
        tf.lora_linear(x, weight, lora_a, lora_b, 2.0).sum().backward()
    forward = 2 * rows * n_in * (n_out + rank) + 2 * rows * rank * n_out
    # Backward: dy·B, (dy·B)ᵀ·x for dA, x·Aᵀ again and dyᵀ·u for dB; no dy·W.
    backward = 2 * rows * n_out * rank + 2 * rank * rows * n_in + 2 * rows * n_in * rank + 2 * n_out * rows * rank
    assert counter.flops == forward + backward
    assert lora_a.grad is not None and lora_b.grad is not None


def test_lora_linear_bad_inputs_are_named():
    x, weight, lora_a, lora_b, _ = _linear_inputs(LINEAR_SHAPES[0], torch.float32, None)
    rank, n_in = lora_a.shape
    with pytest.raises(ValueError, match=rf"lora_a must have shape \({rank}, {n_in}\).*got \({rank}, {n_in - 1}\)"):
        tf.lora_linear(x, weight, lora_a[:, 1:], lora_b)
    with pytest.raises(ValueError, match=r"lora_b must have shape .*rank of lora_a"):
        tf.lora_linear(x, weight, lora_a, lora_b[:, 1:])
    with pytest.raises(ValueError, match="x_adapter must have shape"):
        tf.lora_linear(x, weight, lora_a, lora_b, x_adapter=x[1:])
    with pytest.raises(TypeError, match="x torch.float32, weight torch.bfloat16"):
        tf.lora_linear(x, weight.bfloat16(), lora_a, lora_b)
    with pytest.raises(ValueError, match="scaling requires grad"):
        tf.lora_linear(x, weight, lora_a, lora_b, torch.tensor(2.0, requires_grad=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adapter_dtype", ADAPTER_DTYPES)
def test_add_lora(dtype, adapter_dtype):
    """The adapter over a base output computed elsewhere (QLoRA's 4-bit layer): the base output's
    gradient is the output's, unchanged."""
    rows, n_in, n_out, rank = LINEAR_SHAPES[0]
    x, _, lora_a, lora_b, _ = _linear_inputs(LINEAR_SHAPES[0], dtype, ADAPTER_DTYPES[adapter_dtype])
    base_out = randn(rows, n_out, dtype=dtype, requires_grad=True)
    out = tf.add_lora(base_out, x, lora_a, lora_b, 0.5)
    base64, x64, a64, b64 = leaf_copies(base_out, x, lora_a, lora_b)
    truth = reference.add_lora(base64, x64, a64, b64, 0.5)
    assert out.dtype == dtype
    assert_close(out, truth, dtype, "output", 2.0)
    dout = randn(*out.shape, dtype=dtype)
    out.backward(dout)
    truth.backward(dout.double())
    assert torch.equal(base_out.grad, dout)
    for name, tensor, truth_tensor in (("x", x, x64), ("lora_a", lora_a, a64), ("lora_b", lora_b, b64)):
        assert tensor.grad.dtype == tensor.dtype
        assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}", 2.0)


def test_add_lora_bad_inputs_are_named():
    rows, n_in, n_out, rank = LINEAR_SHAPES[0]
    x, _, lora_a, lora_b, _ = _linear_inputs(LINEAR_SHAPES[0], torch.float32, None)
    with pytest.raises(ValueError, match=r"x must have shape .*leading dimensions of base_out"):
        tf.add_lora(randn(rows + 1, n_out), x, lora_a, lora_b)
    with pytest.raises(ValueError, match=rf"lora_b must have shape \({n_out + 1}, {rank}\)"):
        tf.add_lora(randn(rows, n_out + 1), x, lora_a, lora_b)


MLP_LORA_SIZES = pick(cpu=[(72, 200)], gpu=[(4096, 14336)])


def _mlp_with_adapters(hidden, inter, dtype, adapter_dtype, ranks):
    base = (
        randn(inter, hidden, dtype=dtype, scale=hidden**-0.5),
        randn(inter, hidden, dtype=dtype, scale=hidden**-0.5),
        randn(hidden, inter, dtype=dtype, scale=inter**-0.5),
    )
    loras = []
    for weight, rank, scaling in zip(base, ranks, (2.0, 0.5, 1.5)):
        if rank is None:
            loras.append(None)
            continue
        n_out, n_in = weight.shape
        loras.append((
            randn(rank, n_in, dtype=adapter_dtype or dtype, requires_grad=True, scale=n_in**-0.5),
            randn(n_out, rank, dtype=adapter_dtype or dtype, requires_grad=True, scale=rank**-0.5),
            scaling,
        ))
    return base, loras


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", MLP_LORA_SIZES)
@pytest.mark.parametrize("adapter_dtype", ADAPTER_DTYPES)
@pytest.mark.parametrize("ranks", [(8, 8, 8), (5, None, 16)], ids=["all", "gate_down"])
@pytest.mark.parametrize("tile_tokens", [None, pick(cpu=29, gpu=1024)], ids=["whole", "tiled"])
def test_gated_mlp_with_adapters(sizes, dtype, adapter_dtype, ranks, tile_tokens):
    hidden, inter = sizes
    x = randn(3, pick(cpu=37, gpu=1000), hidden, dtype=dtype, requires_grad=True)
    base, loras = _mlp_with_adapters(hidden, inter, dtype, ADAPTER_DTYPES[adapter_dtype], ranks)
    out = tf.swiglu_mlp(x, *base, gate_lora=loras[0], up_lora=loras[1], down_lora=loras[2], tile_tokens=tile_tokens)
    x64, *base64 = leaf_copies(x, *base)
    loras64 = [None if lora is None else (*leaf_copies(*lora[:2]), lora[2]) for lora in loras]
    truth = reference.gated_mlp(x64, *base64, reference.swiglu, *loras64)
    assert_close(out, truth, dtype, "output", 2.0)
    dout = randn(*out.shape, dtype=dtype)
    out.backward(dout)
    truth.backward(dout.double())
    assert all(weight.grad is None for weight in base)
    # As test_gated_mlp (two rounded intermediates; x's gradient a sum over slices), with the
    # adapters' [N, r] products rounded once more.
    assert_close(x.grad, x64.grad, dtype, "grad of x", 3.0)
    for projection, lora, lora64 in zip(("gate", "up", "down"), loras, loras64):
        if lora is not None:
            for name, tensor, truth_tensor in zip(("lora_a", "lora_b"), lora[:2], lora64[:2]):
                assert tensor.grad.dtype == tensor.dtype
                assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {projection} {name}", 3.0)


def test_gated_mlp_with_adapters_keeps_only_its_inputs():
    x = randn(40, 72, requires_grad=True)
    base, loras = _mlp_with_adapters(72, 200, torch.float32, None, (4, 4, 4))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tf.swiglu_mlp(x, *base, gate_lora=loras[0], up_lora=loras[1], down_lora=loras[2])
    adapters = [t for lora in loras for t in lora[:2]]
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in (x, *base, *adapters)]


def test_gated_mlp_bad_adapter_is_named():
    x = randn(4, 72)
    base, loras = _mlp_with_adapters(72, 200, torch.float32, None, (4, 4, 4))
    with pytest.raises(ValueError, match=r"up_lora\[1\] \(lora_b\) must have shape \(200, 4\)"):
        tf.swiglu_mlp(x, *base, up_lora=(loras[1][0], loras[0][1][:100], 1.0))
    with pytest.raises(TypeError, match=r"down_lora must be None or \(lora_a, lora_b, scaling\)"):
        tf.swiglu_mlp(x, *base, down_lora=loras[2][:2])
