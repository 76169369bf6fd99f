"""The generic causal-LM loss path keeps Hugging Face's semantics option by option."""

import pytest
import torch

import tigon.functional
from tigon.transformers import apply_tigon, apply_tigon_to_llama
from tiny_models import SEQ, tiny_batch, tiny_model
from utils import DEVICE, pick, relative_error

TOLERANCE = 1e-5


def loss_and_grads(model, **inputs):
    model.train()
    model.zero_grad(set_to_none=True)
    output = model(**inputs)
    output.loss.backward()
    return output, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_matches_plain(model_type="llama", flags=None, plain_options=None, **inputs):
    """Runs ``inputs`` through the plain model and through a patched copy (built from the same
    seed); the patched output is returned for further checks."""
    truth, truth_grads = loss_and_grads(tiny_model(model_type, **(plain_options or {})), **inputs)
    patched = apply_tigon(tiny_model(model_type, **(plain_options or {})), **(flags or {}))
    output, grads = loss_and_grads(patched, **inputs)
    assert relative_error(output.loss, truth.loss) <= TOLERANCE
    assert grads.keys() == truth_grads.keys()
    for name, grad in truth_grads.items():
        assert relative_error(grads[name], grad) <= TOLERANCE, f"grad of {name}"
    return output


def test_training_with_labels_builds_no_logits():
    input_ids, labels = tiny_batch()
    output = assert_matches_plain(input_ids=input_ids, labels=labels)
    assert output.logits is None


def test_ignore_index_everywhere_but_a_few_positions():
    input_ids, labels = tiny_batch()
    labels[:, : SEQ - 4] = -100
    assert_matches_plain(input_ids=input_ids, labels=labels)


def test_num_items_in_batch_divides_the_summed_loss():
    # The Trainer's gradient accumulation: the sum over this micro-batch, divided by the number
    # of counted tokens in the whole accumulated batch.
    input_ids, labels = tiny_batch()
    assert_matches_plain(input_ids=input_ids, labels=labels, num_items_in_batch=torch.tensor(57))
    assert_matches_plain(input_ids=input_ids, labels=labels, num_items_in_batch=57)


@pytest.mark.parametrize("num_items_in_batch", [None, 0, 57], ids=["mean", "sum-over-0", "sum-over-57"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "cross_entropy"])
def test_all_ignored_batch_as_transformers(num_items_in_batch, fused):
    # transformers' loss over no counted token: the mean is NaN, the sum divided by
    # num_items_in_batch is NaN for 0 and 0 otherwise; the gradients are zero in every case.
    input_ids, labels = tiny_batch()
    labels[:] = -100
    inputs = dict(input_ids=input_ids, labels=labels)
    if num_items_in_batch is not None:
        inputs["num_items_in_batch"] = torch.tensor(num_items_in_batch)
    truth, truth_grads = loss_and_grads(tiny_model("llama"), **inputs)
    flags = dict(fused_linear_cross_entropy=fused, cross_entropy=not fused)
    output, grads = loss_and_grads(apply_tigon(tiny_model("llama"), **flags), **inputs)
    assert truth.loss.isnan() == (num_items_in_batch != 57)
    torch.testing.assert_close(output.loss, truth.loss, equal_nan=True, rtol=0, atol=0)
    assert grads.keys() == truth_grads.keys()
    for name, grad in grads.items():
        assert not grad.any() and not truth_grads[name].any(), f"grad of {name}"


def test_logits_to_keep_with_labels_of_the_kept_positions():
    input_ids, labels = tiny_batch()
    assert_matches_plain(input_ids=input_ids, labels=labels[:, -6:], logits_to_keep=6)


def test_shift_labels_given_directly():
    input_ids, labels = tiny_batch()
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    assert_matches_plain(input_ids=input_ids, labels=labels, shift_labels=shift_labels)


def test_return_dict_false_gives_a_tuple_starting_with_the_loss():
    input_ids, labels = tiny_batch()
    model = apply_tigon(tiny_model("llama")).train()
    loss, *_ = model(input_ids=input_ids, labels=labels, return_dict=False)
    assert loss.dim() == 0 and loss.requires_grad


def test_cross_entropy_on_logits_instead_of_fused():
    input_ids, labels = tiny_batch()
    flags = dict(cross_entropy=True, fused_linear_cross_entropy=False)
    output = assert_matches_plain(flags=flags, input_ids=input_ids, labels=labels)
    assert output.logits.shape == (*input_ids.shape, tiny_model("llama").config.vocab_size)


