import pytest
import torch

from tigon.testing import reference
import tigon.losses.distillation as distill
from tigon.ops import divergence
from utils import DEVICE, ON_GPU, assert_close, leaf_copies, pick, randn

# Rows [..., V]: a few dozen rows of a few hundred; one row; 3-D; a wider vocabulary.
SHAPE = pick(cpu=(21, 500), gpu=(4096, 32000))
SHAPES = pick(cpu=[(1, 17), (2, 13, 300), (9, 1000)], gpu=[(1, 128256), (4, 1000, 50257), (512, 262144)])
DTYPES = (torch.float32, torch.bfloat16)
KL_REDUCTIONS = ["mean", "batchmean", "sum", "none"]
TVD_REDUCTIONS = ["batchmean", "mean", "sum", "none"]
BETAS = [0.0, 0.5, 1.0, 0.25]


@pytest.fixture(autouse=True)
def _seed_and_small_blocks(monkeypatch):
    torch.manual_seed(0)
    # On the interpreter, blocks of 256 fp32 / 512 bf16 elements: rows of 300 to 1000 span several
    # blocks with a partial last one (on a GPU the real vocabularies do).
    if not ON_GPU:
        monkeypatch.setattr(divergence, "MAX_BLOCK_BYTES", 1024)


def log_probs(*shape, dtype=torch.float32, requires_grad=False):
    """Log-probabilities of random logits of scale 2, rounded to ``dtype``."""
    return randn(*shape, scale=2.0).log_softmax(-1).to(dtype).requires_grad_(requires_grad)


def probs(*shape, dtype=torch.float32, requires_grad=False):
    return randn(*shape, scale=2.0).softmax(-1).to(dtype).requires_grad_(requires_grad)


def labels_for(shape, ignore_every=5, ignore_index=-100, dtype=torch.int64):
    labels = torch.randint(0, shape[-1], shape[:-1], device=DEVICE)
    labels.view(-1)[::ignore_every] = ignore_index
    return labels.to(dtype)


def _check(function, reference_function, input, target, dtype, grad_output=None, **options):
    """Loss and the gradient of every input that requires grad, against the fp64 reference on the
    same values. ``grad_output``: ``None`` for ``loss.backward()`` on a scalar, random per element
    for pointwise losses."""
    input64, target64 = leaf_copies(input, target)
    loss = function(input, target, **options)
    truth = reference_function(input64, target64, **options)
    assert loss.shape == truth.shape
    if loss.dim() == 0:
        # Scalars are fp32 sums of fp32 terms of the stored values: fp32's tolerance.
        assert loss.dtype == torch.float32
        assert_close(loss, truth, torch.float32, "loss")
    else:
        assert loss.dtype == input.dtype
        assert_close(loss, truth, dtype, "pointwise loss")
    if grad_output is None and loss.dim() > 0:
        grad_output = torch.randn_like(loss)
    loss.backward(grad_output)
    truth.backward(None if grad_output is None else grad_output.to(truth.dtype))
    for name, tensor, tensor64 in (("input", input, input64), ("target", target, target64)):
        if tensor.requires_grad:
            assert tensor.grad.dtype == dtype and tensor.grad.shape == tensor.shape
            assert_close(tensor.grad, tensor64.grad, dtype, f"grad of {name}")
    return loss


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", KL_REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div(reduction, log_target, dtype):
    input = log_probs(*SHAPE, dtype=dtype, requires_grad=True)
    make_target = log_probs if log_target else probs
    target = make_target(*SHAPE, dtype=dtype, requires_grad=True)
    _check(distill.kl_div, reference.kl_div, input, target, dtype, reduction=reduction, log_target=log_target)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("with_labels", [False, True])
def test_jsd(beta, with_labels, dtype):
    input = log_probs(*SHAPE, dtype=dtype, requires_grad=True)
    target = log_probs(*SHAPE, dtype=dtype, requires_grad=True)
    labels = labels_for(SHAPE) if with_labels else None
    _check(distill.jsd, reference.jsd, input, target, dtype, labels=labels, beta=beta)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", TVD_REDUCTIONS)
@pytest.mark.parametrize("with_labels", [False, True])
def test_tvd(reduction, with_labels, dtype):
    input = probs(*SHAPE, dtype=dtype, requires_grad=True)
    target = probs(*SHAPE, dtype=dtype, requires_grad=True)
    labels = labels_for(SHAPE) if with_labels else None
    _check(distill.tvd, reference.tvd, input, target, dtype, labels=labels, reduction=reduction)


