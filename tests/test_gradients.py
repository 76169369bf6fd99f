"""No gradient is silently dropped: every public function of tigon.functional and tigon.losses,
called with every floating-point tensor argument requiring grad (options such as ``eps`` or
``temperature`` included, given as 0-dim tensors), either gives each of them a gradient or
refuses at the call with an error that names the argument ("<name> requires grad, but ...").

The table below holds small valid inputs per function (and per variant whose backward takes
another path: ``name/variant``) and the arguments it is expected to refuse; a public function
missing from the table fails :func:`test_every_public_function_is_covered`.
"""

import inspect
import re

import pytest
import torch

import tigon.functional as tf
import tigon.losses as tl
from tigon.ops.fused_linear_logprobs import FIELDS
from utils import DEVICE, randn

REFUSAL = re.compile(r"^(\w+) requires grad, but .+; tigon computes no gradient for it: ")
H, V, N = 16, 24, 6


def _leaf(*shape, scale=1.0):
    return randn(*shape, requires_grad=True, scale=scale)


def _number(value):
    return torch.tensor(value, device=DEVICE, requires_grad=True)


def _ids(*shape, high=V):
    return torch.randint(0, high, shape, device=DEVICE)


def _distribution(*shape, log):
    values = torch.randn(*shape, device=DEVICE).log_softmax(-1)
    return (values if log else values.exp()).requires_grad_(True)


def _head(*leading):
    return dict(input=_leaf(*leading, H), weight=_leaf(V, H, scale=H**-0.5), bias=_leaf(V))


def _sequences(n_sequences=4, seq_len=5):
    target = _ids(n_sequences, seq_len)
    target[:, 0] = -100
    return dict(**_head(n_sequences, seq_len), target=target)


def _reference_model(n_sequences=4, seq_len=5):
    return dict(ref_input=_leaf(n_sequences, seq_len, H), ref_weight=_leaf(V, H, scale=H**-0.5), ref_bias=_leaf(V))


def _grpo():
    mask = torch.ones(3, 5, device=DEVICE)
    mask[1, 3:] = 0
    logps = lambda: (torch.randn(3, 5, device=DEVICE) * 0.1 - 3.0).requires_grad_(True)  # noqa: E731
    return dict(
        **_head(3, 5), completion_ids=_ids(3, 5), completion_mask=mask.requires_grad_(True), advantages=_leaf(3),
        old_per_token_logps=logps(), ref_per_token_logps=logps(), num_items_in_batch=_number(13.0),
        beta=_number(0.04), epsilon_low=_number(0.2), epsilon_high=_number(0.28), temperature=_number(0.9),
    )


