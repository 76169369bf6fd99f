import pytest
import torch

from tigon.testing import reference
import tigon.functional as tf
import tigon.nn
import tigon.ops.cross_entropy as cross_entropy_ops
import tigon.ops.fused_linear as fused_linear_ops
from tigon.ops.fused_linear import CHUNK_ROW_MULTIPLE, chunk_rows_for
from utils import DEVICE, DTYPES, assert_close, leaf_copies, pick, randn

# (token shape, H, V, rows per chunk): the chunk size never divides the token count, so the last
# chunk is partial. On the GPU the rows are rounded to a multiple of 64 by chunk_rows_for.
CASES = pick(
    cpu=[((37,), 32, 500, 10), ((2, 33), 64, 1000, 24)],
    gpu=[((4096,), 1024, 32000, 1000), ((2, 1000), 2048, 128256, 700)],
)
REDUCTIONS = ["mean", "sum", "none"]
ALL_OPTIONS = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=30.0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _problem(case, dtype, bias=True, input_grad=True, weight_grad=True, bias_grad=True, ignore_every=7):
    token_shape, hidden, vocab, chunk_rows = case
    x = randn(*token_shape, hidden, dtype=dtype, requires_grad=input_grad)
    # Logits of unit scale: x, weight ~ N(0, 1) / H^(1/4) each.
    weight = randn(vocab, hidden, dtype=dtype, requires_grad=weight_grad, scale=hidden**-0.5)
    b = randn(vocab, dtype=dtype, requires_grad=bias_grad) if bias else None
    target = torch.randint(0, vocab, token_shape, device=DEVICE)
    target.view(-1)[::ignore_every] = -100
    chunk_memory_bytes = chunk_rows * vocab * x.element_size()
    return x, weight, target, b, chunk_memory_bytes


def _check(x, weight, target, bias, dtype, chunk_memory_bytes, grad_output=None, **options):
    """Loss (and z-loss) and every gradient of tigon against the fp64 reference."""
    x64, w64, b64 = leaf_copies(x, weight, bias)
    out = tf.fused_linear_cross_entropy(x, weight, target, bias, chunk_memory_bytes=chunk_memory_bytes, **options)
    truth = reference.fused_linear_cross_entropy(x64, w64, target, b64, **options)
    if options.get("return_z_loss"):
        (out, z_loss), (truth, truth_z_loss) = out, truth
        assert z_loss.dtype == torch.float32 and not z_loss.requires_grad
        assert_close(z_loss, truth_z_loss, dtype, "z_loss")
    # fp32 loss, but from logits rounded to the input dtype by the matmul: the dtype's tolerance.
    assert out.dtype == torch.float32 and out.shape == truth.shape
    assert_close(out, truth, dtype, "loss")

    if grad_output is None and out.dim() > 0:
        grad_output = torch.randn_like(out)
    out.backward(grad_output)
    truth.backward(None if grad_output is None else grad_output.to(truth.dtype))
    for name, tensor, truth_tensor in (("input", x, x64), ("weight", weight, w64), ("bias", bias, b64)):
        if tensor is None or not tensor.requires_grad:
            continue
        assert tensor.grad.dtype == dtype and tensor.grad.shape == tensor.shape
        assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_cross_entropy(case, dtype, reduction, bias):
    x, weight, target, b, chunk_memory_bytes = _problem(case, dtype, bias=bias)
    _check(x, weight, target, b, dtype, chunk_memory_bytes, reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_options(dtype, reduction):
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], dtype)
    _check(x, weight, target, b, dtype, chunk_memory_bytes, reduction=reduction, return_z_loss=True, **ALL_OPTIONS)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_output_scalar(reduction):
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    _check(
        x, weight, target, b, torch.float32, chunk_memory_bytes,
        grad_output=torch.tensor(3.7, device=DEVICE), reduction=reduction,
    )


