"""The GRPO family (tigon.losses.fused_linear_grpo) against the fp64 reference, and the reference
against TRL 1.16's GRPOTrainer._compute_loss itself."""

import collections
import math
import types

import pytest
import torch

import tigon.losses as tl
from tigon.ops import fused_linear_logprobs
from tigon.ops.fused_linear import fused_linear_chunks
from tigon.testing import reference
from utils import DEVICE, MatmulFlops, assert_close, leaf_copies, pick, randn

# (completions B, tokens T, H, V, completions per chunk): several chunks, the last one partial.
CASES = pick(
    cpu=[(4, 11, 32, 300, 3), (3, 7, 48, 433, 1)],
    gpu=[(8, 512, 1024, 32000, 3), (6, 300, 2048, 50000, 4)],
)
# Completions that span many chunks: (B, T, H, V, tokens per chunk).
LONG_CASE = pick(cpu=(3, 37, 24, 211, 5), gpu=(4, 2500, 1024, 32000, 700))
LOSS_TYPES = reference.GRPO_LOSS_TYPES
CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# CISPO caps its ratio at epsilon_high itself (TRL recommends 5); 1.3 makes some tokens cross it.
CISPO_EPSILON_HIGH = 1.3


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _policy_logps(x, weight, bias, ids, temperature, logits_dtype):
    """The policy's per-token log-probs in fp64, to build old and reference log-probs around them."""
    with torch.no_grad():
        logits = reference.head_logits(x.double(), weight.double(), None if bias is None else bias.double(),
                                       logits_dtype)
        return (logits / temperature).log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _away_from(log_ratio, bounds, margin=0.02):
    """``log_ratio`` with every value within ``margin`` of a clip bound's log moved 2.5 margins
    past it: a token on a bound would be clipped or not by the rounding of the log-probs alone."""
    for bound in bounds:
        near = (log_ratio - math.log(bound)).abs() < margin
        log_ratio = torch.where(near, log_ratio + 2.5 * margin, log_ratio)
    return log_ratio


def _problem(case, dtype, *, off_policy=True, with_ref=False, options=None, mask_dtype=torch.bool):
    """Inputs for tigon and the reference. The completions are ragged: the first is full, the
    second empty, the others of random lengths; the padding holds ids outside the vocabulary."""
    n_completions, seq_len, hidden, vocab, per_chunk = case
    options = options or {}
    x = randn(n_completions, seq_len, hidden, dtype=dtype, requires_grad=True)
    # Logits of unit scale, as in the other fused-linear tests.
    weight = randn(vocab, hidden, dtype=dtype, requires_grad=True, scale=hidden**-0.5)
    bias = randn(vocab, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, vocab, (n_completions, seq_len), device=DEVICE)
    lengths = torch.randint(1, seq_len + 1, (n_completions,), device=DEVICE)
    lengths[0], lengths[1] = seq_len, 0
    mask = torch.arange(seq_len, device=DEVICE) < lengths[:, None]
    advantages = randn(n_completions)
    advantages[0], advantages[2] = advantages[0].abs() + 0.1, -advantages[2].abs() - 0.1  # both signs

    logps = _policy_logps(x, weight, bias, ids, options.get("temperature", 1.0), dtype)
    tensors = dict(old_per_token_logps=None, ref_per_token_logps=None)
    if off_policy:
        # Ratios between about 0.5 and 2: many tokens cross 1 − ε_low and 1 + ε_high, and the first
        # token of each completion does (ratio e^±0.5 with the sign of its advantage).
        eps_low, eps_high = options.get("epsilon_low", 0.2), options.get("epsilon_high", 0.2)
        bounds = [eps_high] if options.get("loss_type") == "cispo" else [1 - eps_low, 1 + eps_high]
        bounds += [options["delta"]] if options.get("delta") else []
        log_ratio = _away_from(0.3 * torch.randn_like(logps), bounds)
        log_ratio[:, 0] = 0.5 * advantages.sign()
        tensors["old_per_token_logps"] = (logps - log_ratio).float()
    if with_ref:
        tensors["ref_per_token_logps"] = (logps + 0.2 * torch.randn_like(logps)).float()
    ids = torch.where(mask, ids, vocab)
    chunk_memory_bytes = per_chunk * seq_len * vocab * x.element_size()
    return (x, weight, bias), (ids, mask.to(mask_dtype), advantages), tensors, chunk_memory_bytes


