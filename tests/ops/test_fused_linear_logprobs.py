import pytest
import torch

import tigon.functional as tf
import tigon.ops.cross_entropy as cross_entropy_ops
import tigon.ops.fused_linear_logprobs as fused_linear_logprobs_ops
from tigon.ops.fused_linear_logprobs import FIELDS
from tigon.testing import reference
from utils import DEVICE, DTYPES, assert_close, leaf_copies, pick, randn

# (tokens, H, V, rows per chunk): the chunk never divides the token count.
CASES = pick(
    cpu=[(37, 32, 500, 10), (70, 48, 1000, 24)],
    gpu=[(4096, 1024, 32000, 1000), (2000, 2048, 128256, 700)],
)
TRANSFORM = dict(temperature=0.7, softcap=3.0, logit_scale=1.5)
# Upstream gradients: per token for both differentiable fields (GRPO with an entropy term), or
# the same for every token on the log-probs alone (SFT's mean NLL), the case grad_in_forward serves.
UPSTREAM = ["per_token", "uniform"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _problem(case, dtype, bias=True, weight_grad=True, ignore_every=7):
    tokens, hidden, vocab, chunk_rows = case
    x = randn(tokens, hidden, dtype=dtype, requires_grad=True)
    weight = randn(vocab, hidden, dtype=dtype, requires_grad=weight_grad, scale=hidden**-0.5)
    b = randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    target[::ignore_every] = -100
    return x, weight, target, b, chunk_rows * vocab * x.element_size()


def _upstream(kind, tokens):
    if kind == "uniform":
        return torch.full((tokens,), -0.37, device=DEVICE), None
    return torch.randn(tokens, device=DEVICE), torch.randn(tokens, device=DEVICE)


def _check(x, weight, target, bias, dtype, chunk_memory_bytes, upstream="per_token", grad_in_forward=False,
           **options):
    """Every field and every gradient of tigon against the fp64 reference."""
    x64, w64, b64 = leaf_copies(x, weight, bias)
    fields = tf.fused_linear_logprobs(
        x, weight, target, bias, outputs=FIELDS, chunk_memory_bytes=chunk_memory_bytes,
        grad_in_forward=grad_in_forward, **options,
    )
    truths = reference.fused_linear_logprobs(x64, w64, target, b64, outputs=FIELDS, **options)
    for name, field, truth in zip(FIELDS[:4], fields, truths):
        assert field.dtype == torch.float32 and field.shape == target.shape, name
        # fp32 fields, from logits rounded to the input dtype by the matmul.
        assert_close(field, truth, dtype, name)
    assert not any(field.requires_grad for field in fields[2:])
    is_top1, truth_top1 = fields[4], truths[4]
    assert is_top1.dtype == torch.bool
    # 16-bit logits can swap the two largest where they nearly tie: compare where they do not.
    top2 = torch.topk(reference.head_logits(x64, w64, b64), 2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > (0.0 if dtype == torch.float32 else 0.05)
    assert torch.equal(is_top1[clear], truth_top1[clear])
    assert not is_top1[target == -100].any()

    grad_log_probs, grad_entropy = _upstream(upstream, target.numel())
    outputs = (fields[0], fields[1]) if grad_entropy is not None else (fields[0],)
    grads = (grad_log_probs, grad_entropy) if grad_entropy is not None else (grad_log_probs,)
    torch.autograd.backward(outputs, grads)
    torch.autograd.backward(truths[: len(outputs)], [g.double() for g in grads])
    for name, tensor, truth_tensor in (("input", x, x64), ("weight", weight, w64), ("bias", bias, b64)):
        if tensor is None or not tensor.requires_grad:
            continue
        assert tensor.grad.dtype == dtype and tensor.grad.shape == tensor.shape
        assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("upstream", UPSTREAM)
@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_fused_linear_logprobs(case, dtype, upstream, grad_in_forward):
    x, weight, target, b, chunk_memory_bytes = _problem(case, dtype)
    _check(x, weight, target, b, dtype, chunk_memory_bytes, upstream, grad_in_forward)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upstream", UPSTREAM)
@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_temperature_softcap_and_logit_scale(dtype, upstream, grad_in_forward):
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], dtype, bias=False)
    _check(x, weight, target, b, dtype, chunk_memory_bytes, upstream, grad_in_forward, **TRANSFORM)


