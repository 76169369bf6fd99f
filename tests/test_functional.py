"""Bad input gets a clear error at the API boundary, naming the argument, what it got and what
was expected; nothing reaches a kernel."""

import pytest
import torch

import tigon.functional as tf
import tigon.nn
from utils import DEVICE, randn

OTHER_DEVICE = torch.device("meta")


def _raises(error, match, fn, *args, **kwargs):
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)


def test_norm_errors():
    x = randn(4, 16)
    _raises(ValueError, r"weight must have shape \(16,\).*got \(15,\)", tf.rms_norm, x, randn(15))
    _raises(TypeError, r"x has dtype torch.int64; expected one of float32, bfloat16, float16", tf.rms_norm, x.long())
    _raises(TypeError, r"x must be a torch.Tensor, got list", tf.rms_norm, [1.0, 2.0])
    _raises(ValueError, r"casting_mode must be one of 'llama', 'gemma'; got 'llamas'", tf.rms_norm, x, None, casting_mode="llamas")
    _raises(ValueError, r"residual must have shape \(4, 16\)", tf.fused_add_rms_norm, x, randn(4, 17))
    _raises(TypeError, r"tensors must share one dtype, got x torch.float32, residual torch.bfloat16",
            tf.fused_add_rms_norm, x, randn(4, 16, dtype=torch.bfloat16))
    _raises(ValueError, r"bias must have shape \(16,\)", tf.layer_norm, x, randn(16), randn(3))
    # On a GPU the meta weight is refused as a non-CUDA tensor, on the CPU (interpreter) as a
    # device mismatch with x: either message names the argument and its device.
    _raises(ValueError, r"(tensors must be on one device, got x on .*, weight on meta|weight is on meta)",
            tf.rms_norm, x, torch.empty(16, device=OTHER_DEVICE))


def test_rope_errors():
    q, k = randn(1, 4, 6, 8), randn(1, 2, 6, 8)
    cos = sin = randn(1, 6, 8)
    _raises(ValueError, r"q must have 4 dimension\(s\), got shape \(4, 6, 8\)", tf.rope, q[0], k, cos, sin)
    _raises(ValueError, r"k's head count must divide q's \(GQA\): got q heads 4, k heads 3", tf.rope, q, randn(1, 3, 6, 8), cos, sin)
    _raises(ValueError, r"k must be \[B, Hk, T, D\]", tf.rope, q, randn(1, 2, 5, 8), cos, sin)
    _raises(ValueError, r"rotary_dim must be even and in \(0, 8\], got 5", tf.rope, q, k, cos, sin, rotary_dim=5)
    _raises(ValueError, r"cos must be \[B or 1, T, rotary_dim\]", tf.rope, q, k, randn(1, 6, 4), sin)


@pytest.mark.parametrize("table_shape", [(1, 6, 8), (6, 8)], ids=["[B, T, W]", "[T, W]"])
def test_rope_names_the_b_t_h_d_layout(table_shape):
    """q and k as the projections' [B, T, H, D]: the tables' T is their dimension 1, not 2, and
    the error says so rather than blaming cos."""
    q, k = randn(1, 6, 4, 8), randn(1, 6, 2, 8)
    cos = sin = randn(*table_shape)
    _raises(ValueError, r"^q and k look like \[B, T, H, D\]: got q \(1, 6, 4, 8\), k \(1, 6, 2, 8\), whose "
            r"dimension 1 is cos's T = 6; rope takes \[B, H, T, D\]: pass q.transpose\(1, 2\) and "
            r"k.transpose\(1, 2\)", tf.rope, q, k, cos, sin)
    _raises(ValueError, r"^q looks like \[B, T, H, D\]: got q \(1, 6, 4, 8\)", tf.rope, q, None, cos, sin)
    # Transposed as asked, the same tensors are accepted.
    q_rot, k_rot = tf.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert q_rot.shape == (1, 4, 6, 8) and k_rot is not None and k_rot.shape == (1, 2, 6, 8)