def _token_budget(tokens, vocab, dtype):
    """``chunk_memory_bytes`` for chunks of ``tokens`` rows of logits."""
    return tokens * vocab * torch.finfo(dtype).bits // 8


def _compare(case, dtype, options, *, off_policy=True, with_ref=False, num_items_in_batch=None,
             mask_dtype=torch.bool, chunk_tokens=None):
    """tigon's loss, metrics and the gradients of input, weight and bias against the reference's;
    returns tigon's metrics. Chunks hold ``case``'s completions per chunk, or ``chunk_tokens``."""
    leaves, (ids, mask, advantages), tensors, chunk_memory_bytes = _problem(
        case, dtype, off_policy=off_policy, with_ref=with_ref, options=options, mask_dtype=mask_dtype,
    )
    if chunk_tokens is not None:
        chunk_memory_bytes = _token_budget(chunk_tokens, case[3], dtype)
    truth_leaves = leaf_copies(*leaves)
    loss, metrics = tl.fused_linear_grpo(
        *leaves[:2], ids, mask, advantages, bias=leaves[2], **tensors, num_items_in_batch=num_items_in_batch,
        chunk_memory_bytes=chunk_memory_bytes, **options,
    )
    tensors64 = {name: None if t is None else t.double() for name, t in tensors.items()}
    # The truth is the exact loss of the logits rounded to the dtype (see reference.head_logits).
    truth, truth_metrics = reference.grpo_loss(
        *truth_leaves[:2], ids, mask, advantages.double(), truth_leaves[2], **tensors64,
        num_items_in_batch=num_items_in_batch, logits_dtype=dtype, **options,
    )
    assert loss.dtype == torch.float32 and loss.shape == ()
    # VESPO's φ = exp(λ + k·log w − λ·w) of a completion's summed log-ratio: the rounding of every
    # fp32 log-prob in the sum reaches log φ multiplied by |k − λ·w| (measured 1.9e-5 on the GPU
    # shapes, 300 tokens, V 50000), where the other losses see one token's rounding.
    factor = 4.0 if options["loss_type"] == "vespo" else 1.0
    assert_close(loss, truth, dtype, "loss", factor)
    assert set(metrics) == set(truth_metrics)
    for name, value in metrics.items():
        assert value.dtype == torch.float32 and value.shape == () and not value.requires_grad
        assert_close(value, truth_metrics[name], dtype, name, factor)

    # grad_output ≠ 1 exercises the scaling of the gradients computed in forward.
    (2.5 * loss).backward()
    (2.5 * truth).backward()
    for name, tensor, truth_tensor in zip(("input", "weight", "bias"), leaves, truth_leaves):
        assert tensor.grad.dtype == tensor.dtype and tensor.grad.shape == tensor.shape
        assert_close(tensor.grad, truth_tensor.grad, dtype, f"grad of {name}", factor)
    assert torch.count_nonzero(leaves[0].grad[1]).item() == 0  # the empty completion
    return metrics


def _options(loss_type, **options):
    if loss_type == "cispo":
        options.setdefault("epsilon_high", CISPO_EPSILON_HIGH)
    return dict(loss_type=loss_type, **options)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_off_policy_matches_reference(loss_type, level, case):
    """Old log-probs 0.3 nats off the policy's: ratios cross both clip bounds."""
    metrics = _compare(case, torch.float32, _options(loss_type, importance_sampling_level=level))
    if loss_type in CLIPPED_TYPES and level == "token":
        assert metrics["clip_ratio_low"] > 0 and metrics["clip_ratio_high"] > 0
    if loss_type == "cispo" and level == "token":
        assert metrics["cispo_clip_ratio"] > 0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_matches_reference(loss_type, level):
    """Without old log-probs the ratio is 1, and its gradient is the policy gradient."""
    metrics = _compare(CASES[0], torch.float32, _options(loss_type, importance_sampling_level=level), off_policy=False)
    for name in ("clip_ratio_low", "clip_ratio_high", "cispo_clip_ratio"):
        assert metrics.get(name, 0.0) == 0.0
    assert float(metrics.get("vespo_phi_seq_mean", 1.0)) == pytest.approx(1.0)  # φ(1) = 1


