import pytest
import torch

from tigon.testing import reference
import tigon.losses as tl
from utils import DEVICE, assert_close, leaf_copies, pick, randn

# (pairs B, tokens T, H, V, pairs per chunk): several chunks with a partial last one, and B = 1.
CASES = pick(
    cpu=[(3, 13, 32, 300, 2), (1, 9, 48, 517, 1)],
    gpu=[(4, 512, 1024, 32000, 1), (3, 256, 2048, 50000, 2)],
)
DTYPES = (torch.float32, torch.bfloat16)
# name → (tigon function, reference, options, uses a reference model)
LOSSES = {
    "dpo": (tl.fused_linear_dpo, reference.dpo_loss, dict(beta=0.1), True),
    "dpo_nll": (tl.fused_linear_dpo, reference.dpo_loss, dict(beta=0.5, compute_nll_loss=True), True),
    "cpo": (tl.fused_linear_cpo, reference.cpo_loss, dict(beta=0.1, alpha=0.7, label_smoothing=0.1), False),
    "simpo": (tl.fused_linear_simpo, reference.simpo_loss, dict(beta=2.0, gamma=0.5, label_smoothing=0.2), False),
    "orpo": (tl.fused_linear_orpo, reference.orpo_loss, dict(beta=0.2), False),
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _problem(case, dtype, bias=True, reference_model=False, prompt_tokens=3):
    n_pairs, seq_len, hidden, vocab, pairs_per_chunk = case
    n_sequences = 2 * n_pairs
    x = randn(n_sequences, seq_len, hidden, dtype=dtype, requires_grad=True)
    # Logits of unit scale, as in the fused linear cross entropy tests.
    weight = randn(vocab, hidden, dtype=dtype, requires_grad=True, scale=hidden**-0.5)
    b = randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    target = torch.randint(0, vocab, (n_sequences, seq_len), device=DEVICE)
    target[:, :prompt_tokens] = -100
    target[-1, -2:] = -100
    ref = {}
    if reference_model:
        ref = dict(
            ref_input=randn(n_sequences, seq_len, hidden, dtype=dtype),
            ref_weight=randn(vocab, hidden, dtype=dtype, scale=hidden**-0.5),
            ref_bias=randn(vocab, dtype=dtype) if bias else None,
        )
    chunk_memory_bytes = pairs_per_chunk * 2 * seq_len * vocab * x.element_size()
    return x, weight, target, b, ref, chunk_memory_bytes


def _check_grads(dtype, pairs):
    for name, tensor, truth in pairs:
        if tensor is None:
            continue
        assert tensor.grad.dtype == tensor.dtype and tensor.grad.shape == tensor.shape
        # The bias gradient sums dlogits over rows whose factors have opposite signs (chosen and
        # rejected): the sum cancels, so the rounding of the 16-bit dlogits weighs twice as much.
        assert_close(tensor.grad, truth.grad, dtype, f"grad of {name}", 2.0 if name == "bias" else 1.0)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_name", LOSSES)
def test_matches_reference(loss_name, dtype, case):
    fn, reference_fn, options, uses_reference = LOSSES[loss_name]
    x, weight, target, b, ref, chunk_memory_bytes = _problem(case, dtype, reference_model=uses_reference)
    x64, w64, b64 = leaf_copies(x, weight, b)
    ref64 = {name: None if t is None else t.double() for name, t in ref.items()}

    loss, metrics = fn(x, weight, target, bias=b, **ref, chunk_memory_bytes=chunk_memory_bytes, **options)
    truth, truth_logps = reference_fn(x64, w64, target, b64, **ref64, **options, logits_dtype=dtype)
    assert loss.dtype == torch.float32 and loss.shape == ()
    # The truth is the exact loss of the logits rounded to the dtype (see reference.head_logits).
    assert_close(loss, truth, dtype, "loss")
    chosen, rejected = truth_logps.chunk(2)
    if loss_name in ("simpo", "orpo"):
        n_tokens = (target != -100).sum(-1).clamp(min=1)
        chosen, rejected = (truth_logps / n_tokens).chunk(2)
    assert_close(metrics["chosen_logps"], chosen, dtype, "chosen_logps")
    assert_close(metrics["rejected_logps"], rejected, dtype, "rejected_logps")
    assert all(not value.requires_grad for value in metrics.values())

    # grad_output ≠ 1 exercises the in-place scaling of the gradients computed in forward.
    (2.5 * loss).backward()
    (2.5 * truth).backward()
    _check_grads(dtype, (("input", x, x64), ("weight", weight, w64), ("bias", b, b64)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kto_matches_reference(dtype):
    case = CASES[0]
    x, weight, target, b, ref, chunk_memory_bytes = _problem(case, dtype, reference_model=True)
    labels = torch.arange(x.shape[0], device=DEVICE) % 3 != 1
    kl = torch.tensor(0.3, device=DEVICE)
    x64, w64, b64 = leaf_copies(x, weight, b)
    ref64 = {name: None if t is None else t.double() for name, t in ref.items()}
    # One sequence per chunk: KTO's chunks hold sequences, not pairs.
    chunk_memory_bytes //= 2

    loss, metrics = tl.FusedLinearKTOLoss(beta=0.5, desirable_weight=1.3, chunk_memory_bytes=chunk_memory_bytes)(
        x, weight, target, labels, bias=b, **ref, kl=kl,
    )
    truth, truth_logps = reference.kto_loss(
        x64, w64, target, labels, b64, **ref64, kl=kl.double(), beta=0.5, desirable_weight=1.3, logits_dtype=dtype,
    )
    assert_close(loss, truth, dtype, "loss")
    assert_close(metrics["logps"], truth_logps, dtype, "logps")
    loss.backward()
    truth.backward()
    _check_grads(dtype, (("input", x, x64), ("weight", weight, w64), ("bias", b, b64)))


@pytest.mark.parametrize("loss_name", ["dpo", "simpo"])
def test_fully_masked_sequence(loss_name):
    """A sequence without any unmasked token has log-prob 0 (and SimPO's average 0, not NaN)."""
    fn, reference_fn, options, _ = LOSSES[loss_name]
    x, weight, target, b, _, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    target[1] = -100
    x64, w64, b64 = leaf_copies(x, weight, b)
    loss, metrics = fn(x, weight, target, bias=b, chunk_memory_bytes=chunk_memory_bytes, **options)
    truth, _ = reference_fn(x64, w64, target, b64, **options, logits_dtype=torch.float32)
    assert metrics["chosen_logps"][1].item() == 0.0
    assert_close(loss, truth, torch.float32, "loss")
    loss.backward()
    truth.backward()
    _check_grads(torch.float32, (("input", x, x64), ("weight", weight, w64), ("bias", b, b64)))
    assert torch.count_nonzero(x.grad[1]).item() == 0


def test_frozen_head_and_no_grad():
    x, weight, target, _, _, chunk_memory_bytes = _problem(CASES[0], torch.float32, bias=False)
    weight.requires_grad_(False)
    loss, _ = tl.fused_linear_dpo(x, weight, target, chunk_memory_bytes=chunk_memory_bytes)
    loss.backward()
    assert weight.grad is None and x.grad is not None

    x.grad = None
    with torch.no_grad():
        loss_no_grad, _ = tl.fused_linear_dpo(x, weight, target, chunk_memory_bytes=chunk_memory_bytes)
    assert not loss_no_grad.requires_grad and x.grad is None
    assert torch.allclose(loss_no_grad, loss.detach())


def test_sequence_logps_matches_reference():
    x, weight, target, b, _, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    with torch.no_grad():
        logps = tl.fused_linear_sequence_logps(x, weight, target, bias=b, chunk_memory_bytes=chunk_memory_bytes // 3)
    assert not logps.requires_grad
    truth = reference.sequence_logps(*leaf_copies(x, weight), target, b.double(), logits_dtype=x.dtype)
    assert_close(logps, truth, torch.float32, "logps")


def test_strided_target():
    """A target read through a stride (every other token of a wider one) gives the same loss."""
    x, weight, target, b, ref, chunk_memory_bytes = _problem(CASES[0], torch.float32, reference_model=True)
    strided = torch.stack((target, torch.zeros_like(target)), -1)[..., 0]
    assert not strided.is_contiguous()
    losses = [
        tl.fused_linear_dpo(x, weight, t, bias=b, **ref, chunk_memory_bytes=chunk_memory_bytes)[0] for t in (target, strided)
    ]
    assert torch.equal(*losses)


def test_bad_input_is_named():
    x, weight, target, b, ref, _ = _problem(CASES[0], torch.float32, reference_model=True)
    vocab = weight.shape[0]
    with pytest.raises(ValueError, match="even number"):
        tl.fused_linear_dpo(x[:-1], weight, target[:-1])
    with pytest.raises(ValueError, match="target must have shape"):
        tl.fused_linear_dpo(x, weight, target[:, :-1])
    with pytest.raises(ValueError, match="ref_input and ref_weight must be given together"):
        tl.fused_linear_dpo(x, weight, target, ref_input=ref["ref_input"])
    with pytest.raises(ValueError, match=f"ref_weight has {vocab - 1} rows"):
        tl.fused_linear_dpo(x, weight, target, ref_input=ref["ref_input"], ref_weight=ref["ref_weight"][:-1])
    with pytest.raises(ValueError, match="weight must have shape"):
        tl.fused_linear_dpo(x, weight[:, :-1], target)
    with pytest.raises(ValueError, match="CPO uses no reference model"):
        tl.fused_linear_cpo(x, weight, target, ref_input=ref["ref_input"], ref_weight=ref["ref_weight"])
    with pytest.raises(TypeError, match="target has dtype"):
        tl.fused_linear_dpo(x, weight, target.float())
    with pytest.raises(ValueError, match="preference_labels must have shape"):
        tl.fused_linear_kto(x, weight, target, torch.ones(3, dtype=torch.bool, device=DEVICE))
    target[0, 5] = vocab
    with pytest.raises(ValueError, match=f"target contains {vocab}"):
        tl.fused_linear_dpo(x, weight, target)


def test_optional_tensors_are_keyword_only():
    # bias and ref_bias share a shape: given by position they could land on each other unnoticed.
    x, weight, target, b, ref, _ = _problem(CASES[0], torch.float32, reference_model=True)
    labels = torch.arange(x.shape[0], device=DEVICE) % 2 == 0
    with pytest.raises(TypeError, match="positional argument"):
        tl.fused_linear_dpo(x, weight, target, b, ref["ref_input"], ref["ref_weight"])
    with pytest.raises(TypeError, match="positional argument"):
        tl.FusedLinearDPOLoss()(x, weight, target, b)
    with pytest.raises(TypeError, match="positional argument"):
        tl.fused_linear_kto(x, weight, target, labels, b)
    with pytest.raises(TypeError, match="positional argument"):
        tl.FusedLinearDPOLoss(0.1)


@pytest.mark.parametrize("loss_class", [tl.FusedLinearDPOLoss, tl.FusedLinearCPOLoss, tl.FusedLinearSimPOLoss,
                                        tl.FusedLinearORPOLoss, tl.FusedLinearKTOLoss])
def test_reference_tensors_by_position_name_the_keywords(loss_class):
    """Called as Liger's modules are, the reference model's tensors by position: the error names
    the public class, what it takes by position and the keywords, not a private forward."""
    x, weight, target, b, ref, _ = _problem(CASES[0], torch.float32, reference_model=True)
    labels = torch.arange(x.shape[0], device=DEVICE) % 2 == 0
    main = (x, weight, target, labels) if loss_class is tl.FusedLinearKTOLoss else (x, weight, target)
    positional = "input, weight, target, preference_labels" if len(main) == 4 else "input, weight, target"
    extra = (b, ref["ref_input"], ref["ref_weight"], ref["ref_bias"])
    message = (rf"^{loss_class.__name__} takes {len(main)} positional arguments \({positional}\) but "
               rf"{len(main) + 4} were given; the others go by keyword: bias=, ref_input=, ref_weight=, ref_bias=")
    with pytest.raises(TypeError, match=message):
        loss_class()(*main, *extra)


def test_swapped_input_and_weight_are_named():
    # Liger's preference losses take (lin_weight, _input, target).
    x, weight, target, _, _, _ = _problem(CASES[0], torch.float32)
    with pytest.raises(ValueError, match=r"look swapped.*Did you pass \(weight, input\)\?"):
        tl.fused_linear_dpo(weight, x, target)


def test_constants_that_require_grad_are_refused():
    """The reference model, KTO's KL baseline and the options are constants of the losses: asked
    for their gradient, the losses refuse at the call instead of silently giving none."""
    x, weight, target, b, ref, _ = _problem(CASES[0], torch.float32, reference_model=True)
    labels = torch.arange(x.shape[0], device=DEVICE) % 2 == 0
    for name in ("ref_input", "ref_weight", "ref_bias"):
        leaf = dict(ref, **{name: ref[name].detach().requires_grad_()})
        message = (rf"{name} requires grad, but the reference model is fixed: its log-probs are constants of the "
                   rf"loss; tigon computes no gradient for it: pass {name}\.detach\(\)")
        with pytest.raises(ValueError, match=message):
            tl.fused_linear_dpo(x, weight, target, bias=b, **leaf)
        with pytest.raises(ValueError, match=message):
            tl.fused_linear_kto(x, weight, target, labels, bias=b, **leaf)
    kl = torch.tensor(0.2, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match=r"kl requires grad, but KTO's KL baseline is a constant of the loss"):
        tl.fused_linear_kto(x, weight, target, labels, bias=b, **ref, kl=kl)
    with pytest.raises(ValueError, match=r"beta requires grad, but it is read as a plain number"):
        tl.fused_linear_simpo(x, weight, target, bias=b, beta=kl)
    with pytest.raises(ValueError, match=r"input requires grad, but fused_linear_sequence_logps computes constants "
                                         r".*: call it under torch\.no_grad\(\) or pass input\.detach\(\)"):
        tl.fused_linear_sequence_logps(x, weight, target)

    # Detached, or without grad mode, they are taken as the constants they are.
    loss, _ = tl.fused_linear_kto(x, weight, target, labels, bias=b, **ref, kl=kl.detach())
    with torch.no_grad():
        assert torch.equal(tl.fused_linear_kto(x, weight, target, labels, bias=b, **ref, kl=kl)[0], loss.detach())
