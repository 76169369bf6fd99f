"""TRL's fused LM head with tigon's kernel behind it: the same outputs and gradients as TRL's own,
for what ``add_fused_lm_head`` supports (temperature, Gemma's final softcap, a logit scale, PEFT),
the gather of a ZeRO-3 weight in a recomputing backward, and the mode the head learns."""

import copy

import pytest
import torch
import trl.trainer.utils as trl_utils
from peft import LoraConfig, get_peft_model
from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM

import tigon.ops.cross_entropy as cross_entropy_ops
import tigon.ops.fused_linear as fused_linear
import tigon.ops.fused_linear_logprobs as fused_linear_logprobs_ops
import tigon.trl as tigon_trl
from tigon.trl import TigonLogProbHead, is_patched, patch_trl, unpatch_trl
from utils import DEVICE, needs_trl_fused_head

pytestmark = needs_trl_fused_head()

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
SMALL = dict(
    vocab_size=301, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8,
)


def _model(kind):
    torch.manual_seed(0)
    if kind == "gemma2_softcap":
        model = Gemma2ForCausalLM(Gemma2Config(**SMALL, final_logit_softcapping=5.0, attn_implementation="eager"))
    elif kind == "granite_logit_scale":
        model = GraniteForCausalLM(GraniteConfig(**SMALL, logits_scaling=0.25))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMALL))
    return model.to(DEVICE)


def _batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, SMALL["vocab_size"], (2, 13), generator=generator)
    labels = input_ids.clone()
    labels[0, :4] = -100
    return input_ids.to(DEVICE), labels.to(DEVICE)


def _run(model, patched, loss_kind, temperature=1.0, peft=False):
    """The head's fields, the loss and every trainable parameter's gradient."""
    model = copy.deepcopy(model)
    trl_utils.add_fused_lm_head(model, temperature=temperature, outputs=FIELDS)
    if peft:
        torch.manual_seed(2)  # the same LoRA A in both runs
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    patch_trl() if patched else unpatch_trl()
    input_ids, labels = _batch()
    out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    if loss_kind == "mean":  # SFT's NLL
        loss = out.loss
    else:  # a GRPO-like loss: one weight per token, and an entropy bonus
        weights = torch.linspace(-1.0, 2.0, out.log_probs.numel(), device=DEVICE).view_as(out.log_probs)
        loss = -(out.log_probs * weights).sum() / 10 - 0.01 * out.entropy.sum()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return out, loss, grads