# (tigon, reference, input maker, target maker, options) per divergence, over the other shapes.
DIVERGENCES = {
    "kl": (distill.kl_div, reference.kl_div, log_probs, probs, dict(reduction="batchmean")),
    "kl_none": (distill.kl_div, reference.kl_div, log_probs, log_probs, dict(reduction="none", log_target=True)),
    "jsd": (distill.jsd, reference.jsd, log_probs, log_probs, dict(beta=0.7)),
    "tvd": (distill.tvd, reference.tvd, probs, probs, dict(reduction="mean")),
}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", DIVERGENCES)
def test_shapes(name, shape):
    function, reference_function, make_input, make_target, options = DIVERGENCES[name]
    input = make_input(*shape, requires_grad=True)
    target = make_target(*shape, requires_grad=True)
    if name in ("jsd", "tvd"):
        options = dict(options, labels=labels_for(shape, ignore_every=3))
    _check(function, reference_function, input, target, torch.float32, **options)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_fp16(name):
    function, reference_function, make_input, make_target, options = DIVERGENCES[name]
    input = make_input(*SHAPE, dtype=torch.float16, requires_grad=True)
    target = make_target(*SHAPE, dtype=torch.float16, requires_grad=True)
    if make_target is probs:
        # Probabilities below fp16's smallest subnormal round to 0, where the target's gradient
        # log t + 1 − x is −inf (tigon) and NaN (PyTorch's xlogy): keep the targets representable.
        target.data.clamp_(min=2.0**-24)
    _check(function, reference_function, input, target, torch.float16, **options)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_scalar_grad_output(name):
    function, reference_function, make_input, make_target, options = DIVERGENCES[name]
    input = make_input(*SHAPE, requires_grad=True)
    target = make_target(*SHAPE)
    grad_output = None if options.get("reduction") == "none" else torch.tensor(3.7, device=DEVICE)
    _check(function, reference_function, input, target, torch.float32, grad_output=grad_output, **options)


@pytest.mark.parametrize("name", ["kl_none", "tvd_none"])
def test_pointwise_grad_output_broadcast(name):
    # (loss.sum() * 2.5).backward() on pointwise losses sends an expanded grad_output, strides 0.
    function, reference_function, make, options = {
        "kl_none": (distill.kl_div, reference.kl_div, log_probs, dict(reduction="none", log_target=True)),
        "tvd_none": (distill.tvd, reference.tvd, probs, dict(reduction="none", labels=labels_for(SHAPES[1]))),
    }[name]
    input, target = make(*SHAPES[1], requires_grad=True), make(*SHAPES[1], requires_grad=True)
    input64, target64 = leaf_copies(input, target)
    (function(input, target, **options).sum() * 2.5).backward()
    (reference_function(input64, target64, **options).sum() * 2.5).backward()
    assert_close(input.grad, input64.grad, torch.float32, "grad of input")
    assert_close(target.grad, target64.grad, torch.float32, "grad of target")


@pytest.mark.parametrize("name", ["jsd", "tvd_batchmean", "tvd_mean", "tvd_sum", "tvd_none"])
def test_all_ignored_rows_give_zero_loss_and_gradients(name):
    # A plain mean over no rows is NaN; TRL's GKD loss clamps its divisor to 1 and gives 0, as
    # tigon does, with zero gradients.
    labels = torch.full(SHAPE[:-1], -100, device=DEVICE)
    if name == "jsd":
        input, target = log_probs(*SHAPE, requires_grad=True), log_probs(*SHAPE, requires_grad=True)
        loss = distill.jsd(input, target, labels)
    else:
        input, target = probs(*SHAPE, requires_grad=True), probs(*SHAPE, requires_grad=True)
        loss = distill.tvd(input, target, labels, reduction=name.removeprefix("tvd_"))
    assert not loss.any()
    loss.sum().backward()
    assert not input.grad.any() and not target.grad.any()


@pytest.mark.parametrize("reduction", KL_REDUCTIONS)
def test_kl_div_of_no_rows_as_pytorch(reduction):
    # PyTorch's "mean" and "batchmean" over no element are NaN (0 / 0); "sum" is 0.
    input, target = log_probs(0, 50, requires_grad=True), probs(0, 50)
    loss = distill.kl_div(input, target, reduction=reduction)
    truth = torch.nn.functional.kl_div(input.detach(), target, reduction=reduction)
    torch.testing.assert_close(loss, truth, equal_nan=True, rtol=0, atol=0)
    loss.sum().backward()
    assert input.grad.shape == input.shape


