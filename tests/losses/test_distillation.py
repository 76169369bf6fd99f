import pytest
import torch

from tigon.testing import reference
import tigon.losses.distillation as distill
from tigon.ops import divergence
from tigon.ops import fused_linear as fused_linear_ops
from utils import DEVICE, ON_GPU, assert_close, leaf_copies, pick, randn

# (token shape, student H, teacher H, V, rows per chunk): the chunk never divides the tokens, so
# the last chunk is partial; the teacher is wider than the student in the first case.
CASES = pick(
    cpu=[((19,), 32, 48, 300, 8), ((2, 9), 24, 24, 517, 5)],
    gpu=[((4096,), 1024, 2048, 32000, 1000), ((2, 1000), 2048, 4096, 128256, 700)],
)
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(autouse=True)
def _seed_and_small_blocks(monkeypatch):
    torch.manual_seed(0)
    # Several vocabulary blocks per row on the interpreter (the real vocabularies do it on a GPU).
    if not ON_GPU:
        monkeypatch.setattr(divergence, "MAX_BLOCK_BYTES", 512)


def _problem(case, dtype, teacher_dtype=None, ignore_every=4, input_grad=True, weight_grad=True):
    token_shape, hidden, teacher_hidden, vocab, chunk_rows = case
    teacher_dtype = dtype if teacher_dtype is None else teacher_dtype
    # Logits of unit scale for both models: x ~ N(0, 1), W ~ N(0, 1 / H).
    x = randn(*token_shape, hidden, dtype=dtype, requires_grad=input_grad)
    weight = randn(vocab, hidden, dtype=dtype, requires_grad=weight_grad, scale=hidden**-0.5)
    teacher_x = randn(*token_shape, teacher_hidden, dtype=teacher_dtype)
    teacher_weight = randn(vocab, teacher_hidden, dtype=teacher_dtype, scale=teacher_hidden**-0.5)
    labels = torch.randint(0, vocab, token_shape, device=DEVICE)
    labels.view(-1)[::ignore_every] = -100
    row_bytes = vocab * (x.element_size() + teacher_x.element_size())
    return x, weight, teacher_x, teacher_weight, labels, chunk_rows * row_bytes


