import pytest
import torch

from tigon.testing import reference
import tigon.functional as tf
import tigon.nn
import tigon.ops.cross_entropy as cross_entropy_ops
from utils import DEVICE, DTYPES, ON_GPU, assert_close, leaf_copies, pick, randn

# Logits shapes [..., V]: one row; a vocabulary of a few hundred; 3-D with rows not a power of two;
# a vocabulary spanning several blocks of the kernel's V loop (and a partial last block).
SHAPES = pick(
    cpu=[(1, 17), (37, 500), (2, 33, 1000), (9, 20000)],
    gpu=[(4096, 32000), (1024, 128256), (4, 1000, 50257), (64, 262144)],
)
REDUCTIONS = ["mean", "sum", "none"]
# Each option alone, then all together, over the three reductions.
OPTIONS = [
    dict(label_smoothing=0.1, reduction="sum"),
    dict(lse_square_scale=1e-3, return_z_loss=True, reduction="mean"),
    dict(softcap=5.0, reduction="none"),
    dict(label_smoothing=0.2, lse_square_scale=1e-2, softcap=30.0, return_z_loss=True, reduction="mean"),
    dict(label_smoothing=0.2, lse_square_scale=1e-2, softcap=30.0, return_z_loss=True, reduction="none"),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _targets(shape, n_classes, ignore_every=7, dtype=torch.int64, ignore_index=-100):
    """Random targets with every ``ignore_every``-th token ignored."""
    target = torch.randint(0, n_classes, shape, device=DEVICE)
    target.view(-1)[::ignore_every] = ignore_index
    return target.to(dtype)


def _check(logits, target, dtype, grad_output=None, **options):
    """Loss, z-loss and gradient of tigon against the fp64 reference on the same values.

    ``grad_output`` multiplies the loss before backward (``None``: ``loss.backward()`` for a
    scalar, random weights per token for ``"none"``). Returns tigon's loss and the gradient of
    ``logits`` as autograd delivered it (before any accumulation into ``.grad``).
    """
    inplace = options.pop("inplace_backward", False)
    (logits64,) = leaf_copies(logits)
    if inplace and logits.is_leaf:
        # inplace_backward may not overwrite a leaf that requires grad; in a model the logits are
        # the head's output: here that of a multiplication by 1.
        logits = logits * 1
    grads = []
    # Before the call: a view's hook registered after its in-place write would see another grad_fn.
    logits.register_hook(grads.append)
    out = tf.cross_entropy(logits, target, inplace_backward=inplace, **options)
    # The reference (PyTorch's cross entropy) takes int64 targets only.
    truth = reference.cross_entropy(logits64, target.long(), **options)
    if options.get("return_z_loss"):
        (out, z_loss), (truth, truth_z_loss) = out, truth
        assert z_loss.dtype == torch.float32 and not z_loss.requires_grad
        assert_close(z_loss, truth_z_loss, torch.float32, "z_loss")
    # The loss is computed and returned in fp32 whatever the logits' dtype.
    assert out.dtype == torch.float32 and out.shape == truth.shape
    assert_close(out, truth, torch.float32, "loss")

    if grad_output is None and out.dim() > 0:
        grad_output = torch.randn_like(out)
    out.backward(grad_output)
    truth.backward(None if grad_output is None else grad_output.to(truth.dtype))
    assert_close(grads[0], logits64.grad, dtype, "grad of logits")
    return out, grads[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy(shape, dtype, reduction):
    logits = randn(*shape, dtype=dtype, requires_grad=True, scale=2.0)
    target = _targets(shape[:-1], shape[-1])
    _check(logits, target, dtype, reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_inplace_backward(shape, dtype, reduction):
    logits = randn(*shape, dtype=dtype, requires_grad=True, scale=2.0)
    target = _targets(shape[:-1], shape[-1])
    _check(logits, target, dtype, reduction=reduction, inplace_backward=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_cross_entropy_options(dtype, options):
    shape = SHAPES[1]
    # Scale 10 puts logits well into the softcap's curved range.
    logits = randn(*shape, dtype=dtype, requires_grad=True, scale=10.0)
    target = _targets(shape[:-1], shape[-1])
    _check(logits, target, dtype, **options)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_options_over_several_blocks(dtype):
    shape = SHAPES[-1]
    logits = randn(*shape, dtype=dtype, requires_grad=True, scale=10.0)
    target = _targets(shape[:-1], shape[-1])
    _check(logits, target, dtype, inplace_backward=True, **OPTIONS[-1])


def test_z_loss_is_zero_without_lse_square_scale():
    logits = randn(*SHAPES[1], requires_grad=True)
    target = _targets(SHAPES[1][:-1], SHAPES[1][-1])
    _, z_loss = tf.cross_entropy(logits, target, return_z_loss=True)
    assert z_loss.item() == 0.0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_output_scalar(reduction):
    shape = SHAPES[1]
    logits = randn(*shape, requires_grad=True)
    target = _targets(shape[:-1], shape[-1])
    _check(logits, target, torch.float32, grad_output=torch.tensor(3.7, device=DEVICE), reduction=reduction)


@pytest.mark.parametrize("inplace", [False, True])
def test_grad_output_broadcast_per_token(inplace):
    # (loss.sum() * 2.5).backward() on reduction="none" sends an expanded grad_output, stride 0.
    shape = SHAPES[2]
    logits = randn(*shape, requires_grad=True)
    target = _targets(shape[:-1], shape[-1])
    (logits64,) = leaf_copies(logits)
    # The logits an op's output (times 1), as in a model: inplace_backward may not overwrite a leaf.
    (tf.cross_entropy(logits * 1, target, reduction="none", inplace_backward=inplace).sum() * 2.5).backward()
    (reference.cross_entropy(logits64, target, reduction="none").sum() * 2.5).backward()
    assert_close(logits.grad, logits64.grad, torch.float32, "grad of logits")


@pytest.mark.parametrize("layout", ["strided_rows", "contiguous_3d"])
def test_inplace_reuses_logits_storage(layout):
    shape = SHAPES[2]
    if layout == "strided_rows":
        # Rows of a wider buffer (a padded vocabulary): the gradient lands in those rows.
        # The buffer is an op's output (a multiplication by 1): a leaf may not be overwritten.
        buffer = randn(*shape[:-1], shape[-1] + 8, dtype=torch.bfloat16, requires_grad=True) * 1
        logits = buffer[..., 3 : 3 + shape[-1]]
    else:
        logits = randn(*shape, dtype=torch.bfloat16, requires_grad=True) * 1
    target = _targets(shape[:-1], shape[-1])
    _, grad = _check(logits, target, torch.bfloat16, reduction="mean", inplace_backward=True)
    assert grad.data_ptr() == logits.data_ptr()
    assert grad.stride() == logits.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["strided_rows", "unmergeable_leading", "transposed_vocab"])
@pytest.mark.parametrize("inplace", [False, True])
def test_non_contiguous_logits(dtype, layout, inplace):
    batch, seq, vocab = pick(cpu=(3, 11, 300), gpu=(8, 512, 32000))
    if layout == "strided_rows":
        logits = randn(batch, seq, vocab + 8, dtype=dtype)[..., 5 : 5 + vocab]
    elif layout == "unmergeable_leading":
        logits = randn(seq, batch, vocab, dtype=dtype).transpose(0, 1)
    else:
        logits = randn(batch, seq, vocab, dtype=dtype).transpose(-1, -2).contiguous().transpose(-1, -2)
    logits.requires_grad_()
    target = _targets((batch, seq), vocab)
    _check(logits, target, dtype, reduction="none", inplace_backward=inplace)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignore_index_inside_the_vocabulary(reduction):
    dtype = torch.bfloat16
    shape = SHAPES[1]
    logits = randn(*shape, dtype=dtype, requires_grad=True)
    target = _targets(shape[:-1], shape[-1], ignore_every=3, ignore_index=4)
    _check(logits, target, dtype, reduction=reduction, ignore_index=4, label_smoothing=0.1)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("inplace", [False, True])
def test_all_ignored_batch_matches_pytorch(reduction, inplace):
    # PyTorch's mean over no target is NaN (0 / 0), with a zero gradient; its sum is 0.
    shape = SHAPES[1]
    logits = randn(*shape, dtype=torch.bfloat16, requires_grad=True)
    (logits64,) = leaf_copies(logits)
    target = torch.full(shape[:-1], -100, device=DEVICE)
    loss, z_loss = tf.cross_entropy(
        logits * 1, target, reduction=reduction, lse_square_scale=1e-3, return_z_loss=True, inplace_backward=inplace,
    )
    truth = torch.nn.functional.cross_entropy(logits64, target, reduction=reduction)
    assert torch.equal(loss.isnan(), truth.isnan()) and loss.isnan().all() == (reduction == "mean")
    assert torch.equal(z_loss.isnan(), truth.isnan()) and not loss.nan_to_num().any() and not z_loss.nan_to_num().any()
    loss.sum().backward()
    truth.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and not logits.grad.any() and not logits64.grad.any()


@pytest.mark.parametrize("inplace", [False, True])
def test_all_ignored_sum_over_zero_items_has_zero_gradient(inplace):
    # transformers' loss with num_items_in_batch = 0: sum / 0 sends an infinite grad_output, and
    # PyTorch's gradient of the ignored rows stays 0 (not 0 · inf = NaN).
    shape = SHAPES[1]
    logits = randn(*shape, requires_grad=True)
    (logits64,) = leaf_copies(logits)
    target = torch.full(shape[:-1], -100, device=DEVICE)
    (tf.cross_entropy(logits * 1, target, reduction="sum", inplace_backward=inplace) / torch.tensor(0)).backward()
    (torch.nn.functional.cross_entropy(logits64, target, reduction="sum") / torch.tensor(0)).backward()
    assert not logits64.grad.any() and not logits.grad.any()


@pytest.mark.parametrize("module", [False, True])
def test_empty_batch_mean_is_nan(module):
    logits = randn(0, 50, requires_grad=True)
    target = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    loss = tigon.nn.CrossEntropyLoss()(logits, target) if module else tf.cross_entropy(logits, target)
    assert loss.isnan() and torch.nn.functional.cross_entropy(logits.detach(), target).isnan()
    loss.backward()
    assert logits.grad.shape == logits.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_extreme_logits(dtype, reduction):
    shape = SHAPES[1]
    logits = randn(*shape) * 4
    signs = torch.randint(0, 2, shape, device=DEVICE) * 2 - 1
    logits = torch.where(torch.rand(shape, device=DEVICE) < 0.05, 1e4 * signs, logits).to(dtype).requires_grad_()
    target = _targets(shape[:-1], shape[-1])
    loss, grad = _check(logits, target, dtype, reduction=reduction, lse_square_scale=1e-4, label_smoothing=0.1)
    assert loss.isfinite().all() and grad.isfinite().all()


def test_int32_target():
    shape = SHAPES[1]
    logits = randn(*shape, requires_grad=True)
    target = _targets(shape[:-1], shape[-1], dtype=torch.int32)
    _check(logits, target, torch.float32, reduction="mean", inplace_backward=True)


@pytest.mark.parametrize("inplace", [False, True])
def test_strided_target(inplace):
    """A target that is a strided view (every other token of a longer one) is read with its stride."""
    n_rows, n_classes = SHAPES[1]
    logits = randn(n_rows, n_classes, requires_grad=True)
    target = _targets((2 * n_rows,), n_classes, ignore_every=5)[::2]
    assert not target.is_contiguous()
    _check(logits, target, torch.float32, reduction="mean", inplace_backward=inplace)


@pytest.mark.parametrize("bad", ["V", "beyond", "negative"])
def test_target_out_of_range_raises(bad):
    shape = SHAPES[1]
    vocab = shape[-1]
    logits = randn(*shape, requires_grad=True)
    target = _targets(shape[:-1], vocab)
    value = {"V": vocab, "beyond": vocab + 12, "negative": -1}[bad]
    target[5] = value
    with pytest.raises(ValueError, match=rf"target contains {value}, outside \[0, V\) for the vocabulary size V = {vocab}, "):
        tf.cross_entropy(logits, target)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("inplace", [False, True])
def test_unchecked_out_of_range_targets_are_ignored(monkeypatch, reduction, inplace):
    """Where the host may not wait for the GPU (CUDA-graph capture, torch.compile) the range is not
    checked: a target outside [0, V) then counts as ignore_index, in the loss, the mean's divisor
    and the gradient, and nothing is read out of bounds."""
    monkeypatch.setattr(cross_entropy_ops, "host_sync_allowed", lambda tensor: False)
    shape = SHAPES[1]
    vocab = shape[-1]
    logits = randn(*shape)
    target = _targets(shape[:-1], vocab)
    positions = [3, 8, 9]
    out_of_range, ignored = target.clone(), target.clone()
    out_of_range[positions] = torch.tensor([vocab, -5, vocab + 1000], device=DEVICE)
    ignored[positions] = -100
    grad_output = torch.randn(shape[:-1], device=DEVICE) if reduction == "none" else None
    results = []
    for target in (out_of_range, ignored):
        leaf = logits.clone().requires_grad_()
        loss = tf.cross_entropy(leaf * 1, target, reduction=reduction, label_smoothing=0.1, inplace_backward=inplace)
        loss.backward(grad_output)
        results.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_nan_propagates_to_its_row():
    shape = SHAPES[1]
    logits = randn(*shape, requires_grad=True)
    with torch.no_grad():
        logits[2, 7] = float("nan")
    target = torch.randint(0, shape[-1], shape[:-1], device=DEVICE)
    loss = tf.cross_entropy(logits, target, reduction="none")
    assert loss[2].isnan() and loss[torch.arange(shape[0], device=DEVICE) != 2].isfinite().all()
    assert tf.cross_entropy(logits, target).isnan()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("why", ["frozen", "no_grad"])
def test_loss_only_leaves_logits_untouched(dtype, why):
    # No gradient is needed: the kernel skips its second pass and, even with inplace_backward,
    # does not write over the logits.
    shape = SHAPES[2]
    logits = randn(*shape, dtype=dtype, requires_grad=why == "no_grad")
    original = logits.detach().clone()
    target = _targets(shape[:-1], shape[-1])
    truth = reference.cross_entropy(original.double(), target, label_smoothing=0.1)
    with torch.set_grad_enabled(why != "no_grad"):
        loss = tf.cross_entropy(logits, target, label_smoothing=0.1, inplace_backward=True)
    assert not loss.requires_grad
    assert_close(loss, truth, torch.float32, "loss")
    assert torch.equal(logits.detach(), original)


def test_module():
    shape = SHAPES[1]
    logits = randn(*shape, dtype=torch.bfloat16, requires_grad=True)
    (logits64,) = leaf_copies(logits)
    target = _targets(shape[:-1], shape[-1])
    loss = tigon.nn.CrossEntropyLoss(label_smoothing=0.1)(logits, target)
    truth = reference.cross_entropy(logits64, target, label_smoothing=0.1)
    loss.backward()
    truth.backward()
    assert_close(loss, truth, torch.float32, "loss")
    assert_close(logits.grad, logits64.grad, torch.bfloat16, "grad of logits")


def test_module_leaves_logits_unless_asked():
    # torch.nn.CrossEntropyLoss never writes into its input: a second call on the same logits
    # gives the same loss. inplace_backward=True is the opt-in that overwrites them.
    shape = SHAPES[1]
    logits = randn(*shape, requires_grad=True)
    original = logits.detach().clone()
    target = _targets(shape[:-1], shape[-1])
    first = tigon.nn.CrossEntropyLoss()(logits, target)
    second = tigon.nn.CrossEntropyLoss()(logits, target)
    assert torch.equal(logits.detach(), original)
    assert torch.equal(first, second)
    # The opt-in overwrites an op's output (the head's), never a leaf that requires grad.
    with pytest.raises(RuntimeError, match="inplace_backward=True writes the gradient over logits"):
        tigon.nn.CrossEntropyLoss(inplace_backward=True)(logits, target)
    assert torch.equal(logits.detach(), original)
    activation = logits * 1
    tigon.nn.CrossEntropyLoss(inplace_backward=True)(activation, target)
    assert not torch.equal(activation.detach(), original)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph(inplace, reduction):
    shape = SHAPES[1]

    def step(hidden, target):
        # The logits are an intermediate, as in a model; the z-loss is returned for logging.
        return tf.cross_entropy(
            hidden * 2.0, target, reduction=reduction, lse_square_scale=1e-3, return_z_loss=True,
            inplace_backward=inplace,
        )

    hidden = randn(*shape, requires_grad=True)
    (hidden64,) = leaf_copies(hidden)
    target = _targets(shape[:-1], shape[-1])
    compiled = torch.compile(step, fullgraph=True, backend=pick(cpu="aot_eager", gpu="inductor"))
    loss, z_loss = compiled(hidden, target)
    truth, truth_z_loss = reference.cross_entropy(
        hidden64 * 2.0, target, reduction=reduction, lse_square_scale=1e-3, return_z_loss=True,
    )
    assert_close(loss, truth, torch.float32, "loss")
    assert_close(z_loss, truth_z_loss, torch.float32, "z_loss")
    (loss.sum() * 3.7).backward()
    (truth.sum() * 3.7).backward()
    assert_close(hidden.grad, hidden64.grad, torch.float32, "grad of hidden")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device: N·V > 2³¹ elements")
def test_more_than_2_to_the_31_elements():
    n_rows, vocab = 17000, 128256
    logits = randn(n_rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    target = _targets((n_rows,), vocab)
    target[-1] = 5
    rows = torch.tensor([0, 1, n_rows // 2, n_rows - 2, n_rows - 1], device=DEVICE)
    logits_rows64 = logits.detach()[rows].double().requires_grad_()
    loss = tf.cross_entropy(logits, target, reduction="none", inplace_backward=True)
    loss.backward(torch.ones_like(loss))
    truth = reference.cross_entropy(logits_rows64, target[rows], reduction="none")
    truth.backward(torch.ones_like(truth))
    assert_close(loss[rows], truth, torch.float32, "loss")
    assert_close(logits.grad[rows], logits_rows64.grad, torch.bfloat16, "grad of logits")