# Each option on the loss types whose formula it changes.
OPTIONS = {
    "kl": (dict(loss_type="dapo", beta=0.04), dict(with_ref=True)),
    "kl_sequence": (dict(loss_type="grpo", beta=0.3, importance_sampling_level="sequence"), dict(with_ref=True)),
    "kl_on_policy": (dict(loss_type="sapo", beta=0.1, sapo_temperature_neg=2.0), dict(with_ref=True, off_policy=False)),
    "delta": (dict(loss_type="bnpo", delta=1.5, epsilon_high=0.28), {}),
    # A cap below 1 + ε_high: TRL counts the capped ratio in its clip metrics.
    "delta_below_clip": (dict(loss_type="luspo", delta=1.1, epsilon_high=0.28, epsilon_low=0.1), {}),
    "num_items_in_batch": (dict(loss_type="dapo"), dict(num_items_in_batch=57)),
    "num_items_cispo": (dict(loss_type="cispo", epsilon_high=CISPO_EPSILON_HIGH), dict(num_items_in_batch=13)),
    "vespo_gamma": (dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0,
                         vespo_lambda_neg=1.0, importance_sampling_level="sequence"), dict(num_items_in_batch=40)),
    "max_completion_length": (dict(loss_type="dr_grpo", max_completion_length=32), dict(mask_dtype=torch.int64)),
    "temperature": (dict(loss_type="grpo", temperature=0.7), dict(mask_dtype=torch.float32)),
    "temperature_kl": (dict(loss_type="dapo", temperature=1.6, beta=0.2), dict(with_ref=True)),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_options_match_reference(name):
    options, kwargs = OPTIONS[name]
    metrics = _compare(CASES[0], torch.float32, options, **kwargs)
    assert ("kl" in metrics) == (options.get("beta", 0.0) != 0.0)