@pytest.mark.parametrize("frozen", ["weight", "input", "bias", "weight_and_bias"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_frozen_tensors_get_no_grad(frozen, reduction):
    # A frozen head (LoRA) must cost neither an error nor a [V, H] gradient.
    x, weight, target, b, chunk_memory_bytes = _problem(
        CASES[0], torch.bfloat16,
        input_grad=frozen != "input", weight_grad="weight" not in frozen, bias_grad="bias" not in frozen,
    )
    _check(x, weight, target, b, torch.bfloat16, chunk_memory_bytes, reduction=reduction)
    for name, tensor in (("input", x), ("weight", weight), ("bias", b)):
        assert (tensor.grad is None) == (name in frozen), name


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("module", [False, True])
def test_all_ignored_batch_matches_pytorch(reduction, module):
    # PyTorch's mean over no target is NaN (0 / 0), with zero gradients; its sum is 0.
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.bfloat16)
    target = torch.full_like(target, -100)
    options = dict(reduction=reduction, lse_square_scale=1e-3, return_z_loss=True, chunk_memory_bytes=chunk_memory_bytes)
    if module:
        loss, z_loss = tigon.nn.FusedLinearCrossEntropyLoss(**options)(x, weight, target, b)
    else:
        loss, z_loss = tf.fused_linear_cross_entropy(x, weight, target, b, **options)
    truth = torch.nn.functional.cross_entropy(x.detach().double() @ weight.detach().double().T, target,
                                              reduction=reduction)
    assert torch.equal(loss.isnan(), truth.isnan()) and loss.isnan().all() == (reduction == "mean")
    assert torch.equal(z_loss.isnan(), truth.isnan()) and not loss.nan_to_num().any() and not z_loss.nan_to_num().any()
    loss.sum().backward()
    for tensor in (x, weight, b):
        assert not tensor.grad.any()


def test_empty_batch():
    _, weight, _, b, _ = _problem(CASES[0], torch.float32)
    x = randn(0, weight.shape[1], requires_grad=True)
    loss = tf.fused_linear_cross_entropy(x, weight, torch.zeros(0, dtype=torch.int64, device=DEVICE), b)
    loss.backward()
    # PyTorch's mean over no target: NaN, with zero gradients.
    assert loss.isnan() and x.grad.shape == x.shape
    assert not weight.grad.any() and not b.grad.any()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_non_contiguous_input_and_strided_int32_target(reduction):
    token_shape, hidden, vocab, chunk_rows = CASES[1]
    x = randn(*token_shape, hidden + 16, dtype=torch.bfloat16)[..., 8 : 8 + hidden].requires_grad_()
    _, weight, target, b, chunk_memory_bytes = _problem(CASES[1], torch.bfloat16)
    # Every other column of a wider target: a view whose flattening keeps a stride of 2.
    strided = torch.stack((target, torch.zeros_like(target)), -1).int()[..., 0]
    assert not strided.is_contiguous()
    x64, w64, b64 = leaf_copies(x, weight, b)
    loss = tf.fused_linear_cross_entropy(
        x, weight, strided, b, reduction=reduction, chunk_memory_bytes=chunk_memory_bytes,
    )
    truth = reference.fused_linear_cross_entropy(x64, w64, target, b64, reduction=reduction)
    assert_close(loss, truth, torch.bfloat16, "loss")
    grad_output = torch.randn_like(truth)
    loss.backward(grad_output.float())
    truth.backward(grad_output)
    for name, tensor, truth_tensor in (("input", x, x64), ("weight", weight, w64), ("bias", b, b64)):
        assert_close(tensor.grad, truth_tensor.grad, torch.bfloat16, f"grad of {name}")


@pytest.mark.parametrize("bad", ["V", "negative"])
def test_target_out_of_range_raises(bad):
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    vocab = weight.shape[0]
    value = vocab if bad == "V" else -3
    target.view(-1)[4] = value
    with pytest.raises(ValueError, match=rf"target contains {value}, outside \[0, V\) for the vocabulary size V = {vocab}, "):
        tf.fused_linear_cross_entropy(x, weight, target, b, chunk_memory_bytes=chunk_memory_bytes)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_unchecked_out_of_range_targets_are_ignored(monkeypatch, reduction):
    """Where the host may not wait for the GPU (CUDA-graph capture, torch.compile) the range is not
    checked: a target outside [0, V) then counts as ignore_index, bit for bit."""
    for module in (cross_entropy_ops, fused_linear_ops):
        monkeypatch.setattr(module, "host_sync_allowed", lambda tensor: False)
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    vocab = weight.shape[0]
    positions = [3, 12, 30]
    out_of_range, ignored = target.clone(), target.clone()
    out_of_range[positions] = torch.tensor([vocab, -2, 10 * vocab], device=DEVICE)
    ignored[positions] = -100
    grad_output = torch.randn(target.shape, device=DEVICE) if reduction == "none" else None
    results = []
    for target in (out_of_range, ignored):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, b)]
        loss = tf.fused_linear_cross_entropy(
            *leaves[:2], target, leaves[2], reduction=reduction, chunk_memory_bytes=chunk_memory_bytes,
        )
        loss.backward(grad_output)
        results.append((loss.detach(), *(leaf.grad for leaf in leaves)))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_split_between_matmuls_and_kernel(monkeypatch, dtype):
    """Where the host may not wait (CUDA-graph capture) the mean's 1 / n_valid is split as
    alpha = 1 / m (matmuls) and m / n_valid (kernel), with m = min(N, MEAN_SCALE_ROWS): with fewer
    tokens than that m = N, so a cap of N / 2 makes the split the general one, m < N, as with 2¹⁵
    tokens (a smaller cap would scale fp16's dlogits further into its subnormals than any real
    batch does)."""
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], dtype)
    for module in (cross_entropy_ops, fused_linear_ops):
        monkeypatch.setattr(module, "host_sync_allowed", lambda tensor: False)
    monkeypatch.setattr(fused_linear_ops, "MEAN_SCALE_ROWS", target.numel() // 2)
    _check(x, weight, target, b, dtype, chunk_memory_bytes, reduction="mean", label_smoothing=0.1)


def test_all_ignored_mean_is_nan_without_host_sync(monkeypatch):
    """Under CUDA-graph capture the mean's 0 / 0 is taken on the device: still NaN, the gradients
    still zero (the split factors stay finite)."""
    for module in (cross_entropy_ops, fused_linear_ops):
        monkeypatch.setattr(module, "host_sync_allowed", lambda tensor: False)
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    loss = tf.fused_linear_cross_entropy(x, weight, torch.full_like(target, -100), b,
                                         chunk_memory_bytes=chunk_memory_bytes)
    loss.backward()
    assert loss.isnan()
    for tensor in (x, weight, b):
        assert not tensor.grad.any()


def test_default_chunk_size():
    x, weight, target, b, _ = _problem(CASES[1], torch.float32)
    _check(x, weight, target, b, torch.float32, None, reduction="mean")


def test_loss_only_under_no_grad():
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.bfloat16)
    truth = reference.fused_linear_cross_entropy(x.double(), weight.double(), target, b.double())
    with torch.no_grad():
        loss = tf.fused_linear_cross_entropy(x, weight, target, b, chunk_memory_bytes=chunk_memory_bytes)
    assert not loss.requires_grad
    assert_close(loss, truth, torch.bfloat16, "loss")