@pytest.mark.parametrize("kind", ["llama", "gemma2_softcap", "granite_logit_scale"])
@pytest.mark.parametrize("loss_kind", ["mean", "per_token"])
@pytest.mark.parametrize("peft", [False, True])
def test_tigon_head_matches_trl_head(kind, loss_kind, peft):
    model = _model(kind)
    temperature = 0.7 if loss_kind == "per_token" else 1.0
    plain, plain_loss, plain_grads = _run(model, False, loss_kind, temperature, peft)
    patched, patched_loss, patched_grads = _run(model, True, loss_kind, temperature, peft)
    torch.testing.assert_close(patched_loss, plain_loss, rtol=1e-5, atol=1e-5)
    for name in FIELDS[:4]:
        torch.testing.assert_close(getattr(patched, name), getattr(plain, name), rtol=1e-5, atol=1e-5)
    assert torch.equal(patched.is_top1, plain.is_top1)
    assert patched_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(patched_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_patch_and_unpatch():
    original = trl_utils._ChunkedLogProbFunction
    patch_trl()
    assert is_patched() and trl_utils._ChunkedLogProbFunction is TigonLogProbHead
    unpatch_trl()
    assert not is_patched() and trl_utils._ChunkedLogProbFunction is original


def test_the_head_learns_to_recompute_and_gathers_the_weight_then(monkeypatch):
    # Every backward that recomputes reads the weight again: under ZeRO-3, TRL's
    # maybe_gather_lm_head_ctx gathers it, as TRL's own head does in its backward.
    gathered = []

    class Recorder:
        def __enter__(self):
            gathered.append(True)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(trl_utils, "maybe_gather_lm_head_ctx", lambda *params: Recorder())
    # Chunks of 8 rows: with a single chunk there is nothing to recompute, whatever the loss.
    monkeypatch.setattr(fused_linear, "DEFAULT_CHUNK_MEMORY_BYTES", 8 * SMALL["vocab_size"] * 4)
    model = _model("llama")
    trl_utils.add_fused_lm_head(model, outputs=FIELDS)
    patch_trl()
    input_ids, labels = _batch()
    labels = input_ids.clone()  # every row labelled: the mean's gradient is the same for each
    for step, loss_kind in enumerate(["mean", "mean", "per_token", "mean"]):
        gathered.clear()
        # The forward reads the weight inside TRL's own gather (1 entry, TRL's call).
        out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
        forward_gathers = len(gathered)
        loss = out.loss if loss_kind == "mean" else -(out.log_probs * torch.rand_like(out.log_probs)).sum()
        loss.backward()
        recomputed = len(gathered) > forward_gathers
        # Steps 0-1: a mean, served by the forward's gradients. Step 2 breaks the promise: its
        # backward recomputes, and from then on the head recomputes even for a mean.
        assert recomputed == (step >= 2), step
        assert TigonLogProbHead.grad_in_forward == (step < 2), step


@pytest.mark.parametrize("loss_kind", ["mean", "per_token"])
def test_the_head_reads_nothing_on_the_host_where_syncs_are_forbidden(monkeypatch, loss_kind):
    """Under CUDA-graph capture (or torch.compile) the head does not read the log-probs' gradient
    on the host to learn: it keeps its guess, and the op checks it on the device. A mean's
    gradients are exact; a per-token gradient, which breaks the promise, turns them into NaN."""
    from test_cuda_graphs import TigonHostReads

    for module in (cross_entropy_ops, fused_linear_logprobs_ops, tigon_trl):
        monkeypatch.setattr(module, "host_sync_allowed", lambda tensor: False)
    vocab, n_rows, hidden_size = SMALL["vocab_size"], 26, SMALL["hidden_size"]
    # Chunks of 8 rows: with a single chunk the head computes no gradient in forward.
    monkeypatch.setattr(fused_linear, "DEFAULT_CHUNK_MEMORY_BYTES", 8 * vocab * 4)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(n_rows, hidden_size, generator=generator).to(DEVICE).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * hidden_size**-0.5).to(DEVICE).requires_grad_()
    targets = torch.randint(0, vocab, (n_rows,), generator=generator).to(DEVICE)
    targets[:4] = -100
    valid = targets != -100
    if loss_kind == "mean":
        token_weights = torch.full((n_rows,), -1.0 / n_rows, device=DEVICE)
    else:
        token_weights = torch.linspace(-1.0, 2.0, n_rows, device=DEVICE)
    patch_trl()
    reads = TigonHostReads()
    reads.watch_tolist(monkeypatch)
    with reads:
        log_probs = TigonLogProbHead.apply(hidden, weight, None, targets, 1.0, 64)[0]
        (log_probs * token_weights).sum().backward()
    assert not reads.places, f"host reads of tensor values by tigon at {reads.places}"
    assert TigonLogProbHead.grad_in_forward  # nothing learned without a host read
    if loss_kind == "per_token":
        assert hidden.grad.isnan().all() and weight.grad.isnan().all()
        return
    hidden64, weight64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    truth = torch.log_softmax(hidden64 @ weight64.t(), dim=-1).gather(1, targets.clamp(min=0).unsqueeze(1))
    (truth.squeeze(1) * valid * token_weights.double()).sum().backward()
    torch.testing.assert_close(hidden.grad, hidden64.grad.float(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad, weight64.grad.float(), rtol=1e-4, atol=1e-6)