def test_ignore_index_and_strided_int32_labels():
    input, target = log_probs(*SHAPE, requires_grad=True), log_probs(*SHAPE, requires_grad=True)
    # Every other label of a longer tensor, ignored at random: a strided view, read at the right rows.
    labels = torch.randint(4, SHAPE[1], (2 * SHAPE[0],), device=DEVICE, dtype=torch.int32)
    labels[torch.rand(labels.shape, device=DEVICE) < 0.4] = 3
    labels = labels[::2]
    _check(distill.jsd, reference.jsd, input, target, torch.float32, labels=labels, ignore_index=3)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_masked_vocabulary_contributes_nothing(beta):
    # Entries that are −inf in both rows (a vocabulary masked for both models) are probability 0
    # on both sides: the loss and gradients are those of the other entries, not NaN.
    batch, vocab = SHAPE
    kept = torch.arange(vocab, device=DEVICE) % 7 != 0
    input, target = log_probs(batch, vocab), log_probs(batch, vocab)
    for t in (input, target):
        t[:, kept] = t[:, kept].log_softmax(-1)
        t[:, ~kept] = float("-inf")
        t.requires_grad_()
    kept_input64, kept_target64 = leaf_copies(input[:, kept], target[:, kept])
    loss = distill.jsd(input, target, beta=beta)
    truth = reference.jsd(kept_input64, kept_target64, beta=beta)
    assert_close(loss, truth, torch.float32, "loss")
    loss.backward()
    truth.backward()
    assert not input.grad[:, ~kept].any() and not target.grad[:, ~kept].any()
    assert_close(input.grad[:, kept], kept_input64.grad, torch.float32, "grad of input")
    assert_close(target.grad[:, kept], kept_target64.grad, torch.float32, "grad of target")


def test_kl_zero_probabilities_contribute_nothing():
    # As PyTorch: y·(log y − x) is 0 where y = 0, and so is the input's gradient −y.
    input = log_probs(*SHAPE, requires_grad=True)
    target = probs(*SHAPE)
    target[torch.rand(SHAPE, device=DEVICE) < 0.3] = 0.0
    loss = _check(distill.kl_div, reference.kl_div, input, target, torch.float32, reduction="batchmean")
    assert loss.isfinite()


def test_tvd_gradient_is_zero_where_equal():
    input = probs(*SHAPE, requires_grad=True)
    target = input.detach().clone()
    target[:, ::2] += 0.1
    distill.tvd(input, target, reduction="sum").backward()
    assert not input.grad[:, 1::2].any()
    assert (input.grad[:, ::2] == -0.5).all()


@pytest.mark.parametrize("name", DIVERGENCES)
def test_strided_rows(name):
    function, reference_function, make_input, make_target, options = DIVERGENCES[name]
    batch, vocab = SHAPE
    # Rows of wider buffers (a padded vocabulary), read in place.
    input = make_input(batch, vocab + 8)[:, 3 : 3 + vocab].requires_grad_()
    target = make_target(batch, vocab + 5)[:, :vocab].requires_grad_()
    _check(function, reference_function, input, target, torch.float32, **options)


@pytest.mark.parametrize("why", ["no_grad", "frozen_target"])
def test_gradients_only_where_needed(why):
    input = log_probs(*SHAPE, requires_grad=True)
    target = log_probs(*SHAPE, requires_grad=why == "no_grad")
    truth = reference.jsd(input.detach().double(), target.detach().double())
    with torch.set_grad_enabled(why != "no_grad"):
        loss = distill.jsd(input, target)
    assert_close(loss, truth, torch.float32, "loss")
    if why == "no_grad":
        assert not loss.requires_grad
    else:
        loss.backward()
        assert input.grad is not None and target.grad is None


@pytest.mark.parametrize("name", ["jsd", "kl_none"])
def test_torch_compile_fullgraph(name):
    function, reference_function, make_input, make_target, options = DIVERGENCES[name]

    def step(student_logits, target):
        # The input is an intermediate, as the log-softmax of a model's logits is.
        return function(student_logits.log_softmax(-1), target, **options)

    logits = randn(*SHAPE, requires_grad=True)
    target = make_target(*SHAPE)
    (logits64,) = leaf_copies(logits)
    compiled = torch.compile(step, fullgraph=True, backend=pick(cpu="aot_eager", gpu="inductor"))
    loss = compiled(logits, target)
    truth = reference_function(logits64.log_softmax(-1), target.double(), **options)
    assert_close(loss, truth, torch.float32, "loss")
    (loss.sum() * 1.5).backward()
    (truth.sum() * 1.5).backward()
    assert_close(logits.grad, logits64.grad, torch.float32, "grad of logits")