# 16-bit heads: the same comparisons, on a few configurations that cover the formulas.
LOW_PRECISION = {
    "dapo_kl": (dict(loss_type="dapo", beta=0.04), dict(with_ref=True)),
    "gspo": (dict(loss_type="grpo", importance_sampling_level="sequence"), {}),
    "cispo": (dict(loss_type="cispo", epsilon_high=CISPO_EPSILON_HIGH, temperature=0.8), {}),
    "sapo_on_policy": (dict(loss_type="sapo"), dict(off_policy=False)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", LOW_PRECISION)
def test_low_precision_matches_reference(name, dtype):
    options, kwargs = LOW_PRECISION[name]
    _compare(CASES[0], dtype, options, **kwargs)


def test_single_token_completions():
    """Completions of one token, one of them empty: the metrics are still means over active tokens."""
    _compare((4, 1, 32, 300, 2), torch.float32, dict(loss_type="bnpo"), off_policy=False)


def test_module_matches_function():
    leaves, rest, tensors, chunk_memory_bytes = _problem(CASES[0], torch.float32, with_ref=True)
    options = dict(loss_type="bnpo", beta=0.1, delta=1.6, temperature=0.9, chunk_memory_bytes=chunk_memory_bytes)
    module = tl.FusedLinearGRPOLoss(**options)
    loss, metrics = module(*leaves[:2], *rest, bias=leaves[2], **tensors)
    expected, expected_metrics = tl.fused_linear_grpo(*leaves[:2], *rest, bias=leaves[2], **tensors, **options)
    assert torch.equal(loss, expected)
    assert all(torch.equal(value, expected_metrics[name]) for name, value in metrics.items())


def test_frozen_head_and_no_grad():
    (x, weight, _), rest, tensors, chunk_memory_bytes = _problem(CASES[0], torch.float32)
    weight.requires_grad_(False)
    loss, _ = tl.fused_linear_grpo(x, weight, *rest, **tensors, chunk_memory_bytes=chunk_memory_bytes)
    loss.backward()
    assert weight.grad is None and x.grad is not None

    x.grad = None
    with torch.no_grad():
        loss_no_grad, _ = tl.fused_linear_grpo(x, weight, *rest, **tensors, chunk_memory_bytes=chunk_memory_bytes)
    assert not loss_no_grad.requires_grad and x.grad is None
    assert torch.equal(loss_no_grad, loss.detach())


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_long_completions_match_reference(loss_type, level):
    """Completions of several chunks each: split across chunks by the token-level types, two
    passes for GSPO and vespo."""
    _compare(LONG_CASE, torch.float32, _options(loss_type, importance_sampling_level=level, beta=0.04),
             with_ref=True, chunk_tokens=LONG_CASE[4])


# 16-bit heads on long completions: the split chunks and the two passes.
LONG_LOW_PRECISION = {
    "dapo": {"loss_type": "dapo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", LONG_LOW_PRECISION)
def test_long_completions_low_precision_match_reference(name, dtype):
    _compare(LONG_CASE, dtype, LONG_LOW_PRECISION[name], chunk_tokens=LONG_CASE[4])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_chunking_does_not_change_the_loss(loss_type, level):
    """Chunks of a few tokens (splitting completions or in two passes), of one completion, or the
    whole batch in one: the same loss and gradients, to rounding."""
    (x, weight, bias), rest, tensors, _ = _problem(
        LONG_CASE, torch.float32, with_ref=True, options={"loss_type": loss_type},
    )
    n_completions, seq_len, _, vocab, chunk_tokens = LONG_CASE
    results = []
    for tokens in (chunk_tokens, seq_len, n_completions * seq_len):
        leaves = leaf_copies(x, weight, bias, dtype=torch.float32)
        loss, _ = tl.fused_linear_grpo(*leaves[:2], *rest, bias=leaves[2], **tensors, beta=0.1,
                                       **_options(loss_type, importance_sampling_level=level),
                                       chunk_memory_bytes=_token_budget(tokens, vocab, torch.float32))
        loss.backward()
        results.append([loss, *(leaf.grad for leaf in leaves)])
    for result in results[:-1]:
        for name, one, whole in zip(("loss", "input", "weight", "bias"), result, results[-1]):
            assert_close(one, whole, torch.float32, name)


@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("grpo", "sequence"), ("vespo", "token")])
def test_chunk_logits_stay_within_budget(loss_type, level, monkeypatch):
    """However long the completions, no logits buffer exceeds ``chunk_memory_bytes``. The
    token-level types split completions in one pass (``6·N·H·V`` matmul FLOPs); GSPO and vespo
    take two, recomputing every chunk's logits but the last."""
    (x, weight, _), rest, tensors, _ = _problem(LONG_CASE, torch.float32, options={"loss_type": loss_type})
    n_completions, seq_len, hidden, vocab, chunk_tokens = LONG_CASE
    budget = _token_budget(chunk_tokens, vocab, torch.float32)
    buffer_bytes = []

    def recording_chunks(x2d, weight, bias, chunks, head, *args, **kwargs):
        def recording_head(ranges, logits):
            buffer_bytes.append(logits.untyped_storage().nbytes())
            return head(ranges, logits)

        return fused_linear_chunks(x2d, weight, bias, chunks, recording_head, *args, **kwargs)

    monkeypatch.setattr(fused_linear_logprobs, "fused_linear_chunks", recording_chunks)
    with MatmulFlops() as counter:
        loss, _ = tl.fused_linear_grpo(x, weight, *rest, **tensors, chunk_memory_bytes=budget,
                                       **_options(loss_type, importance_sampling_level=level))
    assert max(buffer_bytes) <= budget
    n_rows = n_completions * seq_len
    one_pass = 6 * n_rows * hidden * vocab
    last_chunk_rows = n_rows - (math.ceil(n_rows / chunk_tokens) - 1) * chunk_tokens
    recomputed = 2 * (n_rows - last_chunk_rows) * hidden * vocab
    assert counter.flops == (one_pass if level == "token" and loss_type != "vespo" else one_pass + recomputed)

    with torch.no_grad():
        loss_no_grad, _ = tl.fused_linear_grpo(x, weight, *rest, **tensors, chunk_memory_bytes=budget,
                                               **_options(loss_type, importance_sampling_level=level))
    assert torch.equal(loss_no_grad, loss.detach())


def test_bad_input_is_named():
    (x, weight, bias), (ids, mask, advantages), tensors, _ = _problem(CASES[0], torch.float32, with_ref=True)
    old, ref = tensors["old_per_token_logps"], tensors["ref_per_token_logps"]
    n_completions, seq_len = ids.shape
    with pytest.raises(ValueError, match="loss_type must be one of"):
        tl.fused_linear_grpo(x, weight, ids, mask, advantages, loss_type="ppo")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        tl.FusedLinearGRPOLoss(loss_type="reinforce")
    with pytest.raises(ValueError, match="importance_sampling_level must be one of"):
        tl.fused_linear_grpo(x, weight, ids, mask, advantages, importance_sampling_level="sentence")
    with pytest.raises(ValueError, match="ref_per_token_logps is required"):
        tl.fused_linear_grpo(x, weight, ids, mask, advantages, old_per_token_logps=old, beta=0.1)
    with pytest.raises(ValueError, match="weight must have shape"):
        tl.fused_linear_grpo(x, weight[:, :-1], ids, mask, advantages)
    with pytest.raises(ValueError, match="bias must have shape"):
        tl.fused_linear_grpo(x, weight, ids, mask, advantages, bias=bias[:-1])
    with pytest.raises(ValueError, match=rf"completion_ids must have shape \({n_completions}, {seq_len}\)"):
        tl.fused_linear_grpo(x, weight, ids[:, :-1], mask, advantages)
    with pytest.raises(ValueError, match="completion_mask must have shape"):
        tl.fused_linear_grpo(x, weight, ids, mask[:-1], advantages)
    with pytest.raises(ValueError, match="advantages must have shape"):
        tl.fused_linear_grpo(x, weight, ids, mask, advantages[:-1])
    with pytest.raises(ValueError, match="old_per_token_logps must have shape"):
        tl.fused_linear_grpo(x, weight, ids, mask, advantages, old_per_token_logps=old[:, :-1])
    with pytest.raises(ValueError, match="ref_per_token_logps must have shape"):
        tl.fused_linear_grpo(x, weight, ids, mask, advantages, ref_per_token_logps=ref[1:], beta=0.1)
    with pytest.raises(TypeError, match="completion_ids has dtype"):
        tl.fused_linear_grpo(x, weight, ids.float(), mask, advantages)
    ids[0, 0] = weight.shape[0]  # out of the vocabulary at an active token
    # The user's argument, the value and the valid range, not the internal "target".
    vocab = weight.shape[0]
    with pytest.raises(ValueError, match=rf"^completion_ids contains {vocab}, outside \[0, V\) for the vocabulary "
                                         rf"size V = {vocab}$"):
        tl.fused_linear_grpo(x, weight, ids, mask, advantages)
    ids[0, 0] = -100  # the internal ignore_index at an active token is out of range too, not ignored
    with pytest.raises(ValueError, match=r"^completion_ids contains -100, outside"):
        tl.fused_linear_grpo(x, weight, ids, mask, advantages)


def test_optional_tensors_are_keyword_only():
    """old and ref log-probs share a shape, and Liger takes them as (..., bias, ref, old): given by
    position they would silently swap, so they (and bias, num_items_in_batch) are keyword-only."""
    (x, weight, bias), rest, tensors, _ = _problem(CASES[0], torch.float32, with_ref=True)
    old, ref = tensors["old_per_token_logps"], tensors["ref_per_token_logps"]
    with pytest.raises(TypeError, match="positional argument"):
        tl.fused_linear_grpo(x, weight, *rest, bias, ref, old, beta=0.1)
    with pytest.raises(TypeError, match="positional argument"):
        tl.FusedLinearGRPOLoss(beta=0.1)(x, weight, *rest, bias, ref, old)
    with pytest.raises(TypeError, match="positional argument"):
        tl.FusedLinearGRPOLoss(0.1)


def test_log_probs_by_position_name_the_keywords():
    """Called as Liger's module is, (..., advantages, bias, ref, old) by position: the error names
    the public class, what it takes by position and the keywords the rest go by."""
    (x, weight, bias), rest, tensors, _ = _problem(CASES[0], torch.float32, with_ref=True)
    extra = (bias, tensors["ref_per_token_logps"], tensors["old_per_token_logps"])
    with pytest.raises(TypeError, match=(
        r"^FusedLinearGRPOLoss takes 5 positional arguments \(input, weight, completion_ids, completion_mask, "
        r"advantages\) but 8 were given; the others go by keyword: bias=, old_per_token_logps=, "
        r"ref_per_token_logps=, num_items_in_batch=, process_group="
    )):
        tl.FusedLinearGRPOLoss(beta=0.1)(x, weight, *rest, *extra)


def test_swapped_input_and_weight_are_named():
    (x, weight, _), rest, _, _ = _problem(CASES[0], torch.float32)
    with pytest.raises(ValueError, match=r"look swapped.*Did you pass \(weight, input\)\? tigon takes "
                                         r"\(input, weight, completion_ids\)"):
        tl.fused_linear_grpo(weight, x, *rest)


def test_constants_that_require_grad_are_refused():
    """The mask, advantages, old and reference log-probs, the token count and the options are
    constants of the loss (TRL computes them without grad): asked for their gradient, the loss
    refuses at the call instead of silently giving none."""
    (x, weight, bias), (ids, mask, advantages), tensors, _ = _problem(
        CASES[0], torch.float32, with_ref=True, mask_dtype=torch.float32,
    )
    inputs = dict(input=x, weight=weight, completion_ids=ids, completion_mask=mask, advantages=advantages, bias=bias,
                  **tensors, num_items_in_batch=torch.tensor(20.0, device=DEVICE), beta=0.1)
    reasons = {
        "completion_mask": "the mask selects tokens and is not differentiated",
        "advantages": "advantages are constants of the policy-gradient loss",
        "old_per_token_logps": "the sampling policy's log-probs are constants of the ratio",
        "ref_per_token_logps": "the reference model's log-probs are constants of the KL",
        "num_items_in_batch": "it is a count of tokens",
        "beta": "it is read as a plain number",
        "temperature": "it is read as a plain number",
    }
    for name, reason in reasons.items():
        value = inputs.get(name, 1.0)
        leaf = torch.as_tensor(value, device=DEVICE).detach().clone().requires_grad_()
        with pytest.raises(ValueError, match=rf"^{name} requires grad, but {reason}; tigon computes no gradient"):
            tl.fused_linear_grpo(**dict(inputs, **{name: leaf}))

    # Without grad mode nothing is differentiated, and nothing is refused.
    loss, _ = tl.fused_linear_grpo(**inputs)
    with torch.no_grad():
        leaves = {name: inputs[name].detach().clone().requires_grad_() for name in list(reasons)[:5]}
        assert torch.equal(tl.fused_linear_grpo(**dict(inputs, **leaves))[0], loss.detach())


# --- The reference is TRL's formula --------------------------------------------------------------
# TRL's own _compute_loss, run on a stand-in trainer whose model returns given log-probs: one process,
# no gradient accumulation, none of its optional masks.


def _trl_loss(per_token_logps, entropy, mask, advantages, old, ref, num_items_in_batch, options):
    from trl.trainer.grpo_trainer import GRPOTrainer

    args = types.SimpleNamespace(
        use_bias_correction_kl=False, delta=options.get("delta"), sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
        vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, steps_per_generation=1,
    )
    accelerator = types.SimpleNamespace(
        num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t, gather_for_metrics=lambda t: t,
    )
    trainer = types.SimpleNamespace(
        args=args, accelerator=accelerator, model=types.SimpleNamespace(training=True),
        beta=options.get("beta", 0.0), loss_type=options["loss_type"], epsilon_low=options.get("epsilon_low", 0.2),
        epsilon_high=options.get("epsilon_high", 0.2), importance_sampling_level=options["importance_sampling_level"],
        max_completion_length=options["max_completion_length"], top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list)}, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (per_token_logps, entropy, None),
    )
    n_completions, seq_len = mask.shape
    inputs = dict(
        prompt_ids=torch.zeros(n_completions, 1, dtype=torch.long), prompt_mask=torch.ones(n_completions, 1),
        completion_ids=torch.zeros(n_completions, seq_len, dtype=torch.long), completion_mask=mask,
        advantages=advantages, old_per_token_logps=old, ref_per_token_logps=ref,
        num_items_in_batch=torch.tensor(float(num_items_in_batch)),
    )
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    names = {"clip_ratio/low_mean": "clip_ratio_low", "clip_ratio/high_mean": "clip_ratio_high",
             "clip_ratio/region_mean": "clip_ratio_region", "vespo/phi_seq_mean": "vespo_phi_seq_mean"}
    logged = trainer._metrics["train"]
    return loss, {names.get(name, name): value[0] for name, value in logged.items() if "/" not in name or name in names}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", reference.GRPO_LOSS_TYPES)