NUMBERS_CE = ("label_smoothing", "lse_square_scale", "softcap")
# name → (function, inputs, the arguments it refuses)
CASES = {
    "rms_norm": (tf.rms_norm, lambda: dict(x=_leaf(3, H), weight=_leaf(H), eps=_number(1e-6), offset=_number(0.0)),
                 {"eps", "offset"}),
    "fused_add_rms_norm": (
        tf.fused_add_rms_norm,
        lambda: dict(x=_leaf(3, H), residual=_leaf(3, H), weight=_leaf(H), eps=_number(1e-6), offset=_number(1.0)),
        {"eps", "offset"},
    ),
    "rms_norm_gated": (
        tf.rms_norm_gated,
        lambda: dict(x=_leaf(3, H), gate=_leaf(3, H), weight=_leaf(H), eps=_number(1e-6), group_size=8),
        {"eps"},
    ),
    "layer_norm": (
        tf.layer_norm,
        lambda: dict(x=_leaf(3, H), weight=_leaf(H), bias=_leaf(H), eps=_number(1e-5), offset=_number(1.0)),
        {"eps", "offset"},
    ),
    "rope": (
        tf.rope, lambda: dict(q=_leaf(1, 2, 4, 8), k=_leaf(1, 1, 4, 8), cos=_leaf(1, 4, 8), sin=_leaf(1, 4, 8)), set(),
    ),
    "rope/mrope_half_tables_q_only": (
        tf.rope,
        lambda: dict(q=_leaf(1, 2, 4, 12), k=None, cos=_leaf(3, 1, 4, 4), sin=_leaf(3, 1, 4, 4), rotary_dim=8,
                     interleaved=True, rotary_last=True, mrope_section=(2, 1, 1), mrope_interleaved=True),
        set(),
    ),
    "rope/deinterleave": (
        tf.rope,
        lambda: dict(q=_leaf(1, 2, 4, 8), k=_leaf(1, 2, 4, 8), cos=_leaf(4, 4), sin=_leaf(4, 4), interleaved=True,
                     deinterleave_output=True),
        set(),
    ),
    "rms_norm_gated/gate_first_gemma": (
        tf.rms_norm_gated,
        lambda: dict(x=_leaf(3, H), gate=_leaf(3, H), weight=_leaf(H), norm_before_gate=False, casting_mode="gemma"),
        set(),
    ),
    "swiglu": (tf.swiglu, lambda: dict(gate=_leaf(3, 8), up=_leaf(3, 8)), set()),
    "geglu": (tf.geglu, lambda: dict(gate=_leaf(3, 8), up=_leaf(3, 8)), set()),
    "relu2": (tf.relu2, lambda: dict(x=_leaf(3, 8)), set()),
    "swiglu_clamped": (tf.swiglu_clamped, lambda: dict(gate_up=_leaf(3, 16, scale=4.0)), set()),
    "swiglu_linear": (
        tf.swiglu_linear, lambda: dict(gate=_leaf(3, 8), up=_leaf(3, 8), weight=_leaf(5, 8), bias=_leaf(5)), set(),
    ),
    "geglu_linear": (
        tf.geglu_linear, lambda: dict(gate=_leaf(3, 8), up=_leaf(3, 8), weight=_leaf(5, 8), bias=_leaf(5)), set(),
    ),
    "swiglu_mlp": (
        tf.swiglu_mlp,
        lambda: dict(x=_leaf(3, 8), gate_weight=_leaf(12, 8), up_weight=_leaf(12, 8), down_weight=_leaf(8, 12)),
        set(),
    ),
    "geglu_mlp": (
        tf.geglu_mlp,
        lambda: dict(x=_leaf(3, 8), gate_weight=_leaf(12, 8), up_weight=_leaf(12, 8), down_weight=_leaf(8, 12)),
        set(),
    ),
    "lora_linear": (
        tf.lora_linear,
        lambda: dict(x=_leaf(3, 8), weight=_leaf(5, 8), lora_a=_leaf(2, 8), lora_b=_leaf(5, 2), scaling=_number(2.0),
                     bias=_leaf(5)),
        {"scaling"},
    ),
    "lora_linear/dropout": (
        tf.lora_linear,
        lambda: dict(x=_leaf(3, 8), weight=_leaf(5, 8), lora_a=_leaf(2, 8), lora_b=_leaf(5, 2), x_adapter=_leaf(3, 8)),
        set(),
    ),
    "add_lora": (
        tf.add_lora,
        lambda: dict(base_out=_leaf(3, 5), x=_leaf(3, 8), lora_a=_leaf(2, 8), lora_b=_leaf(5, 2), scaling=_number(2.0)),
        {"scaling"},
    ),
    "swiglu_mlp/lora": (
        tf.swiglu_mlp,
        lambda: dict(x=_leaf(3, 8), gate_weight=_leaf(12, 8), up_weight=_leaf(12, 8), down_weight=_leaf(8, 12),
                     gate_lora=(_leaf(2, 8), _leaf(12, 2), 2.0), down_lora=(_leaf(3, 12), _leaf(8, 3), 0.5)),
        set(),
    ),
    "moe_experts": (
        tf.moe_experts,
        lambda: dict(hidden_states=_leaf(5, 8), top_k_index=_ids(5, 2, high=3), top_k_weights=_leaf(5, 2),
                     gate_up_proj=_leaf(3, 12, 8), down_proj=_leaf(3, 8, 6)),
        set(),
    ),
    "moe_experts/gpt_oss": (
        tf.moe_experts,
        lambda: dict(hidden_states=_leaf(5, 8), top_k_index=_ids(5, 2, high=3), top_k_weights=_leaf(5, 2),
                     gate_up_proj=_leaf(3, 8, 12), down_proj=_leaf(3, 6, 8), gate_up_bias=_leaf(3, 12),
                     down_bias=_leaf(3, 8), gate="swiglu_clamped", transposed=True, interleaved=True,
                     alpha=_number(1.702), limit=_number(7.0)),
        {"alpha", "limit"},
    ),
    "cross_entropy": (
        tf.cross_entropy,
        lambda: dict(logits=_leaf(N, V), target=_ids(N), label_smoothing=_number(0.1), lse_square_scale=_number(0.01),
                     softcap=_number(30.0)),
        set(NUMBERS_CE),
    ),
    "fused_linear_cross_entropy": (
        tf.fused_linear_cross_entropy,
        lambda: dict(**_head(N), target=_ids(N), label_smoothing=_number(0.1), lse_square_scale=_number(0.01),
                     softcap=_number(30.0)),
        set(NUMBERS_CE),
    ),
    "cross_entropy/none": (
        tf.cross_entropy, lambda: dict(logits=_leaf(N, V), target=_ids(N), reduction="none", label_smoothing=0.1),
        set(),
    ),
    "fused_linear_cross_entropy/none": (
        tf.fused_linear_cross_entropy,
        lambda: dict(**_head(N), target=_ids(N), reduction="none", chunk_memory_bytes=2 * V * 4), set(),
    ),
    "fused_linear_logprobs/grad_in_forward": (
        tf.fused_linear_logprobs,
        lambda: dict(**_head(N), target=_ids(N), grad_in_forward=True, chunk_memory_bytes=2 * V * 4), set(),
    ),
    "fused_linear_logprobs": (
        tf.fused_linear_logprobs,
        lambda: dict(**_head(N), target=_ids(N), temperature=_number(0.7), softcap=_number(30.0), outputs=FIELDS),
        {"temperature", "softcap"},
    ),
    "kl_div": (
        tl.kl_div, lambda: dict(input=_distribution(N, V, log=True), target=_distribution(N, V, log=False)), set(),
    ),
    "kl_div/none_log_target": (
        tl.kl_div,
        lambda: dict(input=_distribution(N, V, log=True), target=_distribution(N, V, log=True), reduction="none",
                     log_target=True),
        set(),
    ),
    "jsd": (
        tl.jsd,
        lambda: dict(input=_distribution(N, V, log=True), target=_distribution(N, V, log=True), labels=_ids(N),
                     beta=_number(0.3)),
        {"beta"},
    ),
    "tvd": (
        tl.tvd,
        lambda: dict(input=_distribution(N, V, log=False), target=_distribution(N, V, log=False), labels=_ids(N)),
        set(),
    ),
    "tvd/none": (
        tl.tvd,
        lambda: dict(input=_distribution(N, V, log=False), target=_distribution(N, V, log=False), reduction="none"),
        set(),
    ),
    "fused_linear_jsd": (
        tl.fused_linear_jsd,
        lambda: dict(input=_leaf(N, H), weight=_leaf(V, H, scale=H**-0.5), teacher_input=_leaf(N, 8),
                     teacher_weight=_leaf(V, 8), labels=_ids(N), beta=_number(0.3), temperature=_number(0.8)),
        {"teacher_input", "teacher_weight", "beta", "temperature"},
    ),
    "fused_linear_dpo": (
        tl.fused_linear_dpo, lambda: dict(**_sequences(), **_reference_model(), beta=_number(0.1)),
        {"ref_input", "ref_weight", "ref_bias", "beta"},
    ),
    "fused_linear_cpo": (
        tl.fused_linear_cpo,
        lambda: dict(**_sequences(), beta=_number(0.1), alpha=_number(0.7), label_smoothing=_number(0.1)),
        {"beta", "alpha", "label_smoothing"},
    ),
    "fused_linear_simpo": (
        tl.fused_linear_simpo,
        lambda: dict(**_sequences(), beta=_number(2.0), gamma=_number(0.5), label_smoothing=_number(0.1)),
        {"beta", "gamma", "label_smoothing"},
    ),
    "fused_linear_orpo": (tl.fused_linear_orpo, lambda: dict(**_sequences(), beta=_number(0.1)), {"beta"}),
    "fused_linear_kto": (
        tl.fused_linear_kto,
        lambda: dict(
            **_sequences(), **_reference_model(),
            preference_labels=torch.tensor([True, False, True, False], device=DEVICE),
            kl=_number(0.05), beta=_number(0.1), desirable_weight=_number(1.0), undesirable_weight=_number(1.3),
        ),
        {"ref_input", "ref_weight", "ref_bias", "kl", "beta", "desirable_weight", "undesirable_weight"},
    ),
    "fused_linear_sequence_logps": (tl.fused_linear_sequence_logps, _sequences, {"input", "weight", "bias"}),
    "fused_linear_grpo": (
        tl.fused_linear_grpo, _grpo,
        {"completion_mask", "advantages", "old_per_token_logps", "ref_per_token_logps", "num_items_in_batch", "beta",
         "epsilon_low", "epsilon_high", "temperature"},
    ),
}