def test_only_the_fields_asked_for():
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    for outputs in [("log_probs",), ("log_probs", "entropy", "is_top1"), ("entropy",)]:
        fields = tf.fused_linear_logprobs(x, weight, target, b, outputs=outputs, chunk_memory_bytes=chunk_memory_bytes)
        assert [name for name, field in zip(FIELDS, fields) if field is not None] == list(outputs)


def test_frozen_head_gets_no_grad():
    # A frozen head (LoRA) costs no [V, H] gradient; the hidden states still get theirs.
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.bfloat16, bias=False, weight_grad=False)
    _check(x, weight, target, None, torch.bfloat16, chunk_memory_bytes)
    assert weight.grad is None and x.grad is not None


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_all_ignored_rows_give_zeros_and_no_gradient(grad_in_forward):
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    target = torch.full_like(target, -100)
    fields = tf.fused_linear_logprobs(
        x, weight, target, b, outputs=FIELDS, chunk_memory_bytes=chunk_memory_bytes, grad_in_forward=grad_in_forward,
    )
    assert not any(field.any() for field in fields)
    (fields[0].sum() + fields[1].sum()).backward()
    for tensor in (x, weight, b):
        assert not tensor.grad.any()


def test_strided_input_and_int32_target_with_leading_dims():
    tokens, hidden, vocab, chunk_rows = CASES[1]
    x = randn(2, tokens // 2, hidden + 16, dtype=torch.bfloat16)[..., 8 : 8 + hidden].requires_grad_()
    _, weight, target, b, chunk_memory_bytes = _problem(CASES[1], torch.bfloat16)
    target = target[: tokens // 2 * 2].view(2, -1).int()
    x64, w64, b64 = leaf_copies(x, weight, b)
    log_probs, entropy, *_ = tf.fused_linear_logprobs(
        x, weight, target, b, outputs=("log_probs", "entropy"), chunk_memory_bytes=chunk_memory_bytes,
    )
    truth, truth_entropy, *_ = reference.fused_linear_logprobs(
        x64, w64, target.long(), b64, outputs=("log_probs", "entropy"),
    )
    assert log_probs.shape == target.shape
    assert_close(log_probs, truth, torch.bfloat16, "log_probs")
    assert_close(entropy, truth_entropy, torch.bfloat16, "entropy")
    (log_probs.sum() - entropy.sum()).backward()
    (truth.sum() - truth_entropy.sum()).backward()
    assert_close(x.grad, x64.grad, torch.bfloat16, "grad of input")


def test_no_grad_computes_fields_only():
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.bfloat16)
    with torch.no_grad():
        (log_probs, *_) = tf.fused_linear_logprobs(
            x, weight, target, b, chunk_memory_bytes=chunk_memory_bytes, grad_in_forward=True,
        )
    assert not log_probs.requires_grad
    truth = reference.fused_linear_logprobs(x.double(), weight.double(), target, b.double())[0]
    assert_close(log_probs, truth, torch.bfloat16, "log_probs")


def _entry_recorder(entered):
    """A context manager class whose every entry appends to ``entered`` (a backward_context)."""

    class Recorder:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    return Recorder


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_one_chunk_computes_no_gradient_in_forward(grad_in_forward):
    # The kept logits of a single chunk serve any upstream gradient: grad_in_forward is ignored,
    # so backward always runs (with backward_context), whatever the upstream gradient.
    x, weight, target, b, _ = _problem(CASES[0], torch.float32)
    entered = []
    Recorder = _entry_recorder(entered)

    log_probs, *_ = tf.fused_linear_logprobs(
        x, weight, target, b, chunk_memory_bytes=10**9, grad_in_forward=grad_in_forward, backward_context=Recorder,
    )
    x64, w64, b64 = leaf_copies(x, weight, b)
    truth = reference.fused_linear_logprobs(x64, w64, target, b64)[0]
    (log_probs * -0.5).sum().backward()
    (truth * -0.5).sum().backward()
    assert len(entered) == 1
    for name, tensor, truth_tensor in (("input", x, x64), ("weight", weight, w64), ("bias", b, b64)):
        assert_close(tensor.grad, truth_tensor.grad, torch.float32, f"grad of {name}")


def test_backward_context_is_entered_by_a_recomputing_backward():
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    entered = []
    Recorder = _entry_recorder(entered)

    for upstream, expected in (("uniform", 0), ("per_token", 1)):
        entered.clear()
        log_probs, entropy, *_ = tf.fused_linear_logprobs(
            x, weight, target, b, outputs=("log_probs", "entropy"), chunk_memory_bytes=chunk_memory_bytes,
            grad_in_forward=True, backward_context=Recorder,
        )
        grad_log_probs, grad_entropy = _upstream(upstream, target.numel())
        loss = (log_probs * grad_log_probs).sum()
        if grad_entropy is not None:
            loss = loss + (entropy * grad_entropy).sum()
        loss.backward()
        # The uniform gradient is served by the forward's gradients: no weight is read again.
        assert len(entered) == expected, upstream


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(outputs=("log_probs", "logits")), ValueError, "outputs must be a sequence of names from"),
        (dict(outputs="entropy"), ValueError, "outputs must be a sequence of names from"),
        (dict(temperature=0.0), ValueError, "temperature must be > 0, got 0.0"),
        (dict(softcap=-1.0), ValueError, "softcap must be None or > 0, got -1.0"),
        (dict(logit_scale=float("nan")), ValueError, "logit_scale must be a finite number"),
        (dict(chunk_memory_bytes=0), ValueError, "chunk_memory_bytes must be None or > 0"),
        (dict(backward_context=3), TypeError, "backward_context must be None or callable, got int"),
    ],
)
def test_bad_options_raise(kwargs, error, message):
    x, weight, target, b, _ = _problem(CASES[0], torch.float32)
    with pytest.raises(error, match=message):
        tf.fused_linear_logprobs(x, weight, target, b, **kwargs)