def _check(x, weight, teacher_x, teacher_weight, dtype, grad_output=None, **options):
    """Loss and the student's gradients against the fp64 reference on the same values."""
    x64, w64, teacher_x64, teacher_w64 = leaf_copies(x, weight, teacher_x, teacher_weight)
    loss = distill.fused_linear_jsd(x, weight, teacher_x, teacher_weight, **options)
    options.pop("chunk_memory_bytes", None)
    truth = reference.fused_linear_jsd(
        x64, w64, teacher_x64, teacher_w64, **options, logits_dtype=x.dtype, teacher_logits_dtype=teacher_x.dtype,
    )
    assert loss.dtype == torch.float32 and loss.shape == ()
    # The truth is the exact loss of the logits rounded to each head's dtype (reference.head_logits).
    assert_close(loss, truth, dtype, "loss")
    loss.backward(grad_output)
    truth.backward(None if grad_output is None else grad_output.double())
    for name, tensor, truth_tensor in (("input", x, x64), ("weight", weight, w64)):
        if tensor.requires_grad:
            assert tensor.grad.dtype == tensor.dtype and tensor.grad.shape == tensor.shape
            assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}")
    assert teacher_x.grad is None and teacher_weight.grad is None
    return loss


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_linear_jsd(beta, dtype):
    x, weight, teacher_x, teacher_weight, labels, chunk_memory_bytes = _problem(CASES[0], dtype)
    _check(
        x, weight, teacher_x, teacher_weight, dtype,
        labels=labels, beta=beta, temperature=2.0, chunk_memory_bytes=chunk_memory_bytes,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_3d_input_without_labels(dtype):
    x, weight, teacher_x, teacher_weight, _, chunk_memory_bytes = _problem(CASES[1], dtype)
    _check(
        x, weight, teacher_x, teacher_weight, dtype, beta=0.25, temperature=0.7, chunk_memory_bytes=chunk_memory_bytes,
    )


# Known limit, measured on the H100 (2.1% error at V = 32000): the JSD gradient of a large
# vocabulary, q·(s − m) ≈ 1e-6, lies in fp16's subnormal range, where the dlogits buffer keeps
# only a few bits. bf16 (the training dtype) and fp32 are exact; fp16 holds at small V.
@pytest.mark.xfail(ON_GPU, reason="fp16 dlogits of a 32K vocabulary are subnormal", strict=True)
def test_fp16_and_teacher_in_another_dtype():
    x, weight, teacher_x, teacher_weight, labels, chunk_memory_bytes = _problem(
        CASES[0], torch.float16, teacher_dtype=torch.float32,
    )
    _check(x, weight, teacher_x, teacher_weight, torch.float16, labels=labels, chunk_memory_bytes=chunk_memory_bytes)


def test_one_row():
    _, hidden, teacher_hidden, vocab, _ = CASES[0]
    x, weight, teacher_x, teacher_weight, labels, _ = _problem(((1,), hidden, teacher_hidden, vocab, 1), torch.float32)
    _check(x, weight, teacher_x, teacher_weight, torch.float32, labels=labels.fill_(3), beta=0.5)


def test_scalar_grad_output():
    x, weight, teacher_x, teacher_weight, labels, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    _check(
        x, weight, teacher_x, teacher_weight, torch.float32, grad_output=torch.tensor(3.7, device=DEVICE),
        labels=labels, beta=0.3, chunk_memory_bytes=chunk_memory_bytes,
    )


def test_default_chunk_size():
    x, weight, teacher_x, teacher_weight, labels, _ = _problem(CASES[1], torch.float32)
    _check(x, weight, teacher_x, teacher_weight, torch.float32, labels=labels)


def test_all_ignored_rows_give_zero_loss_and_gradients():
    x, weight, teacher_x, teacher_weight, labels, chunk_memory_bytes = _problem(CASES[0], torch.bfloat16)
    loss = distill.fused_linear_jsd(
        x, weight, teacher_x, teacher_weight, labels.fill_(-100), chunk_memory_bytes=chunk_memory_bytes,
    )
    assert loss.item() == 0.0
    loss.backward()
    assert not x.grad.any() and not weight.grad.any()


@pytest.mark.parametrize("why", ["no_grad", "frozen_weight"])
def test_gradients_only_where_needed(why):
    x, weight, teacher_x, teacher_weight, labels, chunk_memory_bytes = _problem(
        CASES[0], torch.float32, weight_grad=why != "frozen_weight",
    )
    if why == "no_grad":
        truth = reference.fused_linear_jsd(
            x.double(), weight.double(), teacher_x.double(), teacher_weight.double(), labels,
        )
        with torch.no_grad():
            loss = distill.fused_linear_jsd(x, weight, teacher_x, teacher_weight, labels)
        assert not loss.requires_grad
        assert_close(loss, truth, torch.float32, "loss")
    else:
        _check(
            x, weight, teacher_x, teacher_weight, torch.float32, labels=labels, chunk_memory_bytes=chunk_memory_bytes,
        )
        assert weight.grad is None


@pytest.mark.parametrize("labelled", [True, False], ids=["labels", "no_labels"])
def test_no_host_read_and_the_mean_split_below_n(monkeypatch, labelled):
    """Where the host may not wait (CUDA-graph capture) the loss's forward and backward read no
    tensor value on the host (``n_valid`` stays on the device). The mean's split
    is capped below N here, as for a batch of more than MEAN_SCALE_ROWS tokens: the matmuls apply
    1/8 and the kernel 8 / n_valid."""
    from test_cuda_graphs import TigonHostReads

    monkeypatch.setattr(fused_linear_ops, "host_sync_allowed", lambda tensor: False)
    monkeypatch.setattr(fused_linear_ops, "MEAN_SCALE_ROWS", 8)
    x, weight, teacher_x, teacher_weight, labels, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    labels = labels if labelled else None
    x64, w64 = leaf_copies(x, weight)
    reads = TigonHostReads()
    reads.watch_tolist(monkeypatch)
    with reads:
        loss = distill.fused_linear_jsd(
            x, weight, teacher_x, teacher_weight, labels, beta=0.4, temperature=1.5,
            chunk_memory_bytes=chunk_memory_bytes,
        )
        loss.backward()
    assert not reads.places, f"host reads of tensor values by tigon at {reads.places}"
    truth = reference.fused_linear_jsd(
        x64, w64, teacher_x.double(), teacher_weight.double(), labels, beta=0.4, temperature=1.5,
    )
    truth.backward()
    assert_close(loss, truth, torch.float32, "loss")
    assert_close(x.grad, x64.grad, torch.float32, "grad of input")
    assert_close(weight.grad, w64.grad, torch.float32, "grad of weight")


def test_torch_compile_fullgraph():
    x, weight, teacher_x, teacher_weight, labels, chunk_memory_bytes = _problem(CASES[0], torch.float32)

    def step(hidden, weight, teacher_hidden, teacher_weight, labels):
        # The hidden states are intermediates, as a model's last hidden states are.
        return distill.fused_linear_jsd(
            hidden * 1.5, weight, teacher_hidden * 0.5, teacher_weight, labels, beta=0.4, temperature=1.5,
            chunk_memory_bytes=chunk_memory_bytes,
        )

    x64, w64 = leaf_copies(x, weight)
    compiled = torch.compile(step, fullgraph=True, backend=pick(cpu="aot_eager", gpu="inductor"))
    loss = compiled(x, weight, teacher_x, teacher_weight, labels)
    truth = reference.fused_linear_jsd(
        x64 * 1.5, w64, teacher_x.double() * 0.5, teacher_weight.double(), labels, beta=0.4, temperature=1.5,
    )
    assert_close(loss, truth, torch.float32, "loss")
    (loss * 2.0).backward()
    (truth * 2.0).backward()
    assert_close(x.grad, x64.grad, torch.float32, "grad of input")
    assert_close(weight.grad, w64.grad, torch.float32, "grad of weight")


def test_modules():
    rows, vocab = 9, 300
    student = randn(rows, vocab, scale=2.0).log_softmax(-1).requires_grad_()
    teacher = randn(rows, vocab, scale=2.0).log_softmax(-1)
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    labels[::3] = -100
    cases = [
        (distill.KLDivLoss(reduction="batchmean", log_target=True), (student, teacher),
         reference.kl_div(student.double(), teacher.double(), "batchmean", True)),
        (distill.JSDLoss(beta=0.3), (student, teacher, labels),
         reference.jsd(student.double(), teacher.double(), labels, beta=0.3)),
        (distill.TVDLoss(reduction="mean"), (student.exp(), teacher.exp(), labels),
         reference.tvd(student.double().exp(), teacher.double().exp(), labels, reduction="mean")),
    ]
    for module, args, truth in cases:
        assert_close(module(*args), truth, torch.float32, type(module).__name__)
    x, weight, teacher_x, teacher_weight, labels, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    module = distill.FusedLinearJSDLoss(beta=0.2, temperature=3.0, chunk_memory_bytes=chunk_memory_bytes)
    truth = reference.fused_linear_jsd(
        x.double(), weight.double(), teacher_x.double(), teacher_weight.double(), labels, beta=0.2, temperature=3.0,
    )
    assert_close(module(x, weight, teacher_x, teacher_weight, labels), truth, torch.float32, "FusedLinearJSDLoss")
    assert "temperature=3.0" in repr(module)


def _bad_calls():
    """name → (call, error, message) for every argument check."""
    rows, vocab = 4, 10
    s, t = randn(rows, vocab).log_softmax(-1), randn(rows, vocab).log_softmax(-1)
    x, weight = randn(rows, 8), randn(vocab, 8)
    teacher_x, teacher_weight = randn(rows, 6), randn(vocab, 6)
    return {
        "vocab_mismatch_fused": (
            lambda: distill.fused_linear_jsd(x, weight, teacher_x, randn(vocab + 2, 6)), ValueError,
            r"teacher_weight \(12, 6\) and weight \(10, 8\) must cover the same vocabulary: got V = 12 for the "
            r"teacher and V = 10 for the student",
        ),
        "vocab_mismatch_jsd": (
            lambda: distill.jsd(s, randn(rows, vocab + 1)), ValueError,
            r"target must have input's shape \(4, 10\) .* got \(4, 11\)",
        ),
        "teacher_hidden": (
            lambda: distill.fused_linear_jsd(x, weight, teacher_x, randn(vocab, 5)), ValueError,
            r"teacher_weight must have shape \(V, 6\) \(the hidden size of teacher_input\), got \(10, 5\)",
        ),
        "teacher_rows": (
            lambda: distill.fused_linear_jsd(x, weight, randn(rows + 1, 6), teacher_weight), ValueError,
            r"teacher_input must have input's leading dimensions \(4,\) .* got shape \(5, 6\)",
        ),
        "beta": (lambda: distill.jsd(s, t, beta=1.5), ValueError, r"beta must be in \[0, 1\], got 1.5"),
        "temperature": (
            lambda: distill.fused_linear_jsd(x, weight, teacher_x, teacher_weight, temperature=0), ValueError,
            r"temperature must be > 0, got 0",
        ),
        "reduction": (lambda: distill.kl_div(s, t, reduction="avg"), ValueError, r"reduction must be one of"),
        "labels_shape": (
            lambda: distill.tvd(s.exp(), t.exp(), torch.zeros(rows + 1, dtype=torch.long, device=DEVICE)),
            ValueError, r"labels must have shape \(4,\) \(the leading dimensions of input\), got \(5,\)",
        ),
        "labels_dtype": (
            lambda: distill.jsd(s, t, torch.zeros(rows, device=DEVICE)), TypeError, r"labels has dtype torch.float32",
        ),
        "dtypes": (
            lambda: distill.kl_div(s, t.bfloat16()), TypeError,
            r"tensors must share one dtype, got input torch.float32, target torch.bfloat16",
        ),
        "ignore_index": (lambda: distill.jsd(s, t, ignore_index=1.5), TypeError, r"ignore_index must be an int"),
        # The teacher is fixed: a teacher that requires grad is refused, not silently given no gradient.
        "teacher_input_requires_grad": (
            lambda: distill.fused_linear_jsd(x, weight, teacher_x.requires_grad_(), teacher_weight), ValueError,
            r"teacher_input requires grad, but distillation treats the teacher as fixed; tigon computes no gradient "
            r"for it: pass teacher_input\.detach\(\)",
        ),
        "teacher_weight_requires_grad": (
            lambda: distill.fused_linear_jsd(x, weight, teacher_x, teacher_weight.requires_grad_()), ValueError,
            r"teacher_weight requires grad, but distillation treats the teacher as fixed",
        ),
        "temperature_requires_grad": (
            lambda: distill.fused_linear_jsd(x, weight, teacher_x, teacher_weight, temperature=_number(2.0)),
            ValueError,
            r"temperature requires grad, but it is read as a plain number; tigon computes no gradient for it: pass a "
            r"float or temperature\.detach\(\)",
        ),
        "beta_requires_grad": (
            lambda: distill.jsd(s, t, beta=_number(0.5)), ValueError,
            r"beta requires grad, but it is read as a plain number",
        ),
    }


def _number(value):
    return torch.tensor(value, device=DEVICE, requires_grad=True)


def test_a_fixed_teacher_is_accepted_detached_or_without_grad_mode():
    x, weight, teacher_x, teacher_weight, labels, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    teacher_x.requires_grad_()
    options = dict(labels=labels, chunk_memory_bytes=chunk_memory_bytes)
    loss = distill.fused_linear_jsd(x, weight, teacher_x.detach(), teacher_weight, **options)
    with torch.no_grad():
        assert torch.equal(distill.fused_linear_jsd(x, weight, teacher_x, teacher_weight, **options), loss.detach())


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_arguments_raise_clear_errors(name):
    call, error, message = _bad_calls()[name]
    with pytest.raises(error, match=message):
        call()