@pytest.mark.parametrize("model_type", ["gemma2", "granite"])
def test_cross_entropy_on_transformed_logits(model_type):
    # The logits the loss sees are already softcapped (Gemma 2) or scaled (Granite) by the model.
    input_ids, labels = tiny_batch()
    flags = dict(cross_entropy=True, fused_linear_cross_entropy=False)
    assert_matches_plain(model_type, flags=flags, input_ids=input_ids, labels=labels)


@pytest.mark.parametrize("patch_first", [True, False])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing(use_reentrant, patch_first, monkeypatch):
    # Under non-reentrant checkpointing the MLPs keep only their input (tigon.functional.swiglu_mlp),
    # whether checkpointing was switched on before or after patching.
    whole_mlp_calls = []
    swiglu_mlp = tigon.functional.swiglu_mlp
    monkeypatch.setattr(
        tigon.functional, "swiglu_mlp", lambda *args, **kwargs: whole_mlp_calls.append(1) or swiglu_mlp(*args, **kwargs)
    )
    input_ids, labels = tiny_batch()
    truth, truth_grads = loss_and_grads(tiny_model("llama"), input_ids=input_ids, labels=labels)
    model = apply_tigon(tiny_model("llama")) if patch_first else tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model = model if patch_first else apply_tigon(model)
    output, grads = loss_and_grads(model, input_ids=input_ids, labels=labels)
    assert relative_error(output.loss, truth.loss) <= TOLERANCE
    for name, grad in truth_grads.items():
        assert relative_error(grads[name], grad) <= TOLERANCE, f"grad of {name}"
    # Each layer calls it in the forward, and again in the recomputation, which stops inside it.
    expected_calls = 0 if use_reentrant else 2 * model.config.num_hidden_layers
    assert len(whole_mlp_calls) == expected_calls
    model.gradient_checkpointing_disable()
    loss_and_grads(model, input_ids=input_ids, labels=labels)
    assert len(whole_mlp_calls) == expected_calls


def test_moe_router_loss_is_added():
    input_ids, labels = tiny_batch()
    output = assert_matches_plain("mixtral", input_ids=input_ids, labels=labels)
    assert output.aux_loss is not None
    without_router_loss = assert_matches_plain(
        "mixtral", plain_options=dict(output_router_logits=False), input_ids=input_ids, labels=labels
    )
    assert not torch.allclose(output.loss, without_router_loss.loss)


def test_eval_and_unlabelled_calls_run_the_original_forward():
    input_ids, labels = tiny_batch()
    with torch.no_grad():
        truth = tiny_model("llama").eval()(input_ids=input_ids, labels=labels)
        model = apply_tigon(tiny_model("llama")).eval()
        output = model(input_ids=input_ids, labels=labels)
        assert relative_error(output.logits, truth.logits) <= TOLERANCE
        assert relative_error(output.loss, truth.loss) <= TOLERANCE
        model.train()
        assert model(input_ids=input_ids).logits.shape == truth.logits.shape


def test_generate_is_unaffected():
    prompt = tiny_batch()[0][:1, :5]
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    truth = tiny_model("llama").eval().generate(prompt, **options)
    assert torch.equal(apply_tigon(tiny_model("llama")).eval().generate(prompt, **options), truth)


@pytest.mark.parametrize("patch_before_build", [True, False])
def test_full_graph_compile(patch_before_build):
    # The loss path registers no hook per call, so the whole patched model traces as one graph.
    input_ids, labels = tiny_batch()
    if patch_before_build:
        apply_tigon_to_llama()
        model = tiny_model("llama")
    else:
        model = apply_tigon(tiny_model("llama"))
    truth, truth_grads = loss_and_grads(model, input_ids=input_ids, labels=labels)
    compiled = torch.compile(model, backend=pick(cpu="eager", gpu="inductor"), fullgraph=True)
    model.zero_grad(set_to_none=True)
    loss = compiled(input_ids=input_ids, labels=labels).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert relative_error(loss, truth.loss) <= TOLERANCE
    for name, grad in truth_grads.items():
        assert relative_error(grads[name], grad) <= TOLERANCE, f"grad of {name}"


def test_autocast_bf16():
    # An fp32 model under bf16 autocast: lm_head would run in bf16, and so does the fused loss.
    input_ids, labels = tiny_batch()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        truth = tiny_model("llama").train()(input_ids=input_ids, labels=labels).loss
        loss = apply_tigon(tiny_model("llama")).train()(input_ids=input_ids, labels=labels).loss
    assert relative_error(loss, truth) <= 1e-3