def test_reference_is_trl(loss_type, level):
    """Loss, gradient and logged metrics of the reference and of TRL, on- and off-policy, with KL
    and delta, with num_items_in_batch, over ragged masks with an empty completion."""
    torch.manual_seed(1)
    n_completions, seq_len, vocab = 4, 9, 11
    log_p = torch.randn(n_completions, seq_len, vocab, dtype=torch.float64).log_softmax(-1)
    logps = log_p[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    mask = (torch.arange(seq_len) < torch.tensor([[seq_len], [5], [0], [7]])).long()
    advantages = torch.randn(n_completions, dtype=torch.float64)
    old = logps + 0.3 * torch.randn_like(logps)
    ref = logps + 0.2 * torch.randn_like(logps)
    for old_logps in (None, old):
        for options in (dict(), dict(beta=0.1, delta=1.1, epsilon_high=0.28), dict(num_items_in_batch=17)):
            options = dict(options, loss_type=loss_type, importance_sampling_level=level, max_completion_length=12)
            if loss_type == "cispo":
                options["epsilon_high"] = CISPO_EPSILON_HIGH
            num_items_in_batch = options.pop("num_items_in_batch", None)
            trl_logps, our_logps = logps.clone().requires_grad_(), logps.clone().requires_grad_()
            trl_loss, trl_metrics = _trl_loss(trl_logps, entropy, mask, advantages.unsqueeze(1), old_logps, ref,
                                              num_items_in_batch or mask.sum(), options)
            loss, metrics = reference.grpo_loss_from_logps(
                our_logps, mask, advantages, old_logps, ref, num_items_in_batch, entropy=entropy, **options,
            )
            trl_loss.backward()
            loss.backward()
            # TRL picks SAPO's temperatures with torch.where over two Python floats: in float32.
            tolerance = 1e-7 if loss_type == "sapo" else 1e-12
            torch.testing.assert_close(loss, trl_loss, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(our_logps.grad, trl_logps.grad, rtol=tolerance, atol=tolerance)
            assert set(metrics) == set(trl_metrics)
            for name, value in metrics.items():
                # TRL logs Python floats of float32 means.
                assert value.item() == pytest.approx(trl_metrics[name], rel=1e-6, abs=1e-7), name
