"""The fused cross entropy's head matmuls in FP8 (``fp8=``, tigon.ops.fp8), against the FP8 reference
(torchao's recipes on fake-quantized operands, tigon.testing.reference) and the fp64 truth.

FP8 has an error of its own (a few percent on the gradients): the losses must match the FP8
reference where the quantization is the same (rowwise scales do not depend on the chunking; a
tensorwise input's does, so it is checked on one chunk), and every gradient must be no further
from the fp64 truth than the reference's FP8 is, plus bf16's own error. The matmuls must really
be FP8 ones: ``torch._scaled_mm`` is counted.
"""

import pytest
import torch

import tigon.functional as tf
from tigon.ops import fp8
from tigon.ops.cross_entropy import launch_cross_entropy_fwd
from tigon.testing import reference
from utils import DEVICE, pick, randn

# (token shape, H, V, rows per chunk), V and H multiples of 16 (FP8 matmuls' alignment), the token
# count not: the last chunk is partial, and the weight gradient's rows are padded.
CASES = pick(cpu=[((2, 100), 64, 272, 48)], gpu=[((4, 1000), 1024, 32000, 1024)])
RECIPES = list(fp8.RECIPES)
LOSS_TOLERANCE = 1e-4
# FP8's own error is the reference's; bf16 storage of the logits and their gradient adds its own.
FP8_ERROR_FACTOR, BF16_ERROR = 1.3, 5e-3


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _relative(value, truth):
    return ((value.double() - truth.double()).norm() / truth.double().norm()).item()


def _problem(case, bias=False):
    token_shape, hidden, vocab, chunk_rows = case
    x = randn(*token_shape, hidden, dtype=torch.bfloat16, requires_grad=True)
    weight = randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True, scale=hidden**-0.5)
    b = randn(vocab, dtype=torch.bfloat16, requires_grad=True) if bias else None
    target = torch.randint(0, vocab, token_shape, device=DEVICE)
    target.view(-1)[::7] = -100
    return x, weight, target, b, chunk_rows * vocab * 2


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


# Each recipe with the gradients computed in forward ("mean"), with a bias and the recomputing
# backward ("none"), and with every option of the loss and a gradient scale per row (the tensorwise
# recipe's dlogits then go from the logits straight to FP8: Fp8HeadMatmuls.cross_entropy_grad).
OPTIONS = {"label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 3.0}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("reduction", "bias", "options"), [("mean", False, {}), ("none", True, {}),
                                                            ("none", False, OPTIONS)],
                         ids=["mean", "none-bias", "none-options"])
