"""``tigon check``: the environment, then every public op against its plain-PyTorch reference.

Every function of :mod:`tigon.functional` and every loss of :mod:`tigon.losses` (the log-probs
head, the preference losses, the GRPO family, the divergences and distillation) runs forward and
backward in fp32 and in bf16 (fp16 too on request: ``--dtypes fp16``), and the reference of
:mod:`tigon.testing.reference` runs on the same input values in fp64. Each row prints the largest
relative error (‖out − truth‖ / ‖truth‖, the truth rounded to a 16-bit output's dtype, which is the
best such an output can hold) over the outputs and over every input gradient (a gradient the
reference has and tigon lacks counts as an infinite error), against the dtype's tolerance, and the
time of one tigon forward + backward (wall clock; after a warm-up call on a GPU; through the
interpreter on a CPU-only machine, where it says nothing about GPU speed). Shapes are small without
a GPU and realistic with one. The exit status is 1 if any row fails.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton

import tigon
from tigon import functional as F
from tigon import losses
from tigon.ops._launch import interpreting
from tigon.testing import TOLERANCE, reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What a bare `tigon check` runs: fp32, and bf16 for the 16-bit dtypes (fp16 on request).
DEFAULT_DTYPES = ("fp32", "bf16")


def _no_options(dtype: torch.dtype) -> dict:
    return {}


def _rounded_logits(dtype: torch.dtype) -> dict:
    """A whole sequence's loss sums many log-probs, so the rounding of 16-bit logits moves it by
    more than a tolerance: the truth is the exact loss of the logits rounded as tigon's are
    (:func:`tigon.testing.reference.head_logits`)."""
    return {"logits_dtype": dtype}


def _as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _loss(result) -> tuple:
    """The loss of a ``(loss, metrics)`` (or the reference's ``(loss, logps)``) pair."""
    return (result[0],)


@dataclass
class Case:
    """One op on one set of inputs.

    ``op`` is the public function or loss class under test and ``reference`` its truth; each is
    called with the inputs and ``options`` as keywords (a loss class gets ``options`` in its
    constructor), the reference with ``truth_options(dtype)`` too. ``result`` picks the tensors
    to compare from either's return value. Every floating-point input is differentiated except
    the ``constants`` (a reference model, reference log-probs, a teacher). ``factor`` widens the
    tolerance for ops whose results pass through more roundings, as the test suite does.
    """

    name: str
    shape: str
    op: Callable
    reference: Callable
    make_inputs: Callable[[torch.device, torch.dtype], dict]
    options: dict = field(default_factory=dict)
    truth_options: Callable[[torch.dtype], dict] = _no_options
    result: Callable[[object], tuple] = _as_tuple
    constants: tuple[str, ...] = ()
    factor: float = 1.0


def _randn(device, dtype, *shape, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _targets(device, vocab, *shape, ignore_every=7):
    target = torch.randint(0, vocab, shape, device=device)
    target.view(-1)[::ignore_every] = -100
    return target


def cases(small: bool) -> list[Case]:
    """Every op's cases: small shapes for the interpreter, a real model's with a GPU."""
    rows, hidden = (64, 200) if small else (4096, 4096)
    batch, q_heads, k_heads, seq, head_dim = (1, 4, 2, 24, 32) if small else (2, 32, 8, 2048, 128)
    inter = 300 if small else 14336
    group = hidden // 8  # rms_norm_gated normalising per group of features (Falcon-H1, Zamba2)
    expert_inter = 150 if small else 2880  # GPT-OSS's clamped SwiGLU, at its expert width
    rank = 16
    n_tokens, vocab, lm_hidden = (48, 1000, 64) if small else (4096, 128256, 4096)
    # A MoE layer's experts: Qwen3-30B-A3B's (128 experts, top-8, H 2048, I 768) on a GPU.
    moe_tokens, n_experts, top_k, moe_hidden, moe_inter = (40, 6, 2, 64, 40) if small else (8192, 128, 8, 2048, 768)
    # Post-training: S sequences of T tokens (DPO's chosen then rejected, GRPO's completions).
    n_sequences, seq_len, head_hidden, head_vocab = (4, 13, 32, 300) if small else (8, 512, 2048, 32000)
    teacher_hidden = 48 if small else 4096
    div_rows, div_vocab = (21, 500) if small else (4096, 32000)

    def norm_inputs(device, dtype):
        return {"x": _randn(device, dtype, rows, hidden), "weight": _randn(device, dtype, hidden)}

    def residual_inputs(device, dtype):
        return {**norm_inputs(device, dtype), "residual": _randn(device, dtype, rows, hidden)}

    def gated_norm_inputs(device, dtype):
        return {**norm_inputs(device, dtype), "gate": _randn(device, dtype, rows, hidden)}

    def ln_inputs(device, dtype):
        return {**norm_inputs(device, dtype), "bias": _randn(device, dtype, hidden)}

    # M-RoPE's (t, h, w) pairs per plane: Qwen2-VL's (16, 24, 24) of 64 pairs, scaled to the head.
    pairs = head_dim // 2
    time_pairs, height_pairs = pairs // 4, (pairs - pairs // 4) // 2
    mrope_section = (time_pairs, height_pairs, pairs - time_pairs - height_pairs)
    sections = "+".join(map(str, mrope_section))

    def rope_inputs(tables="full", mrope=False, with_k=True, rotary_dim=head_dim):
        """q and k as the transposed ``[B, T, H, D]`` projections of an attention layer, and
        tables of random angles: ``full`` ``cat(freqs, freqs)``, ``full_interleaved`` each angle
        twice in a row (DeepSeek V4), ``half`` one angle per pair; M-RoPE's three planes
        ``[3, B, T, W]`` with ``mrope``."""

        def make(device, dtype):
            leading = (3, batch, seq) if mrope else (1, seq)
            angles = torch.rand(*leading, rotary_dim // 2, device=device) * 6.28
            if tables == "full":
                angles = torch.cat((angles, angles), dim=-1)
            elif tables == "full_interleaved":
                angles = angles.repeat_interleave(2, dim=-1)
            inputs = {"q": _randn(device, dtype, batch, seq, q_heads, head_dim).transpose(1, 2), "k": None}
            if with_k:
                inputs["k"] = _randn(device, dtype, batch, seq, k_heads, head_dim).transpose(1, 2)
            return {**inputs, "cos": angles.cos().to(dtype), "sin": angles.sin().to(dtype)}

        return make

    def rope_case(name, shape_note, make_inputs, **options):
        return Case(
            name, f"q [{batch}, {q_heads}, {seq}, {head_dim}]{shape_note}", F.rope, reference.rope, make_inputs,
            options,
        )

    def gate_inputs(device, dtype):
        return {"gate": _randn(device, dtype, rows, inter), "up": _randn(device, dtype, rows, inter)}

    def relu2_inputs(device, dtype):
        return {"x": _randn(device, dtype, rows, inter)}

    def gate_up_inputs(device, dtype):
        # Scale 4 spreads past GPT-OSS's limit of 7: some gates and ups are clamped.
        return {"gate_up": _randn(device, dtype, rows, 2 * expert_inter, scale=4.0)}

    def gated_linear_inputs(device, dtype):
        return {
            **gate_inputs(device, dtype),
            "weight": _randn(device, dtype, hidden, inter, scale=inter**-0.5),
            "bias": _randn(device, dtype, hidden),
        }

    def mlp_inputs(device, dtype):
        return {
            "x": _randn(device, dtype, rows, hidden),
            "gate_weight": _randn(device, dtype, inter, hidden, scale=hidden**-0.5),
            "up_weight": _randn(device, dtype, inter, hidden, scale=hidden**-0.5),
            "down_weight": _randn(device, dtype, hidden, inter, scale=inter**-0.5),
        }

    def adapter(device, dtype):
        return {
            "lora_a": _randn(device, dtype, rank, hidden, scale=hidden**-0.5),
            "lora_b": _randn(device, dtype, inter, rank, scale=rank**-0.5),
        }

    def lora_inputs(device, dtype):
        return {
            "x": _randn(device, dtype, rows, hidden),
            "weight": _randn(device, dtype, inter, hidden, scale=hidden**-0.5),
            **adapter(device, dtype),
        }

    def add_lora_inputs(device, dtype):
        return {"base_out": _randn(device, dtype, rows, inter), "x": _randn(device, dtype, rows, hidden),
                **adapter(device, dtype)}

    def moe_inputs(device, dtype):
        weights, index = torch.softmax(torch.randn(moe_tokens, n_experts, device=device), dim=-1).topk(top_k, dim=-1)
        return {
            "hidden_states": _randn(device, dtype, moe_tokens, moe_hidden),
            "top_k_index": index,
            "top_k_weights": weights,
            "gate_up_proj": _randn(device, dtype, n_experts, 2 * moe_inter, moe_hidden, scale=moe_hidden**-0.5),
            "down_proj": _randn(device, dtype, n_experts, moe_hidden, moe_inter, scale=moe_inter**-0.5),
        }

    def ce_inputs(device, dtype):
        logits = _randn(device, dtype, n_tokens, vocab, scale=4.0)
        return {"logits": logits, "target": _targets(device, vocab, n_tokens)}

    def head_inputs(device, dtype):
        return {
            "input": _randn(device, dtype, n_tokens, lm_hidden),
            "weight": _randn(device, dtype, vocab, lm_hidden, scale=lm_hidden**-0.5),
            "target": _targets(device, vocab, n_tokens),
        }

    def sequence_inputs(device, dtype, reference_model=False):
        """A policy's hidden states ``[S, T, H]`` and head, logits of unit scale; the first 3
        tokens of each sequence (the prompt) and the last 2 of the last one (padding) ignored."""
        target = torch.randint(0, head_vocab, (n_sequences, seq_len), device=device)
        target[:, :3] = -100
        target[-1, -2:] = -100
        inputs = {
            "input": _randn(device, dtype, n_sequences, seq_len, head_hidden),
            "weight": _randn(device, dtype, head_vocab, head_hidden, scale=head_hidden**-0.5),
            "target": target,
        }
        if reference_model:
            inputs["ref_input"] = _randn(device, dtype, n_sequences, seq_len, head_hidden)
            inputs["ref_weight"] = _randn(device, dtype, head_vocab, head_hidden, scale=head_hidden**-0.5)
        return inputs

    def kto_inputs(device, dtype):
        return {
            **sequence_inputs(device, dtype, reference_model=True),
            "preference_labels": torch.arange(n_sequences, device=device) % 3 != 1,
            "kl": torch.tensor(0.3, device=device),
        }

    def grpo_inputs(device, dtype):
        """Ragged completions (the first full, the others of random lengths), advantages of both
        signs and reference log-probs for the KL term, around the uniform distribution's."""
        inputs = sequence_inputs(device, dtype)
        lengths = torch.randint(1, seq_len + 1, (n_sequences,), device=device)
        lengths[0] = seq_len
        advantages = torch.randn(n_sequences, device=device)
        advantages[0], advantages[1] = advantages[0].abs() + 0.1, -advantages[1].abs() - 0.1
        uniform_logp = -math.log(head_vocab)
        return {
            "input": inputs["input"],
            "weight": inputs["weight"],
            "completion_ids": torch.randint(0, head_vocab, (n_sequences, seq_len), device=device),
            "completion_mask": torch.arange(seq_len, device=device) < lengths[:, None],
            "advantages": advantages,
            "ref_per_token_logps": uniform_logp + 0.3 * torch.randn(n_sequences, seq_len, device=device),
        }

    def log_probs(device, dtype):
        return _randn(device, torch.float32, div_rows, div_vocab, scale=2.0).log_softmax(-1).to(dtype)

    def divergence_inputs(device, dtype, probabilities=False):
        """Two distributions per row (log-probabilities, or ``probabilities``) and labels, every
        fifth ignored."""
        student, teacher = log_probs(device, dtype), log_probs(device, dtype)
        if probabilities:
            student, teacher = student.float().exp().to(dtype), teacher.float().exp().to(dtype)
        return {"input": student, "target": teacher, "labels": _targets(device, div_vocab, div_rows, ignore_every=5)}

    def distillation_inputs(device, dtype):
        return {
            "input": _randn(device, dtype, n_sequences * seq_len, head_hidden),
            "weight": _randn(device, dtype, head_vocab, head_hidden, scale=head_hidden**-0.5),
            "teacher_input": _randn(device, dtype, n_sequences * seq_len, teacher_hidden),
            "teacher_weight": _randn(device, dtype, head_vocab, teacher_hidden, scale=teacher_hidden**-0.5),
            "labels": _targets(device, head_vocab, n_sequences * seq_len, ignore_every=4),
        }

    head = f"[{n_tokens}, {lm_hidden}] x [{vocab}, {lm_hidden}]"
    sequences = f"[{n_sequences}, {seq_len}, {head_hidden}] x [{head_vocab}, {head_hidden}]"
    reference_model = ("ref_input", "ref_weight")
    return [
        Case("rms_norm", f"[{rows}, {hidden}]", F.rms_norm, reference.rms_norm, norm_inputs),
        Case("fused_add_rms_norm", f"[{rows}, {hidden}]", F.fused_add_rms_norm, reference.fused_add_rms_norm,
             residual_inputs),
        Case("rms_norm_gated", f"[{rows}, {hidden}]", F.rms_norm_gated, reference.rms_norm_gated, gated_norm_inputs),
        Case("rms_norm_gated_grouped", f"[{rows}, {hidden}], groups of {group}", F.rms_norm_gated,
             reference.rms_norm_gated, gated_norm_inputs, dict(group_size=group, norm_before_gate=False)),
        Case("layer_norm", f"[{rows}, {hidden}]", F.layer_norm, reference.layer_norm, ln_inputs),
        Case("layer_norm_1p", f"[{rows}, {hidden}], weight + 1", F.layer_norm, reference.layer_norm, ln_inputs,
             dict(offset=1.0)),
        # The rotations and their cos/sin tables' gradients, per Hugging Face variant.
        rope_case("rope", "", rope_inputs()),
        rope_case("rope_half_table", ", half tables", rope_inputs("half")),
        rope_case("rope_interleaved", ", half tables", rope_inputs("half"), interleaved=True),
        rope_case(
            "rope_deinterleave", ", half tables", rope_inputs("half"), interleaved=True, deinterleave_output=True,
        ),
        rope_case(
            "rope_rotary_last", f", last {head_dim // 2}, q only",
            rope_inputs("full_interleaved", with_k=False, rotary_dim=head_dim // 2), rotary_dim=head_dim // 2,
            interleaved=True, rotary_last=True,
        ),
        rope_case("rope_mrope", f", M-RoPE {sections}", rope_inputs(mrope=True), mrope_section=mrope_section),
        rope_case(
            "rope_mrope_interleaved", f", M-RoPE {sections}", rope_inputs("half", mrope=True),
            mrope_section=mrope_section, mrope_interleaved=True,
        ),
        Case("swiglu", f"[{rows}, {inter}]", F.swiglu, reference.swiglu, gate_inputs),
        Case("geglu", f"[{rows}, {inter}]", F.geglu, reference.geglu, gate_inputs),
        Case("relu2", f"[{rows}, {inter}]", F.relu2, reference.relu2, relu2_inputs),
        Case("swiglu_clamped", f"[{rows}, 2·{expert_inter}] interleaved", F.swiglu_clamped, reference.swiglu_clamped,
             gate_up_inputs),
        # The gated product rounds to the dtype before the matmul, which rounds again.
        Case("swiglu_linear", f"[{rows}, {inter}] x [{hidden}, {inter}]", F.swiglu_linear, reference.swiglu_linear,
             gated_linear_inputs, factor=2.0),
        Case("geglu_linear", f"[{rows}, {inter}] x [{hidden}, {inter}]", F.geglu_linear, reference.geglu_linear,
             gated_linear_inputs, factor=2.0),
        # Two rounded intermediates each way; x's gradient is also a sum of rounded slices.
        Case("swiglu_mlp", f"[{rows}, {hidden}], I {inter}", F.swiglu_mlp, reference.swiglu_mlp, mlp_inputs,
             factor=3.0),
        Case("geglu_mlp", f"[{rows}, {hidden}], I {inter}", F.geglu_mlp, reference.geglu_mlp, mlp_inputs, factor=3.0),
        # The base and adapter products each round before their sum; each gradient passes through
        # a rounded [N, r] intermediate.
        Case("lora_linear", f"[{rows}, {hidden}] x [{inter}, {hidden}], r {rank}", F.lora_linear,
             reference.lora_linear, lora_inputs, dict(scaling=2.0), factor=2.0),
        Case("add_lora", f"[{rows}, {inter}] + [{rows}, {hidden}], r {rank}", F.add_lora, reference.add_lora,
             add_lora_inputs, dict(scaling=2.0), factor=2.0),
        # The routing weights' gradients are sums over many rows.
        Case("moe_experts", f"[{moe_tokens}, {moe_hidden}], {n_experts} experts top-{top_k}, I {moe_inter}",
             F.moe_experts, reference.moe_experts, moe_inputs, factor=2.0),
        Case("cross_entropy", f"[{n_tokens}, {vocab}]", F.cross_entropy, reference.cross_entropy, ce_inputs),
        Case("fused_linear_cross_entropy", head, F.fused_linear_cross_entropy, reference.fused_linear_cross_entropy,
             head_inputs),
        # TRL's fused head: log-probs and entropy of softcapped, scaled, tempered logits.
        Case("fused_linear_logprobs", head, F.fused_linear_logprobs, reference.fused_linear_logprobs, head_inputs,
             dict(outputs=("log_probs", "entropy"), temperature=0.7, softcap=3.0, logit_scale=1.5)),
        Case("dpo", sequences, losses.FusedLinearDPOLoss, reference.dpo_loss,
             lambda d, t: sequence_inputs(d, t, reference_model=True), dict(beta=0.1, compute_nll_loss=True),
             _rounded_logits, _loss, reference_model),
        Case("cpo", sequences, losses.FusedLinearCPOLoss, reference.cpo_loss, sequence_inputs,
             dict(beta=0.1, alpha=0.7, label_smoothing=0.1), _rounded_logits, _loss),
        Case("simpo", sequences, losses.FusedLinearSimPOLoss, reference.simpo_loss, sequence_inputs,
             dict(beta=2.0, gamma=0.5, label_smoothing=0.2), _rounded_logits, _loss),
        Case("orpo", sequences, losses.FusedLinearORPOLoss, reference.orpo_loss, sequence_inputs, dict(beta=0.2),
             _rounded_logits, _loss),
        Case("kto", sequences, losses.FusedLinearKTOLoss, reference.kto_loss, kto_inputs,
             dict(beta=0.5, desirable_weight=1.3), _rounded_logits, _loss, (*reference_model, "kl")),
        # Reference log-probs and KTO's baseline: constants, no gradient.
        Case("sequence_logps", sequences, losses.fused_linear_sequence_logps, reference.sequence_logps,
             sequence_inputs, truth_options=_rounded_logits, constants=("input", "weight")),
        Case("grpo", sequences, losses.FusedLinearGRPOLoss, reference.grpo_loss, grpo_inputs,
             dict(loss_type="grpo", beta=0.04), _rounded_logits, _loss, ("advantages", "ref_per_token_logps")),
        Case("kl_div", f"[{div_rows}, {div_vocab}]", losses.KLDivLoss, reference.kl_div,
             lambda d, t: {k: v for k, v in divergence_inputs(d, t).items() if k != "labels"},
             dict(reduction="batchmean", log_target=True)),
        Case("jsd", f"[{div_rows}, {div_vocab}]", losses.JSDLoss, reference.jsd, divergence_inputs, dict(beta=0.3)),
        Case("tvd", f"[{div_rows}, {div_vocab}]", losses.TVDLoss, reference.tvd,
             lambda d, t: divergence_inputs(d, t, probabilities=True)),
        Case("fused_linear_jsd", f"{sequences}, teacher H {teacher_hidden}", losses.FusedLinearJSDLoss,
             reference.fused_linear_jsd, distillation_inputs, dict(beta=0.5, temperature=2.0),
             lambda dtype: {"logits_dtype": dtype, "teacher_logits_dtype": dtype},
             constants=("teacher_input", "teacher_weight")),
    ]


def _relative_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    if actual.dtype in (torch.float16, torch.bfloat16):
        truth = truth.to(actual.dtype)  # the best a 16-bit tensor can hold
    actual, truth = actual.detach().double(), truth.detach().double()
    scale = truth.norm().item()
    return (actual - truth).norm().item() / (scale if scale > 0 else 1.0)


def _leaves(case: Case, inputs: dict, dtype: torch.dtype | None = None) -> dict:
    """Fresh copies of the inputs (floating-point ones cast to ``dtype`` if given), each
    requiring grad unless it is one of the case's constants."""
    leaves = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().to(dtype or value.dtype, copy=True).requires_grad_(name not in case.constants)
        leaves[name] = value
    return leaves


def _forward(case: Case, fn: Callable, leaves: dict, options: dict) -> tuple[torch.Tensor, ...]:
    result = fn(**options)(**leaves) if isinstance(fn, type) else fn(**leaves, **options)
    return tuple(output for output in case.result(result) if output is not None)


def _upstream(outputs, seed: int) -> list[torch.Tensor | None]:
    """A random gradient for each differentiable output, in its dtype."""
    generator = torch.Generator(device=outputs[0].device).manual_seed(seed)
    return [
        torch.randn(o.shape, device=o.device, generator=generator).to(o.dtype) if o.requires_grad else None
        for o in outputs
    ]


def _backward(outputs, grads, leaves: dict) -> dict[str, torch.Tensor]:
    """Backward from the differentiable outputs; the reference gets tigon's upstream gradients,
    cast to its dtype. Returns the inputs' gradients by name."""
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return {name: leaf.grad for name, leaf in leaves.items() if getattr(leaf, "grad", None) is not None}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Row:
    case: Case
    dtype: torch.dtype
    output_error: float
    grad_error: float | None  # None: nothing to differentiate
    limit: float
    milliseconds: float

    @property
    def ok(self) -> bool:
        return self.output_error <= self.limit and (self.grad_error is None or self.grad_error <= self.limit)


def run_case(case: Case, dtype: torch.dtype, device: torch.device, warm_up: bool) -> Row:
    """tigon's outputs and gradients against the fp64 reference's on the same input values, for
    the same random upstream gradients."""
    inputs = case.make_inputs(device, dtype)

    def step():
        leaves = _leaves(case, inputs)
        outputs = _forward(case, case.op, leaves, case.options)
        upstream = _upstream(outputs, seed=1)
        return outputs, upstream, _backward(outputs, upstream, leaves)

    if warm_up:
        step()
    _sync(device)
    start = time.perf_counter()
    outputs, upstream, grads = step()
    _sync(device)
    milliseconds = (time.perf_counter() - start) * 1e3

    truth_leaves = _leaves(case, inputs, torch.float64)
    truths = _forward(case, case.reference, truth_leaves, {**case.options, **case.truth_options(dtype)})
    truth_grads = _backward(truths, upstream, truth_leaves)
    output_error = max(_relative_error(o, t) for o, t in zip(outputs, truths, strict=True))
    # A gradient the reference has and tigon lacks is a failure, never a skipped comparison.
    grad_errors = [_relative_error(grads[k], t) if k in grads else float("inf") for k, t in truth_grads.items()]
    return Row(case, dtype, output_error, max(grad_errors, default=None), TOLERANCE[dtype] * case.factor,
               milliseconds)


def environment_lines(device: torch.device) -> list[str]:
    if device.type == "cuda":
        where = f"GPU: {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        where = "no GPU: kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1)"
    return [
        f"tigon {tigon.__version__}, python {platform.python_version()}, torch {torch.__version__}, "
        f"triton {triton.__version__}",
        where,
    ]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tigon check",
        description="Every public op, forward and backward, against its plain-PyTorch reference in fp64: "
        "the environment, one line per op and dtype (largest errors, tolerance, time), exit status 1 on any "
        "failure. Small shapes without a GPU, a real model's with one.",
    )
    parser.add_argument("ops", nargs="*", metavar="OP",
                        help="names of the cases to run, as the first column prints them (default: every one)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DEFAULT_DTYPES),
                        help=f"dtypes to run each op in, of {', '.join(DTYPES)} (default: {' '.join(DEFAULT_DTYPES)})")
    return parser


def main(argv: list[str] | None = None) -> int:
    command = parser()
    args = command.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_interpreter = device.type != "cuda" or interpreting()
    selected = cases(small=on_interpreter)
    unknown = sorted(set(args.ops) - {case.name for case in selected})
    if unknown:
        command.error(f"unknown op(s) {', '.join(unknown)}; the ops are {', '.join(c.name for c in selected)}")
    if args.ops:
        selected = [case for case in selected if case.name in args.ops]
    for line in environment_lines(device):
        print(line)
    name_width = max(len(case.name) for case in selected) + 2
    shape_width = max(len(case.shape) for case in selected) + 2
    header = (
        f"{'op':<{name_width}}{'shape':<{shape_width}}{'dtype':<7}"
        f"{'output err':>12}{'grad err':>12}{'limit':>9}{'time (ms)':>11}  ok"
    )
    print(header)
    print("-" * len(header))
    failures = total = 0
    torch.manual_seed(0)
    for case in selected:
        for dtype_name in args.dtypes:
            total += 1
            label = f"{case.name:<{name_width}}{case.shape:<{shape_width}}{dtype_name:<7}"
            try:
                # No warm-up through the interpreter: it compiles nothing, the first call costs the same.
                row = run_case(case, DTYPES[dtype_name], device, warm_up=not on_interpreter)
            except Exception as error:  # one op's exception is its failure; the others still run
                failures += 1
                print(f"{label}raised {type(error).__name__}: {error}  NO", flush=True)
                continue
            failures += not row.ok
            grad_error = "-" if row.grad_error is None else f"{row.grad_error:.2e}"
            print(
                f"{label}{row.output_error:>12.2e}{grad_error:>12}{row.limit:>9.0e}{row.milliseconds:>11.2f}"
                f"  {'yes' if row.ok else 'NO'}",
                flush=True,
            )
    print(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0