def test_bad_tensors_raise():
    x, weight, target, b, _ = _problem(CASES[0], torch.float32)
    with pytest.raises(TypeError, match="target has dtype torch.float32; expected one of int64, int32"):
        tf.fused_linear_logprobs(x, weight, target.float(), b)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] with H = input.shape\[-1\]"):
        tf.fused_linear_logprobs(x, weight[:, :-1], target, b)
    vocab = weight.shape[0]
    with pytest.raises(ValueError, match=rf"target contains {vocab}, outside \[0, V\) for the vocabulary size V = {vocab}"):
        tf.fused_linear_logprobs(x, weight, torch.full_like(target, vocab), b)


def _no_host_sync(monkeypatch):
    """As under CUDA-graph capture or torch.compile: the host may not wait for the GPU."""
    for module in (cross_entropy_ops, fused_linear_logprobs_ops):
        monkeypatch.setattr(module, "host_sync_allowed", lambda tensor: False)


def test_unchecked_out_of_range_targets_are_ignored(monkeypatch):
    """Without the range check, a target outside [0, V) counts as ignore_index, bit for bit."""
    _no_host_sync(monkeypatch)
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    vocab = weight.shape[0]
    positions = [3, 12, 30]
    out_of_range, ignored = target.clone(), target.clone()
    out_of_range[positions] = torch.tensor([vocab, -2, 10 * vocab], device=DEVICE)
    ignored[positions] = -100
    grad_log_probs, grad_entropy = _upstream("per_token", target.numel())
    results = []
    for target in (out_of_range, ignored):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, b)]
        fields = tf.fused_linear_logprobs(
            *leaves[:2], target, leaves[2], outputs=FIELDS, chunk_memory_bytes=chunk_memory_bytes,
        )
        torch.autograd.backward(fields[:2], (grad_log_probs, grad_entropy))
        results.append((*(field.detach() for field in fields), *(leaf.grad for leaf in leaves)))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.parametrize("upstream", UPSTREAM)
