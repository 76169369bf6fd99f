"""What ``tigon bench`` measures: per op, one swept size axis (as data), the inputs of one call and
the work that call must do at the least (the roofline its time is compared to).

Work is counted per direction. Memory-bound ops count the bytes of the tensors that must cross
HBM (small vectors such as norm weights, ``rstd`` or RoPE's ``cos``/``sin`` tables are left out:
they are under 1% at every swept shape; M-RoPE's per-sequence planes are not, and are counted);
the fused linear cross entropy is compute-bound and counts its matmul FLOPs. ``full`` is forward +
backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

BYTES = "bytes"
FLOPS = "flops"
MODES = ("forward", "backward", "full")


@dataclass(frozen=True)
class Sweep:
    """Sizes of the swept dimension ``axis``; the other dimensions are fixed in ``dims``."""

    axis: str
    sizes: tuple[int, ...]
    headline: int  # the shape quoted in docs/anchors: marked in tables and plots
    dims: Mapping[str, int]

    def shape_dims(self, size: int) -> dict[str, int]:
        return {**self.dims, self.axis: size}


@dataclass
class Case:
    """One input set: the keyword arguments of a call and the gradients its outputs receive in
    backward (``None`` for a scalar loss, which gets ``1``)."""

    args: dict[str, Any]
    grad_outputs: tuple[torch.Tensor | None, ...]

    def leaves(self) -> list[torch.Tensor]:
        return [t for t in self.args.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def nbytes(self) -> int:
        tensors = [t for t in (*self.args.values(), *self.grad_outputs) if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class OpSpec:
    name: str
    shape: str  # the call's shapes, formatted with the dims of a sweep point
    sweep: Sweep  # on a GPU
    smoke: Sweep  # tiny shapes for the interpreter smoke run
    build: Callable[[dict[str, int], torch.dtype, torch.device], Case]
    # The call as tigon.functional and tests/reference.py both spell it: call(module, case.args).
    call: Callable[[ModuleType, dict[str, Any]], Any]
    # (forward, backward) work of one call for the dims and element size, in ``unit``.
    work: Callable[[dict[str, int], int], tuple[float, float]]
    unit: str = BYTES

    def work_for(self, dims: dict[str, int], element_size: int, mode: str) -> float:
        forward, backward = self.work(dims, element_size)
        return {"forward": forward, "backward": backward, "full": forward + backward}[mode]

    def describe(self, dims: dict[str, int]) -> str:
        return self.shape.format(**dims)


def _randn(shape, dtype, device, requires_grad=False, scale=1.0):
    return torch.randn(shape, dtype=dtype, device=device).mul_(scale).requires_grad_(requires_grad)


def _norm_case(with_residual=False, with_bias=False):
    def build(dims, dtype, device):
        rows, hidden = dims["rows"], dims["H"]
        args = {"x": _randn((rows, hidden), dtype, device, True)}
        if with_residual:
            args["residual"] = _randn((rows, hidden), dtype, device, True)
        args["weight"] = _randn(hidden, dtype, device, True)
        if with_bias:
            args["bias"] = _randn(hidden, dtype, device, True)
        grads = [_randn((rows, hidden), dtype, device)]
        if with_residual:  # the summed output also receives a gradient (the next residual branch)
            grads.append(_randn((rows, hidden), dtype, device))
        return Case(args, tuple(grads))

    return build


def _gated_norm_case(dims, dtype, device):
    shape = (dims["rows"], dims["H"])
    args = {
        "x": _randn(shape, dtype, device, True), "gate": _randn(shape, dtype, device, True),
        "weight": _randn(dims["H"], dtype, device, True),
    }
    return Case(args, (_randn(shape, dtype, device),))


def _rope_case(tables="rotate_half", mrope_section=None):
    """q and k as a Hugging Face attention layer hands them over: [B, T, H, D] projections viewed
    as [B, H, T, D] by a transpose, so the head axis is not the outer one in memory. Tables as the
    model's rotary embedding gives them: ``rotate_half`` ``[1, T, D]`` (``cat(freqs, freqs)``),
    ``half`` ``[1, T, D/2]`` (one angle per pair: ``freqs_cis``' parts), or M-RoPE's planes of
    time, height and width angles per sequence, ``mrope`` ``[3, B, T, D]`` (as Liger and the
    pre-5.x Qwen2-VL take them) or ``mrope_half`` ``[3, B, T, D/2]`` (as Qwen3-VL computes them).
    ``mrope_section`` is given for D = 128 and scaled to the case's D (args["mrope_section"])."""

    def build(dims, dtype, device):
        batch, seq_len, head_dim = dims["B"], dims["T"], dims["D"]

        def heads(n_heads, requires_grad=False):
            return _randn((batch, seq_len, n_heads, head_dim), dtype, device).transpose(1, 2).requires_grad_(requires_grad)

        inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, device=device) / head_dim)
        positions = torch.arange(seq_len, device=device)
        if tables.startswith("mrope"):  # a text prefix then an image: the three positions differ
            positions = torch.stack((positions, positions // 7, positions % 7))[:, None].expand(3, batch, seq_len)
        angles = positions[..., None] * inv_freq  # [T, D/2] or [3, B, T, D/2]
        if tables in ("rotate_half", "mrope"):
            angles = torch.cat((angles, angles), dim=-1)
        if not tables.startswith("mrope"):
            angles = angles[None]
        args = {
            "q": heads(dims["Hq"], True), "k": heads(dims["Hk"], True),
            "cos": angles.cos().to(dtype), "sin": angles.sin().to(dtype),
        }
        if mrope_section is not None:
            t, h, _ = (size * head_dim // 128 for size in mrope_section)
            args["mrope_section"] = (t, h, head_dim // 2 - t - h)
        return Case(args, (heads(dims["Hq"]), heads(dims["Hk"])))

    return build


def _gated_case(dims, dtype, device):
    shape = (dims["rows"], dims["I"])
    args = {"gate": _randn(shape, dtype, device, True), "up": _randn(shape, dtype, device, True)}
    return Case(args, (_randn(shape, dtype, device),))


def _activation_case(dims, dtype, device):
    shape = (dims["rows"], dims["I"])
    return Case({"x": _randn(shape, dtype, device, True)}, (_randn(shape, dtype, device),))


def _interleaved_gated_case(dims, dtype, device):
    # Spread past GPT-OSS's limit of 7 (scale 4: ~8% of the gates, a sixth of the ups are clamped).
    rows, inter = dims["rows"], dims["I"]
    args = {"gate_up": _randn((rows, 2 * inter), dtype, device, True, scale=4.0)}
    return Case(args, (_randn((rows, inter), dtype, device),))


def _cross_entropy_case(dims, dtype, device):
    rows, vocab = dims["rows"], dims["V"]
    args = {
        "logits": _randn((rows, vocab), dtype, device, True),
        "target": torch.randint(0, vocab, (rows,), device=device),
    }
    return Case(args, (None,))


def _fused_linear_case(dims, dtype, device):
    rows, hidden, vocab = dims["rows"], dims["H"], dims["V"]
    # weight ~ N(0, 1/H) gives unit-variance logits, as at initialisation: a flat softmax, the
    # hard case for providers that skip the gradient where the softmax is negligible (CCE).
    args = {
        "input": _randn((rows, hidden), dtype, device, True),
        "weight": _randn((vocab, hidden), dtype, device, True, scale=hidden**-0.5),
        "target": torch.randint(0, vocab, (rows,), device=device),
    }
    return Case(args, (None,))


def _logprobs_case(uniform: bool):
    """The rows TRL's fused LM head is handed: labelled positions only (its forward drops the
    others first). The log-probs' gradient is the same for every token for a mean NLL (SFT), one
    per token otherwise (GRPO's ratio times advantage)."""

    def build(dims, dtype, device):
        case = _fused_linear_case(dims, dtype, device)
        rows = dims["rows"]
        grad = torch.full((rows,), -1.0 / rows, device=device) if uniform else torch.randn(rows, device=device)
        return Case(case.args, (grad,))

    return build


def _logprobs_flops(dims, element_size):
    # Forward: the logits. Backward: recomputed logits, then dX and dW: the loss's per-token
    # gradient only exists after the forward's outputs were read, so without keeping the [N, V]
    # logits the logits are computed twice.
    nhv = dims["rows"] * dims["H"] * dims["V"]
    return 2 * nhv, 6 * nhv


def _preference_case(paired: bool, with_reference: bool):
    """A preference batch as the trainers hand it over: ``S`` sequences of ``T`` tokens (``B``
    pairs, or ``B`` unpaired sequences), prompts masked, the policy head trainable and the
    reference model's hidden states and head frozen."""

    def build(dims, dtype, device):
        n_sequences = 2 * dims["B"] if paired else dims["B"]
        seq_len, hidden, vocab = dims["T"], dims["H"], dims["V"]
        target = torch.randint(0, vocab, (n_sequences, seq_len), device=device)
        target[:, : seq_len // 4] = -100
        args = {
            "input": _randn((n_sequences, seq_len, hidden), dtype, device, True),
            "weight": _randn((vocab, hidden), dtype, device, True, scale=hidden**-0.5),
            "target": target,
        }
        if with_reference:
            args["ref_input"] = _randn((n_sequences, seq_len, hidden), dtype, device)
            args["ref_weight"] = _randn((vocab, hidden), dtype, device, scale=hidden**-0.5)
        if not paired:
            args["preference_labels"] = torch.arange(n_sequences, device=device) % 2 == 0
        return Case(args, (None,))

    return build


def _preference_flops(with_reference: bool, paired: bool):
    # The policy's logits forward and both matmuls of backward, as the fused linear cross entropy,
    # plus the reference's logits (forward only).
    def work(dims, element_size):
        n_sequences = 2 * dims["B"] if paired else dims["B"]
        nhv = n_sequences * dims["T"] * dims["H"] * dims["V"]
        return 2 * nhv * (2 if with_reference else 1), 4 * nhv

    return work


def _grpo_case(with_reference: bool):
    """A GRPO batch: ``B`` completions of ``T`` tokens (a quarter of them padding in every other
    completion), one advantage each, the sampling policy's log-probs and, with a reference model,
    its log-probs and a KL weight of 0.04 (TRL's default loss type, dapo)."""

    def build(dims, dtype, device):
        n_completions, seq_len, hidden, vocab = dims["B"], dims["T"], dims["H"], dims["V"]
        mask = torch.ones((n_completions, seq_len), dtype=torch.bool, device=device)
        mask[::2, -seq_len // 4:] = False

        def logps():
            return torch.randn((n_completions, seq_len), device=device) * 0.1 - math.log(vocab)

        args = {
            "input": _randn((n_completions, seq_len, hidden), dtype, device, True),
            "weight": _randn((vocab, hidden), dtype, device, True, scale=hidden**-0.5),
            "completion_ids": torch.randint(0, vocab, (n_completions, seq_len), device=device),
            "completion_mask": mask,
            "advantages": torch.randn(n_completions, device=device),
            "old_per_token_logps": logps(),
            "ref_per_token_logps": logps() if with_reference else None,
            "beta": 0.04 if with_reference else 0.0,
        }
        return Case(args, (None,))

    return build


def _grpo_flops(dims, element_size):
    # The policy's logits forward and both matmuls of backward, as the fused linear cross entropy.
    nhv = dims["B"] * dims["T"] * dims["H"] * dims["V"]
    return 2 * nhv, 4 * nhv


GRPO_SWEEP = Sweep("T", (1024, 2048, 4096), 1024, {"B": 8, "H": 4096, "V": 128256})
GRPO_SMOKE = Sweep("T", (7, 12), 12, {"B": 2, "H": 32, "V": 300})


def _distribution_case(input_kind: str, target_kind: str):
    """Student and teacher distributions over ``V`` for ``rows`` tokens, as log-probs or probs;
    the student's requires grad."""

    def distribution(rows, vocab, kind, dtype, device, requires_grad=False):
        log_probs = torch.randn((rows, vocab), device=device).log_softmax(-1)
        values = log_probs if kind == "log_probs" else log_probs.exp()
        return values.to(dtype).requires_grad_(requires_grad)

    def build(dims, dtype, device):
        rows, vocab = dims["rows"], dims["V"]
        args = {
            "input": distribution(rows, vocab, input_kind, dtype, device, True),
            "target": distribution(rows, vocab, target_kind, dtype, device),
        }
        return Case(args, (None,))

    return build


def _fused_linear_distillation_case(dims, dtype, device):
    rows, hidden, vocab = dims["rows"], dims["H"], dims["V"]
    args = {
        "input": _randn((rows, hidden), dtype, device, True),
        "weight": _randn((vocab, hidden), dtype, device, True, scale=hidden**-0.5),
        "teacher_input": _randn((rows, hidden), dtype, device),
        "teacher_weight": _randn((vocab, hidden), dtype, device, scale=hidden**-0.5),
    }
    return Case(args, (None,))


def _fused_linear_distillation_flops(dims, element_size):
    # Forward: the student's and the teacher's logits. Backward: the student's two matmuls.
    nhv = dims["rows"] * dims["H"] * dims["V"]
    return 4 * nhv, 4 * nhv


def _elements(*names):
    return lambda dims: math.prod(dims[name] for name in names)


def _tensor_passes(count, forward, backward):
    """Work of an op that streams ``forward`` then ``backward`` tensors of ``count(dims)`` elements."""
    return lambda dims, element_size: (
        forward * count(dims) * element_size, backward * count(dims) * element_size
    )


def _rope_elements(dims):
    return dims["B"] * dims["T"] * dims["D"] * (dims["Hq"] + dims["Hk"])


def _mrope_work(table_width):
    """RoPE's traffic plus M-RoPE's cos and sin planes ``[3, B, T, table_width(D)]``, read once in
    each direction: 7.5% more than the heads at the headline shape with full-width planes."""

    def work(dims, element_size):
        heads = 2 * _rope_elements(dims)
        tables = 2 * 3 * dims["B"] * dims["T"] * table_width(dims["D"])
        return (heads + tables) * element_size, (heads + tables) * element_size

    return work


ROPE_SWEEP = Sweep("T", (512, 1024, 2048, 4096, 8192), 4096, {"B": 4, "Hq": 32, "Hk": 8, "D": 128})
ROPE_SMOKE = Sweep("T", (24, 64), 64, {"B": 1, "Hq": 4, "Hk": 2, "D": 32})
ROPE_SHAPE = "q [{B}, {Hq}, {T}, {D}], k [{B}, {Hk}, {T}, {D}]"


def _fused_linear_flops(dims, element_size):
    # Forward: the logits X·Wᵀ (2·N·H·V). Backward: dX = dZ·W and dW = dZᵀ·X (2·N·H·V each).
    # Providers that recompute the logits in backward do more; this is the floor.
    nhv = dims["rows"] * dims["H"] * dims["V"]
    return 2 * nhv, 4 * nhv


def _lora_linear_case(dims, dtype, device):
    # PEFT's default adapters: fp32 on a model of another dtype; the base weight frozen.
    n_in, n_out, rank = dims["in"], dims["out"], dims["r"]
    adapter_dtype = torch.float32
    args = {
        "x": _randn((dims["rows"], n_in), dtype, device, True),
        "weight": _randn((n_out, n_in), dtype, device, scale=n_in**-0.5),
        "lora_a": _randn((rank, n_in), adapter_dtype, device, True, scale=n_in**-0.5),
        "lora_b": _randn((n_out, rank), adapter_dtype, device, True, scale=rank**-0.5),
    }
    return Case(args, (_randn((dims["rows"], n_out), dtype, device),))


def _lora_linear_flops(dims, element_size):
    # Forward: the base matmul and the adapter's two skinny ones. Backward with the base frozen:
    # dX = dY·W, and the adapter's four skinny ones (dY·B, dA, dB, (dY·B)·A).
    base = 2 * dims["rows"] * dims["in"] * dims["out"]
    skinny = 2 * dims["rows"] * dims["r"] * (dims["in"] + dims["out"])
    return base + skinny, base + 2 * skinny


VOCAB_SIZES = (32000, 65536, 128256, 151936, 262144)
# The preference losses at issue 5's shape: B = 4 pairs (8 sequences), H = 4096, V = 128256.
PREFERENCE_SWEEP = Sweep("T", (512, 1024, 2048), 1024, {"B": 4, "H": 4096, "V": 128256})
PREFERENCE_SMOKE = Sweep("T", (7, 12), 12, {"B": 2, "H": 32, "V": 300})


NORM_SWEEP = Sweep("H", (1024, 2048, 4096, 8192, 16384), 4096, {"rows": 16384})
NORM_SMOKE = Sweep("H", (96, 256), 256, {"rows": 48})


# The FP8 losses, and the recipe of each. Their PyTorch reference (tigon.testing.reference) is an
# oracle on fake-quantized operands in fp32, not a way to train: it is not timed as a peer (the
# peers are torchao's Float8Linear head, eager and compiled).
FP8_OPS = {"fused_linear_cross_entropy_fp8": "rowwise", "fused_linear_cross_entropy_fp8_tensorwise": "tensorwise"}

OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        # Forward reads x, writes y; backward reads x and dy, writes dx.
        OpSpec(
            "rms_norm", "x [{rows}, {H}]", sweep=NORM_SWEEP, smoke=NORM_SMOKE, build=_norm_case(),
            call=lambda f, a: f.rms_norm(a["x"], a["weight"]),
            work=_tensor_passes(_elements("rows", "H"), 2, 3),
        ),
        # Forward reads x and residual, writes y and the sum; backward reads the sum, dy and the
        # gradient of the sum, writes dx (the same tensor is the residual's gradient).
        OpSpec(
            "fused_add_rms_norm", "x, residual [{rows}, {H}]", sweep=NORM_SWEEP, smoke=NORM_SMOKE,
            build=_norm_case(with_residual=True),
            call=lambda f, a: f.fused_add_rms_norm(a["x"], a["residual"], a["weight"]),
            work=_tensor_passes(_elements("rows", "H"), 4, 4),
        ),
        # Forward reads x and gate, writes y; backward reads x, gate and dy, writes dx and dgate.
        # Swept over rows at Qwen3-Next's head_v_dim 128 (the norm runs per value head): 262144
        # rows are 8192 tokens of its 32 value heads.
        OpSpec(
            "rms_norm_gated", "x, gate [{rows}, {H}]",
            sweep=Sweep("rows", (65536, 131072, 262144, 524288), 262144, {"H": 128}),
            smoke=Sweep("rows", (48, 96), 96, {"H": 128}),
            build=_gated_norm_case,
            call=lambda f, a: f.rms_norm_gated(a["x"], a["gate"], a["weight"]),
            work=_tensor_passes(_elements("rows", "H"), 3, 5),
        ),
        OpSpec(
            "layer_norm", "x [{rows}, {H}]", sweep=NORM_SWEEP, smoke=NORM_SMOKE, build=_norm_case(with_bias=True),
            call=lambda f, a: f.layer_norm(a["x"], a["weight"], a["bias"]),
            work=_tensor_passes(_elements("rows", "H"), 2, 3),
        ),
        # Nemotron's NemotronLayerNorm1P, layer_norm(x, weight + 1, bias): the same traffic.
        OpSpec(
            "layer_norm_1p", "x [{rows}, {H}], weight + 1", sweep=NORM_SWEEP, smoke=NORM_SMOKE,
            build=_norm_case(with_bias=True),
            call=lambda f, a: f.layer_norm(a["x"], a["weight"], a["bias"], offset=1.0),
            work=_tensor_passes(_elements("rows", "H"), 2, 3),
        ),
        # q and k read and written in forward; dq and dk read and written in backward.
        OpSpec(
            "rope", ROPE_SHAPE, sweep=ROPE_SWEEP, smoke=ROPE_SMOKE, build=_rope_case(),
            call=lambda f, a: f.rope(a["q"], a["k"], a["cos"], a["sin"]),
            work=_tensor_passes(_rope_elements, 2, 2),
        ),
        # The interleaved-pair forms, same traffic: Llama 4's and DeepSeek V2's complex
        # apply_rotary_emb (freqs_cis [1, T, D/2]) and DeepSeek V3's, whose output is half-split.
        OpSpec(
            "rope_interleaved", ROPE_SHAPE + ", interleaved pairs", sweep=ROPE_SWEEP, smoke=ROPE_SMOKE,
            build=_rope_case("half"),
            call=lambda f, a: f.rope(a["q"], a["k"], a["cos"], a["sin"], interleaved=True),
            work=_tensor_passes(_rope_elements, 2, 2),
        ),
        OpSpec(
            "rope_deinterleave", ROPE_SHAPE + ", interleaved in, half-split out", sweep=ROPE_SWEEP, smoke=ROPE_SMOKE,
            build=_rope_case("half"),
            call=lambda f, a: f.rope(a["q"], a["k"], a["cos"], a["sin"], interleaved=True, deinterleave_output=True),
            work=_tensor_passes(_rope_elements, 2, 2),
        ),
        # Multimodal RoPE read from its three planes: Qwen2-VL's sections (16, 24, 24) over
        # full-width planes, Qwen3-VL's interleaved assignment (24, 20, 20) over half-width ones.
        OpSpec(
            "rope_mrope", ROPE_SHAPE + ", M-RoPE planes [3, {B}, {T}, {D}]", sweep=ROPE_SWEEP, smoke=ROPE_SMOKE,
            build=_rope_case("mrope", (16, 24, 24)),
            call=lambda f, a: f.rope(a["q"], a["k"], a["cos"], a["sin"], mrope_section=a["mrope_section"]),
            work=_mrope_work(lambda head_dim: head_dim),
        ),
        OpSpec(
            "rope_mrope_interleaved", ROPE_SHAPE + ", interleaved M-RoPE planes [3, {B}, {T}, {D}/2]",
            sweep=ROPE_SWEEP, smoke=ROPE_SMOKE,
            build=_rope_case("mrope_half", (24, 20, 20)),
            call=lambda f, a: f.rope(
                a["q"], a["k"], a["cos"], a["sin"], mrope_section=a["mrope_section"], mrope_interleaved=True,
            ),
            work=_mrope_work(lambda head_dim: head_dim // 2),
        ),
        # Forward reads gate and up, writes the product; backward reads gate, up and the output
        # gradient, writes both input gradients (the activation is recomputed, not stored).
        *(
            OpSpec(
                name, "gate, up [{rows}, {I}]",
                sweep=Sweep("I", (4096, 8192, 11008, 14336, 18944), 14336, {"rows": 16384}),
                smoke=Sweep("I", (96, 256), 256, {"rows": 48}),
                build=_gated_case,
                call=call,
                work=_tensor_passes(_elements("rows", "I"), 3, 5),
            )
            for name, call in (
                ("swiglu", lambda f, a: f.swiglu(a["gate"], a["up"])),
                ("geglu", lambda f, a: f.geglu(a["gate"], a["up"])),
            )
        ),
        # GPT-OSS's clamped SwiGLU on the interleaved [rows, 2I] projection, at its expert width
        # 2880: 32768 rows are 8192 tokens routed to 4 experts each. Traffic as the gates above.
        OpSpec(
            "swiglu_clamped", "gate_up [{rows}, 2·{I}] interleaved",
            sweep=Sweep("rows", (8192, 16384, 32768, 65536), 32768, {"I": 2880}),
            smoke=Sweep("rows", (24, 48), 48, {"I": 96}),
            build=_interleaved_gated_case,
            call=lambda f, a: f.swiglu_clamped(a["gate_up"]),
            work=_tensor_passes(_elements("rows", "I"), 3, 5),
        ),
        # Nemotron's squared ReLU: forward reads x, writes the output; backward reads x and the
        # output gradient, writes dx.
        OpSpec(
            "relu2", "x [{rows}, {I}]",
            sweep=Sweep("I", (4096, 8192, 16384, 24576), 16384, {"rows": 16384}),
            smoke=Sweep("I", (96, 256), 256, {"rows": 48}),
            build=_activation_case,
            call=lambda f, a: f.relu2(a["x"]),
            work=_tensor_passes(_elements("rows", "I"), 2, 3),
        ),
        # Three passes over the logits: the logsumexp must be known before any gradient element
        # (softmax − one-hot) can be written, and a row of 32K-262K logits does not stay on chip,
        # so the logits are read twice and the gradient written once. Forward is counted as the
        # loss alone (one read), backward as the gradient (one read, one write); providers that
        # write the gradient during forward do all three passes there.
        OpSpec(
            "cross_entropy", "logits [{rows}, {V}]",
            sweep=Sweep("V", VOCAB_SIZES, 128256, {"rows": 8192}),
            smoke=Sweep("V", (500, 1000), 1000, {"rows": 32}),
            build=_cross_entropy_case,
            call=lambda f, a: f.cross_entropy(a["logits"], a["target"]),
            work=_tensor_passes(_elements("rows", "V"), 1, 2),
        ),
        OpSpec(
            "fused_linear_cross_entropy", "x [{rows}, {H}], W [{V}, {H}]",
            sweep=Sweep("V", VOCAB_SIZES, 128256, {"rows": 8192, "H": 4096}),
            smoke=Sweep("V", (500, 1000), 1000, {"rows": 32, "H": 64}),
            build=_fused_linear_case,
            call=lambda f, a: f.fused_linear_cross_entropy(a["input"], a["weight"], a["target"]),
            work=_fused_linear_flops,
            unit=FLOPS,
        ),
        # The same loss with the head's matmuls in FP8, by torchao's rowwise and tensorwise recipes:
        # the work is the same FLOPs, at the FP8 tensor cores' rate; against tigon's bf16 loss above
        # in one run.
        *(
            OpSpec(
                name, f"x [{{rows}}, {{H}}], W [{{V}}, {{H}}], {recipe} FP8",
                sweep=Sweep("V", VOCAB_SIZES, 128256, {"rows": 8192, "H": 4096}),
                smoke=Sweep("V", (496, 1008), 1008, {"rows": 32, "H": 64}),
                build=_fused_linear_case,
                call=lambda f, a, recipe=recipe: f.fused_linear_cross_entropy(
                    a["input"], a["weight"], a["target"], fp8=recipe),
                work=_fused_linear_flops,
                unit=FLOPS,
            )
            for name, recipe in FP8_OPS.items()
        ),
        # A LoRA linear layer (PEFT's lora.Linear: frozen bf16 base, fp32 adapters r 16) at the
        # projections of Llama-3-8B: k/v (1024), q/o (4096), gate/up (14336), 16384 tokens.
        OpSpec(
            "lora_linear", "x [{rows}, {in}], W [{out}, {in}], r {r}",
            sweep=Sweep("out", (1024, 4096, 14336), 14336, {"rows": 16384, "in": 4096, "r": 16}),
            smoke=Sweep("out", (40, 96), 96, {"rows": 48, "in": 64, "r": 4}),
            build=_lora_linear_case,
            call=lambda f, a: f.lora_linear(a["x"], a["weight"], a["lora_a"], a["lora_b"], 2.0),
            work=_lora_linear_flops,
            unit=FLOPS,
        ),
        # TRL's fused LM head: per-token log-probs under any per-token gradient (GRPO, DPO) ...
        OpSpec(
            "fused_linear_logprobs", "x [{rows}, {H}], W [{V}, {H}], per-token gradient",
            sweep=Sweep("V", (32000, 128256, 151936), 128256, {"rows": 8192, "H": 4096}),
            smoke=Sweep("V", (500, 1000), 1000, {"rows": 32, "H": 64}),
            build=_logprobs_case(uniform=False),
            call=lambda f, a: f.fused_linear_logprobs(a["input"], a["weight"], a["target"])[0],
            work=_logprobs_flops,
            unit=FLOPS,
        ),
        # ... and as SFTTrainer runs it: entropy and top-1 for its metrics, a mean NLL's gradient.
        OpSpec(
            "fused_linear_logprobs_sft", "x [{rows}, {H}], W [{V}, {H}], + entropy, top-1",
            sweep=Sweep("V", (32000, 128256, 151936), 128256, {"rows": 8192, "H": 4096}),
            smoke=Sweep("V", (500, 1000), 1000, {"rows": 32, "H": 64}),
            build=_logprobs_case(uniform=True),
            call=lambda f, a: f.fused_linear_logprobs(
                a["input"], a["weight"], a["target"], outputs=("log_probs", "entropy", "is_top1"),
            )[0],
            work=_fused_linear_flops,
            unit=FLOPS,
        ),
        # Distillation: forward reads the student's and the teacher's rows, backward writes the
        # student's gradient (the teacher is a constant). Both distributions are given in full.
        *(
            OpSpec(
                name, "student, teacher [{rows}, {V}]",
                sweep=Sweep("V", VOCAB_SIZES, 128256, {"rows": 8192}),
                smoke=Sweep("V", (500, 1000), 1000, {"rows": 32}),
                build=_distribution_case(*kinds),
                call=call,
                work=_tensor_passes(_elements("rows", "V"), 2, 1),
            )
            for name, kinds, call in (
                ("kl_div", ("log_probs", "probs"), lambda f, a: f.kl_div(a["input"], a["target"], reduction="batchmean")),
                ("jsd", ("log_probs", "log_probs"), lambda f, a: f.jsd(a["input"], a["target"])),
                ("tvd", ("probs", "probs"), lambda f, a: f.tvd(a["input"], a["target"])),
            )
        ),
        OpSpec(
            "fused_linear_jsd", "x, x_teacher [{rows}, {H}], W, W_teacher [{V}, {H}]",
            sweep=Sweep("V", (32000, 128256), 128256, {"rows": 8192, "H": 4096}),
            smoke=Sweep("V", (500, 1000), 1000, {"rows": 32, "H": 64}),
            build=_fused_linear_distillation_case,
            call=lambda f, a: f.fused_linear_jsd(**a),
            work=_fused_linear_distillation_flops,
            unit=FLOPS,
        ),
        # Preference losses (the reference functions' names; tigon's provider maps them to
        # tigon.losses). The loss alone is timed; metrics are computed and returned by all.
        OpSpec(
            "dpo", "x [2·{B}, {T}, {H}], W [{V}, {H}], reference model",
            sweep=PREFERENCE_SWEEP, smoke=PREFERENCE_SMOKE, build=_preference_case(True, True),
            call=lambda f, a: f.dpo_loss(**a)[0], work=_preference_flops(True, True), unit=FLOPS,
        ),
        OpSpec(
            "orpo", "x [2·{B}, {T}, {H}], W [{V}, {H}]",
            sweep=PREFERENCE_SWEEP, smoke=PREFERENCE_SMOKE, build=_preference_case(True, False),
            call=lambda f, a: f.orpo_loss(**a)[0], work=_preference_flops(False, True), unit=FLOPS,
        ),
        OpSpec(
            "simpo", "x [2·{B}, {T}, {H}], W [{V}, {H}]",
            sweep=PREFERENCE_SWEEP, smoke=PREFERENCE_SMOKE, build=_preference_case(True, False),
            call=lambda f, a: f.simpo_loss(**a)[0], work=_preference_flops(False, True), unit=FLOPS,
        ),
        # GRPO (dapo), with and without a reference model's log-probs (a KL term).
        OpSpec(
            "grpo", "x [{B}, {T}, {H}], W [{V}, {H}], dapo",
            sweep=GRPO_SWEEP, smoke=GRPO_SMOKE, build=_grpo_case(False),
            call=lambda f, a: f.grpo_loss(**a)[0], work=_grpo_flops, unit=FLOPS,
        ),
        OpSpec(
            "grpo_ref", "x [{B}, {T}, {H}], W [{V}, {H}], dapo, β 0.04 KL",
            sweep=GRPO_SWEEP, smoke=GRPO_SMOKE, build=_grpo_case(True),
            call=lambda f, a: f.grpo_loss(**a)[0], work=_grpo_flops, unit=FLOPS,
        ),
        OpSpec(
            "kto", "x [{B}, {T}, {H}] unpaired, W [{V}, {H}], reference model",
            sweep=Sweep("T", PREFERENCE_SWEEP.sizes, PREFERENCE_SWEEP.headline, {**PREFERENCE_SWEEP.dims, "B": 8}),
            smoke=PREFERENCE_SMOKE, build=_preference_case(False, True),
            call=lambda f, a: f.kto_loss(**a)[0], work=_preference_flops(True, False), unit=FLOPS,
        ),
    )
}