def test_fp8_head_within_fp8_error(recipe, reduction, bias, options, scaled_mm_calls, monkeypatch):
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], bias)
    # The weight gradient of every chunk (or group of chunks) after the first in two slices of rows,
    # the second shorter; the tensorwise recipe without a bias computes it per two chunks.
    slice_rows = weight.shape[0] // 2 + 16
    monkeypatch.setattr(fp8, "GRAD_WEIGHT_SLICE_ROWS", slice_rows)
    monkeypatch.setattr(fp8, "GRAD_WEIGHT_GROUP_ROWS", 2 * CASES[0][3])
    leaves = (x, weight) if b is None else (x, weight, b)
    n_valid = (target != -100).sum()

    def mean_of(loss):
        return loss if reduction == "mean" else loss.sum() / n_valid

    ours = mean_of(tf.fused_linear_cross_entropy(x, weight, target, b, reduction=reduction,
                                                 chunk_memory_bytes=chunk_memory_bytes, fp8=recipe, **options))
    our_grads = _grads(ours, leaves)
    n_chunks = -(-target.numel() // CASES[0][3])
    grouped = recipe == "tensorwise" and b is None
    n_matmuls = -(-n_chunks // 2) if grouped else n_chunks
    # Per chunk: the logits and dx ("none" recomputes the logits in backward: once more), and dW
    # in FP8 where the recipe says, in one matmul for the first chunk (or group), then one per slice.
    grad_weight_calls = 1 + (n_matmuls - 1) * 2 if fp8.RECIPES[recipe].grad_weight_fp8 else 0
    expected = n_chunks * (2 + (reduction == "none")) + grad_weight_calls
    assert n_chunks > 1 and len(scaled_mm_calls) == expected, scaled_mm_calls

    fp8_reference = reference.fused_linear_cross_entropy(x, weight, target, b, fp8=recipe, **options)
    reference_grads = _grads(fp8_reference, leaves)
    truth = reference.fused_linear_cross_entropy(
        x.double(), weight.double(), target, None if b is None else b.double(), **options)
    truth_grads = _grads(truth, leaves)
    if fp8.RECIPES[recipe].axiswise:
        assert abs(ours.item() - fp8_reference.item()) <= LOSS_TOLERANCE * abs(fp8_reference.item())
    for name, mine, theirs, exact in zip(("input", "weight", "bias"), our_grads, reference_grads, truth_grads):
        bound = FP8_ERROR_FACTOR * _relative(theirs, exact) + BF16_ERROR
        assert _relative(mine, exact) <= bound, f"{name}: {_relative(mine, exact)} > {bound}"


# The rowwise recipes' losses are checked against the reference over several chunks above; a
# tensorwise input's scale depends on the chunk, so it is checked on one.
@pytest.mark.parametrize("recipe", ["tensorwise"])
def test_one_chunk_loss_equals_the_fp8_reference(recipe):
    x, weight, target, _, _ = _problem(CASES[0])
    ours = tf.fused_linear_cross_entropy(x, weight, target, fp8=recipe, chunk_memory_bytes=2**30)
    theirs = reference.fused_linear_cross_entropy(x, weight, target, fp8=recipe)
    assert abs(ours.item() - theirs.item()) <= LOSS_TOLERANCE * abs(theirs.item())


def test_cast_scales_and_pads():
    t = torch.tensor([[1.0, -2.0], [0.5, 0.25], [0.0, 0.0]], device=DEVICE)
    (q, inverse), (q_t, inverse_t) = fp8.cast(t, fp8.E4M3, "axiswise", "tensorwise", power_of_2=False)
    assert q.shape == (3, 2) and inverse.shape == (3, 1) and q_t.shape == (2, 16) and inverse_t.shape == ()
    torch.testing.assert_close(q.float() * inverse, t)  # these values are exact in e4m3
    torch.testing.assert_close(q_t[:, :3].float() * inverse_t, t.t())
    assert not q_t[:, 3:].float().any()
    assert inverse[0].item() == pytest.approx(2.0 / 448) and inverse[2].item() == pytest.approx(fp8.AMAX_EPS / 448)
    (_, inverse), none = fp8.cast(t, fp8.E4M3, "tensorwise", None, power_of_2=True)
    assert inverse.item() == 2.0 ** -7 and none is None  # 448 / 2 = 224, rounded down to 128
    none, (_, inverse_t) = fp8.cast(t, fp8.E4M3, None, "axiswise", power_of_2=True)
    assert none is None and inverse_t.reshape(-1).tolist() == [2.0 ** -8, 2.0 ** -7]


@pytest.mark.parametrize("options", [{}, OPTIONS], ids=["plain", "options"])
def test_cross_entropy_grad_goes_straight_to_fp8(options):
    # 37 rows (some ignored, each with its own gradient scale) of 304 logits, partial tiles both ways.
    n_rows, vocab = 37, 304
    logits = (randn(n_rows, vocab) * 4).bfloat16()
    target = torch.randint(0, vocab, (n_rows,), device=DEVICE)
    target[::5] = -100
    grad_scale = torch.rand(n_rows, device=DEVICE) + 0.5
    z = logits.double().requires_grad_()
    (truth,) = torch.autograd.grad(
        (reference.cross_entropy(z, target, reduction="none", **options) * grad_scale).sum(), z)

    loss, stats = torch.empty(n_rows, device=DEVICE), torch.empty(4, n_rows, device=DEVICE)
    bound = torch.zeros(1, device=DEVICE)
    launch_cross_entropy_fwd(logits, target, None, grad_scale, loss, None, -100, options.get("label_smoothing", 0.0),
                             options.get("lse_square_scale", 0.0), options.get("softcap"), stats, bound)
    torch.testing.assert_close(loss.double(), reference.cross_entropy(z, target, reduction="none", **options).detach(),
                               rtol=1e-5, atol=1e-6)
    matmuls = fp8.Fp8HeadMatmuls(randn(vocab, 32, dtype=torch.bfloat16), "tensorwise")
    matmuls.cross_entropy_grad(logits, target, stats, bound, options.get("softcap"))
    (q, inverse), (q_t, inverse_t) = matmuls.grad_cast[1], matmuls.grad_transposed[1]
    amax = truth.abs().max().item()
    # The bound is the gradient's largest magnitude (where a target's entry is, as here), as torchao's
    # scale would take it.
    assert bound.item() == pytest.approx(amax, rel=1e-5) and inverse.item() == pytest.approx(amax / 57344, rel=1e-5)
    # Rounded once, fp32 → e5m2: within half a step (2 mantissa bits) of the fp64 gradient, or of a
    # subnormal's step.
    error = (q.double() * inverse.item() - truth).abs()
    assert (error <= 2.0**-3 * truth.abs() + 2.0**-17 * inverse.item() + 1e-6 * amax).all()
    assert not q[::5].double().any()
    assert q_t.shape == (vocab, 48) and inverse_t is inverse
    assert torch.equal(q_t[:, :n_rows].view(torch.uint8), q.t().view(torch.uint8))
    assert not q_t[:, n_rows:].view(torch.uint8).any()


def _torch_cast(t, dtype, dim, power_of_2):
    """``t`` cast by PyTorch, scaled over ``dim`` (``None``: the tensor), and the inverse scales."""
    limit = torch.finfo(dtype).max
    low, high = torch.aminmax(t) if dim is None else torch.aminmax(t, dim=dim, keepdim=True)
    scale = (limit / torch.maximum(high, -low).double().clamp(min=fp8.AMAX_EPS)).float()
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))  # torchao's rounding of the scales
    return (t.float() * scale).clamp(-limit, limit).to(dtype), scale.reciprocal()


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("rows, columns", [("axiswise", "axiswise"), ("tensorwise", "tensorwise"),
                                           ("axiswise", None), (None, "tensorwise")])