def test_grad_in_forward_checked_on_the_device_where_no_host_sync_is_allowed(monkeypatch, upstream):
    """The promise of grad_in_forward is checked on the device, not the host, where the host may
    not wait (CUDA-graph capture, torch.compile): gradients are exact when it holds, and an
    entropy gradient still makes backward recompute."""
    _no_host_sync(monkeypatch)

    def no_check(*args):
        raise AssertionError("uniform_grad waits for the GPU")

    monkeypatch.setattr(fused_linear_logprobs_ops, "uniform_grad", no_check)
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    _check(x, weight, target, b, torch.float32, chunk_memory_bytes, upstream, grad_in_forward=True)


@pytest.mark.parametrize("ignored", ["none", "all"])
def test_broken_grad_in_forward_promise_gives_nan_where_it_cannot_be_checked(monkeypatch, ignored):
    """Unchecked on the host, a log-probs gradient that differs between tokens makes every
    gradient NaN, loud rather than silently wrong; without a valid token the gradients are 0."""
    _no_host_sync(monkeypatch)
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    if ignored == "all":
        target = torch.full_like(target, -100)
    log_probs = tf.fused_linear_logprobs(
        x, weight, target, b, chunk_memory_bytes=chunk_memory_bytes, grad_in_forward=True,
    )[0]
    log_probs.backward(torch.randn_like(log_probs))
    for tensor in (x, weight, b):
        assert tensor.grad.isnan().all() if ignored == "none" else not tensor.grad.any()


def test_torch_compile_fullgraph():
    x, weight, target, b, chunk_memory_bytes = _problem(CASES[0], torch.float32)

    def step(hidden, weight, target, bias):
        log_probs, entropy, *_ = tf.fused_linear_logprobs(
            hidden * 1.5, weight, target, bias, outputs=("log_probs", "entropy"), chunk_memory_bytes=chunk_memory_bytes,
            **TRANSFORM,
        )
        return log_probs, entropy

    x64, w64, b64 = leaf_copies(x, weight, b)
    compiled = torch.compile(step, fullgraph=True, backend=pick(cpu="aot_eager", gpu="inductor"))
    log_probs, entropy = compiled(x, weight, target, b)
    truth, truth_entropy, *_ = reference.fused_linear_logprobs(
        x64 * 1.5, w64, target, b64, outputs=("log_probs", "entropy"), **TRANSFORM,
    )
    assert_close(log_probs, truth, torch.float32, "log_probs")
    assert_close(entropy, truth_entropy, torch.float32, "entropy")
    grad = torch.randn_like(log_probs)
    (log_probs * grad - entropy).sum().backward()
    (truth * grad.double() - truth_entropy).sum().backward()
    for name, tensor, truth_tensor in (("input", x, x64), ("weight", weight, w64), ("bias", b, b64)):
        assert_close(tensor.grad, truth_tensor.grad, torch.float32, f"grad of {name}")


@pytest.mark.parametrize("chunk_rows, recomputed", [(10, 3), (64, 0)])
def test_backward_recomputes_all_chunks_but_the_last(monkeypatch, chunk_rows, recomputed):
    # The forward's buffer still holds the last chunk's logits: backward starts from them.
    import tigon.ops.fused_linear as fused_linear

    # 37 rows of a 500-token vocabulary on every device: 4 chunks of 10 rows, or one of 37.
    x, weight, target, b, _ = _problem((37, 32, 500, chunk_rows), torch.float32)
    log_probs, *_ = tf.fused_linear_logprobs(x, weight, target, b, chunk_memory_bytes=chunk_rows * 500 * 4)
    calls = []
    real = fused_linear.linear_logits
    monkeypatch.setattr(fused_linear, "linear_logits", lambda *args: calls.append(1) or real(*args))
    (log_probs * torch.randn_like(log_probs)).sum().backward()
    assert len(calls) == recomputed