def _public_functions(module):
    return {name for name in module.__all__ if inspect.isfunction(getattr(module, name))}


def test_every_public_function_is_covered():
    assert {name.split("/")[0] for name in CASES} == _public_functions(tf) | _public_functions(tl)


def _differentiable_outputs(result):
    if isinstance(result, torch.Tensor):
        return [result] if result.requires_grad else []
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in _differentiable_outputs(item)]
    if isinstance(result, dict):
        return _differentiable_outputs(list(result.values()))
    return []


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_float_input_gets_a_gradient_or_is_refused(name):
    function, make_inputs, expected_refusals = CASES[name]
    torch.manual_seed(0)
    inputs = make_inputs()
    refused = set()
    while True:
        try:
            result = function(**inputs)
            break
        except ValueError as error:
            match = REFUSAL.match(str(error))
            assert match, f"{name}: {error}"
            argument = match.group(1)
            assert argument in inputs and argument not in refused, f"{name} refused {argument!r}: {error}"
            refused.add(argument)
            inputs[argument] = inputs[argument].detach()
    assert refused == expected_refusals

    outputs = _differentiable_outputs(result)
    if outputs:
        torch.autograd.backward(outputs, [torch.randn_like(t) for t in outputs])
    for argument, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            assert value.grad is not None, f"{name}: {argument} requires grad but got no gradient"
            assert torch.isfinite(value.grad).all(), f"{name}: {argument}'s gradient is not finite"


def test_no_refusal_without_grad_mode():
    """Under torch.no_grad() nothing is differentiated, so nothing is refused."""
    _, make_inputs, _ = CASES["fused_linear_kto"]
    with torch.no_grad():
        loss, _ = tl.fused_linear_kto(**make_inputs())
    assert not loss.requires_grad