@pytest.mark.parametrize("power_of_2", [False, True], ids=["exact_scale", "pow2_scale"])
def test_the_cast_kernels_round_as_pytorch_does(dtype, rows, columns, power_of_2):
    # Rows from 1e-6 to 1e3: per-tensor and per-column scales put the small ones among the
    # subnormals; ties (42 → 40 in e4m3, to even) and zeros of both signs included. 37 rows and
    # 300 columns: partial tiles both ways, and 11 zero columns of padding in the transposed copy.
    t = (torch.randn(37, 300, device=DEVICE) * torch.logspace(-6, 3, 37, device=DEVICE).unsqueeze(1)).bfloat16()
    t[0, :5] = torch.tensor([42.0, 31.6875, -42.0, 0.0, -0.0])
    t[1] = 0
    row_major, transposed = fp8.cast(t, dtype, rows, columns, power_of_2)
    if rows is not None:
        expected, inverse = _torch_cast(t, dtype, 1 if rows == "axiswise" else None, power_of_2)
        assert torch.equal(row_major[0].view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(row_major[1], inverse.reshape(row_major[1].shape))
    if columns is not None:
        expected, inverse = _torch_cast(t, dtype, 0 if columns == "axiswise" else None, power_of_2)
        q_t, inverse_t = transposed
        assert q_t.shape == (300, 48) and not q_t[:, 37:].view(torch.uint8).any()
        assert torch.equal(q_t[:, :37].view(torch.uint8), expected.t().view(torch.uint8))
        assert torch.equal(inverse_t, inverse.reshape(inverse_t.shape))


def test_bad_fp8_arguments_are_refused():
    x, weight, target, _, _ = _problem(CASES[0])
    with pytest.raises(ValueError, match="fp8 must be None or one of 'tensorwise', 'rowwise'"):
        tf.fused_linear_cross_entropy(x, weight, target, fp8="float8")
    unaligned = rf"the head's weight is \(270, {weight.shape[1]}\); FP8 matmuls need both dimensions divisible by 16"
    with pytest.raises(ValueError, match=unaligned):
        tf.fused_linear_cross_entropy(x, weight[:270], target.clamp(max=269), fp8="rowwise")


@pytest.mark.parametrize("recipe", ["rowwise"])
def test_fp8_logprobs_and_entropy_within_fp8_error(recipe, scaled_mm_calls):
    x, weight, target, _, chunk_memory_bytes = _problem(CASES[0])
    valid = target != -100
    log_probs, entropy, *_ = tf.fused_linear_logprobs(
        x, weight, target, outputs=("log_probs", "entropy"), chunk_memory_bytes=chunk_memory_bytes, fp8=recipe)
    loss = -(log_probs.sum() + 0.1 * entropy.sum()) / valid.sum()  # not grad_in_forward: backward recomputes
    ours = _grads(loss, (x, weight))
    assert len(scaled_mm_calls) >= 2 * -(-target.numel() // CASES[0][3])

    def reference_loss(logits):
        log_p = torch.log_softmax(logits, -1)
        picked = log_p.gather(-1, target.reshape(-1, 1).clamp(min=0)).squeeze(-1) * valid.reshape(-1)
        entropies = -(log_p.exp() * log_p).sum(-1) * valid.reshape(-1)
        return -(picked.sum() + 0.1 * entropies.sum()) / valid.sum(), picked

    fp8_loss, fp8_picked = reference_loss(reference.fp8_linear(x, weight, recipe=recipe))
    truth_loss, _ = reference_loss(x.double().reshape(-1, x.shape[-1]) @ weight.double().T)
    if fp8.RECIPES[recipe].axiswise:
        torch.testing.assert_close(log_probs.reshape(-1).float(), fp8_picked.float(), atol=2e-2, rtol=0)
    for mine, theirs, exact in zip(ours, _grads(fp8_loss, (x, weight)), _grads(truth_loss, (x, weight))):
        assert _relative(mine, exact) <= FP8_ERROR_FACTOR * _relative(theirs, exact) + BF16_ERROR


def test_fp8_grpo_loss_follows_the_bf16_one(scaled_mm_calls):
    from tigon.losses import fused_linear_grpo

    token_shape, hidden, vocab, _ = CASES[0]
    x = randn(*token_shape, hidden, dtype=torch.bfloat16, requires_grad=True)
    weight = randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True, scale=hidden**-0.5)
    ids = torch.randint(0, vocab, token_shape, device=DEVICE)
    mask = torch.ones(token_shape, dtype=torch.bool, device=DEVICE)
    mask[:, -7:] = False
    advantages = torch.randn(token_shape[0], device=DEVICE)
    old = -torch.rand(token_shape, device=DEVICE) * 6
    bf16_loss, _ = fused_linear_grpo(x, weight, ids, mask, advantages, old_per_token_logps=old)
    assert not scaled_mm_calls
    fp8_loss, metrics = fused_linear_grpo(x, weight, ids, mask, advantages, old_per_token_logps=old, fp8="rowwise")
    assert scaled_mm_calls and torch.isfinite(metrics["entropy"])
    assert abs(fp8_loss.item() - bf16_loss.item()) <= 0.05 * abs(bf16_loss.item()) + 1e-3
    with pytest.raises(ValueError, match="fp8 must be None or one of"):
        fused_linear_grpo(x, weight, ids, mask, advantages, fp8="e4m3")