def test_chunk_rows():
    # 512 MiB of Llama-3 logits (V = 128256, bf16) is 2093 rows, rounded down to whole tiles.
    assert chunk_rows_for(8192, 128256, 2, 512 * 2**20) == 2048
    assert chunk_rows_for(8192, 128256, 2, 1) == 1
    assert chunk_rows_for(8192, 1000, 4, 50 * 4000) == 50
    assert chunk_rows_for(100, 1000, 4, 10**9) == 100
    assert chunk_rows_for(8192, 1000, 4, 1000 * 4000) % CHUNK_ROW_MULTIPLE == 0


@pytest.mark.parametrize(
    "n_classes, element_size, rows, mib",
    [
        (32000, 2, 8192, 500),  # 512 MiB hold every token
        (128256, 2, 2048, 501),  # 2093 rows, rounded down to whole tiles: the measured default
        (151936, 2, 2048, 593.5),  # Qwen: 1766 rows in 512 MiB; the budget grows to 607 MiB
        (262144, 2, 2048, 1024),  # Gemma 3: 1024 rows in 512 MiB; the budget grows to 1 GiB
        (262144, 4, 1024, 1024),  # fp32 logits: as many rows as at V = 128256
    ],
)
def test_default_chunk_keeps_its_rows_at_large_vocabularies(n_classes, element_size, rows, mib):
    """The default budget, 512 MiB, grows as V / 128256 beyond Llama 3's vocabulary, so that the
    matmuls keep the shape measured best there; an explicit budget is a limit, and no chunk
    exceeds the tokens."""
    assert chunk_rows_for(8192, n_classes, element_size, None) == rows
    assert rows * n_classes * element_size / 2**20 == mib
    assert chunk_rows_for(1000, n_classes, element_size, None) == 1000
    explicit = chunk_rows_for(8192, n_classes, element_size, 512 * 2**20)
    assert explicit * n_classes * element_size <= 512 * 2**20


def test_module():
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    module = tigon.nn.FusedLinearCrossEntropyLoss(label_smoothing=0.1, chunk_memory_bytes=chunk_memory_bytes)
    x64, w64, b64 = leaf_copies(x, weight, b)
    loss = module(x, weight, target, b)
    truth = reference.fused_linear_cross_entropy(x64, w64, target, b64, label_smoothing=0.1)
    loss.backward()
    truth.backward()
    assert_close(loss, truth, torch.float32, "loss")
    assert_close(weight.grad, w64.grad, torch.float32, "grad of weight")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph(reduction):
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)

    def step(hidden, weight, target, bias):
        # The input is an intermediate, as the last hidden state of a model is.
        return tf.fused_linear_cross_entropy(
            hidden * 1.5, weight, target, bias, reduction=reduction, lse_square_scale=1e-3, return_z_loss=True,
            chunk_memory_bytes=chunk_memory_bytes,
        )

    x64, w64, b64 = leaf_copies(x, weight, b)
    compiled = torch.compile(step, fullgraph=True, backend=pick(cpu="aot_eager", gpu="inductor"))
    loss, z_loss = compiled(x, weight, target, b)
    truth, truth_z_loss = reference.fused_linear_cross_entropy(
        x64 * 1.5, w64, target, b64, reduction=reduction, lse_square_scale=1e-3, return_z_loss=True,
    )
    assert_close(loss, truth, torch.float32, "loss")
    assert_close(z_loss, truth_z_loss, torch.float32, "z_loss")
    (loss.sum() * 3.7).backward()
    (truth.sum() * 3.7).backward()
    for name, tensor, truth_tensor in (("input", x, x64), ("weight", weight, w64), ("bias", b, b64)):
        assert_close(tensor.grad, truth_tensor.grad, torch.float32, f"grad of {name}")