def test_gated_errors():
    _raises(ValueError, r"up must have shape \(3, 5\)", tf.swiglu, randn(3, 5), randn(3, 6))
    same = randn(3, 5)
    _raises(ValueError, r"inplace_backward=True needs gate and up in separate memory", tf.swiglu, same, same, inplace_backward=True)
    _raises(TypeError, r"gate has dtype torch.int32", tf.geglu, torch.ones(3, 5, dtype=torch.int32, device=DEVICE), randn(3, 5))


def _inplace_calls():
    """Each entry taking inplace_backward, as (name of the overwritten tensor, call on it)."""
    other, weight = randn(3, 6), randn(4, 6)
    target = torch.randint(0, 6, (3,), device=DEVICE)
    return [
        ("gate", lambda t: tf.swiglu(t, other, inplace_backward=True)),
        ("up", lambda t: tf.geglu(other, t, inplace_backward=True)),
        ("x", lambda t: tf.relu2(t, inplace_backward=True)),
        ("gate_up", lambda t: tf.swiglu_clamped(t, inplace_backward=True)),
        ("gate", lambda t: tf.swiglu_linear(t, other, weight, inplace_backward=True)),
        ("up", lambda t: tf.geglu_linear(other, t, weight, inplace_backward=True)),
        ("logits", lambda t: tf.cross_entropy(t, target, inplace_backward=True)),
        ("logits", lambda t: tigon.nn.CrossEntropyLoss(inplace_backward=True)(t, target)),
    ]


def test_inplace_backward_refuses_a_leaf_that_requires_grad():
    """As torch's in-place ops: a leaf that requires grad (or a view of one) is not overwritten;
    an op's output is, and so is anything when no gradient is computed."""
    for name, call in _inplace_calls():
        leaf = randn(3, 6, requires_grad=True)
        original = leaf.detach().clone()
        _raises(RuntimeError, rf"^inplace_backward=True writes the gradient over {name}, but {name} is a leaf tensor "
                r"that requires grad", call, leaf)
        _raises(RuntimeError, rf"{name} is a view of a leaf tensor that requires grad", call, leaf.view(3, 6))
        assert torch.equal(leaf.detach(), original)
        with torch.no_grad():
            call(leaf)
        call(leaf.detach())
        call(leaf * 1)


def test_cross_entropy_errors():
    logits = randn(5, 11)
    target = torch.randint(0, 11, (5,), device=DEVICE)
    _raises(ValueError, r"target must have shape \(5,\)", tf.cross_entropy, logits, target[:4])
    _raises(TypeError, r"target has dtype torch.float32; expected one of int64, int32", tf.cross_entropy, logits, target.float())
    _raises(ValueError, r"reduction must be one of 'mean', 'sum', 'none'; got 'avg'", tf.cross_entropy, logits, target, reduction="avg")
    _raises(ValueError, r"label_smoothing must be in \[0, 1\], got 1.5", tf.cross_entropy, logits, target, label_smoothing=1.5)
    _raises(ValueError, r"softcap must be None or > 0, got 0.0", tf.cross_entropy, logits, target, softcap=0.0)
    _raises(ValueError, r"lse_square_scale must be >= 0", tf.cross_entropy, logits, target, lse_square_scale=-1.0)
    bad = target.clone()
    bad[2] = 11
    _raises(ValueError, r"^target contains 11, outside \[0, V\) for the vocabulary size V = 11, and is not "
            r"ignore_index \(-100\)$", tf.cross_entropy, logits, bad)
    bad[2] = -5
    _raises(ValueError, r"target.*-5", tf.cross_entropy, logits, bad)


def test_fused_linear_cross_entropy_errors():
    x, weight = randn(5, 8), randn(11, 8)
    target = torch.randint(0, 11, (5,), device=DEVICE)
    _raises(ValueError, r"weight must be \[V, H\] with H = input.shape\[-1\] = 8, got \(11, 7\)",
            tf.fused_linear_cross_entropy, x, randn(11, 7), target)
    _raises(ValueError, r"bias must have shape \(11,\)", tf.fused_linear_cross_entropy, x, weight, target, randn(10))
    _raises(TypeError, r"tensors must share one dtype", tf.fused_linear_cross_entropy, x, weight.bfloat16(), target)
    _raises(ValueError, r"chunk_memory_bytes must be None or > 0", tf.fused_linear_cross_entropy, x, weight, target,
            chunk_memory_bytes=0)
    bad = target.clone()
    bad[0] = 11
    _raises(ValueError, r"target.*11", tf.fused_linear_cross_entropy, x, weight, bad)


@pytest.mark.parametrize("module", [False, True])
@pytest.mark.parametrize("token_shape", [(5,), (2, 5)])
def test_fused_linear_cross_entropy_names_a_swapped_input_and_weight(module, token_shape):
    # Liger's (lin_weight, _input, target): with the two exchanged, the shapes fit only swapped.
    x, weight = randn(*token_shape, 8), randn(11, 8)
    target = torch.randint(0, 11, token_shape, device=DEVICE)
    loss_fn = tigon.nn.FusedLinearCrossEntropyLoss() if module else tf.fused_linear_cross_entropy
    _raises(ValueError, rf"^input \(11, 8\) and weight \({', '.join(map(str, x.shape))}\) look swapped: target "
            r".*Did you pass \(weight, input\)\? tigon takes \(input, weight, target\)", loss_fn, weight, x, target)
    _raises(ValueError, r"look swapped", tf.fused_linear_logprobs, weight, x, target)


def test_loss_options_are_keyword_only():
    # torch's third positional argument is a class weight, and Liger orders its options otherwise.
    logits, x, weight = randn(5, 11), randn(5, 8), randn(11, 8)
    target = torch.randint(0, 11, (5,), device=DEVICE)
    _raises(TypeError, r"positional argument", tf.cross_entropy, logits, target, -100)
    _raises(TypeError, r"positional argument", tf.fused_linear_cross_entropy, x, weight, target, None, -100)
    _raises(TypeError, r"positional argument", tf.fused_linear_logprobs, x, weight, target, None, 0.7)
    _raises(TypeError, r"positional argument", tigon.nn.CrossEntropyLoss, randn(11))
    _raises(TypeError, r"positional argument", tigon.nn.FusedLinearCrossEntropyLoss, -100)


def test_numbers_that_require_grad_are_refused():
    """Options read as plain numbers get no gradient: one given as a tensor that requires grad is
    refused (a detached one, or any under torch.no_grad(), is read as its value)."""
    x, weight = randn(5, 8), randn(11, 8)
    target = torch.randint(0, 11, (5,), device=DEVICE)
    number = torch.tensor(0.5, device=DEVICE, requires_grad=True)
    calls = {
        "eps": [(tf.rms_norm, (x,)), (tf.fused_add_rms_norm, (x, x)), (tf.rms_norm_gated, (x, x)),
                (tf.layer_norm, (x,))],
        "offset": [(tf.rms_norm, (x,)), (tf.fused_add_rms_norm, (x, x)), (tf.layer_norm, (x, randn(8)))],
        "label_smoothing": [(tf.cross_entropy, (randn(5, 11), target)),
                            (tf.fused_linear_cross_entropy, (x, weight, target))],
        "lse_square_scale": [(tf.cross_entropy, (randn(5, 11), target))],
        "softcap": [(tf.cross_entropy, (randn(5, 11), target)), (tf.fused_linear_logprobs, (x, weight, target))],
        "temperature": [(tf.fused_linear_logprobs, (x, weight, target))],
    }
    for name, functions in calls.items():
        for function, args in functions:
            _raises(ValueError, rf"^{name} requires grad, but it is read as a plain number; tigon computes no gradient "
                    rf"for it: pass a float or {name}\.detach\(\)", function, *args, **{name: number})
    assert torch.equal(tf.rms_norm(x, eps=number.detach()), tf.rms_norm(x, eps=0.5))
    with torch.no_grad():
        assert torch.equal(tf.rms_norm(x, eps=number), tf.rms_norm(x, eps=0.5))
