"""``tigon check``: the environment, then every op once against its fp64 reference.

For each op it runs forward and backward through tigon in bf16 (fp32 where noted) and through
the plain-PyTorch reference in fp64 on the same input values, and prints the largest relative
error (‖out − truth‖ / ‖truth‖) over the outputs and over every input gradient (RoPE's tables
included; a gradient tigon does not compute counts as an infinite error), and the time of one
tigon forward + backward (wall clock, after a warm-up call; through the interpreter on a CPU-only
machine, where it says nothing about GPU speed).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from tigon import functional as F
from tigon.testing import reference
from tigon.ops._launch import interpreting

# Relative error allowed against the fp64 truth, per dtype (as the test suite).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass
class Case:
    name: str
    shape: str
    make_inputs: Callable[[torch.device, torch.dtype, bool], dict]
    run: Callable[[object, dict], object]
    dtype: torch.dtype = torch.bfloat16


def _randn(device, dtype, *shape, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _cases(small: bool) -> list[Case]:
    rows, hidden = (64, 200) if small else (4096, 4096)
    batch, q_heads, k_heads, seq, head_dim = (1, 4, 2, 24, 32) if small else (2, 32, 8, 2048, 128)
    inter = 300 if small else 14336
    group = hidden // 8  # rms_norm_gated normalising per group of features (Falcon-H1, Zamba2)
    expert_inter = 150 if small else 2880  # GPT-OSS's clamped SwiGLU, at its expert width
    n_tokens, vocab, lm_hidden = (48, 1000, 64) if small else (4096, 128256, 4096)
    # A MoE layer's experts: Qwen3-30B-A3B's (128 experts, top-8, H 2048, I 768) on a GPU.
    moe_tokens, n_experts, top_k, moe_hidden, moe_inter = (40, 6, 2, 64, 40) if small else (8192, 128, 8, 2048, 768)

    def norm_inputs(device, dtype, residual):
        inputs = {"x": _randn(device, dtype, rows, hidden), "weight": _randn(device, dtype, hidden)}
        if residual:
            inputs["residual"] = _randn(device, dtype, rows, hidden)
        return inputs

    def gated_norm_inputs(device, dtype, _):
        return {**norm_inputs(device, dtype, False), "gate": _randn(device, dtype, rows, hidden)}

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

        def make(device, dtype, _):
            leading = (3, batch, seq) if mrope else (1, seq)
            angles = torch.rand(*leading, rotary_dim // 2, device=device) * 6.28
            if tables == "full":
                angles = torch.cat((angles, angles), dim=-1)
            elif tables == "full_interleaved":
                angles = angles.repeat_interleave(2, dim=-1)
            inputs = {"q": _randn(device, dtype, batch, seq, q_heads, head_dim).transpose(1, 2)}
            if with_k:
                inputs["k"] = _randn(device, dtype, batch, seq, k_heads, head_dim).transpose(1, 2)
            return {**inputs, "cos": angles.cos().to(dtype), "sin": angles.sin().to(dtype)}

        return make

    def rope_case(name, shape_note, make_inputs, **options):
        return Case(
            name, f"q [{batch}, {q_heads}, {seq}, {head_dim}]{shape_note}", make_inputs,
            lambda m, i: m.rope(i["q"], i.get("k"), i["cos"], i["sin"], **options),
        )

    def gate_inputs(device, dtype, _):
        return {"gate": _randn(device, dtype, rows, inter), "up": _randn(device, dtype, rows, inter)}

    def relu2_inputs(device, dtype, _):
        return {"x": _randn(device, dtype, rows, inter)}

    def gate_up_inputs(device, dtype, _):
        # Scale 4 spreads past GPT-OSS's limit of 7: some gates and ups are clamped.
        return {"gate_up": _randn(device, dtype, rows, 2 * expert_inter, scale=4.0)}

    def ce_inputs(device, dtype, _):
        target = torch.randint(0, vocab, (n_tokens,), device=device)
        target[::7] = -100
        return {"logits": _randn(device, dtype, n_tokens, vocab, scale=4.0), "target": target}

    def flce_inputs(device, dtype, _):
        target = torch.randint(0, vocab, (n_tokens,), device=device)
        target[::7] = -100
        return {
            "input": _randn(device, dtype, n_tokens, lm_hidden),
            "weight": _randn(device, dtype, vocab, lm_hidden, scale=lm_hidden**-0.5),
            "target": target,
        }

    def lora_inputs(device, dtype, _):
        rank = 16
        return {
            "x": _randn(device, dtype, rows, hidden),
            "weight": _randn(device, dtype, inter, hidden, scale=hidden**-0.5),
            "lora_a": _randn(device, dtype, rank, hidden, scale=hidden**-0.5),
            "lora_b": _randn(device, dtype, inter, rank, scale=rank**-0.5),
        }

    def moe_inputs(device, dtype, _):
        weights, index = torch.softmax(torch.randn(moe_tokens, n_experts, device=device), dim=-1).topk(top_k, dim=-1)
        return {
            "hidden_states": _randn(device, dtype, moe_tokens, moe_hidden),
            "top_k_index": index,
            "top_k_weights": weights,
            "gate_up_proj": _randn(device, dtype, n_experts, 2 * moe_inter, moe_hidden, scale=moe_hidden**-0.5),
            "down_proj": _randn(device, dtype, n_experts, moe_hidden, moe_inter, scale=moe_inter**-0.5),
        }

    def ln_inputs(device, dtype, _):
        return {**norm_inputs(device, dtype, False), "bias": _randn(device, dtype, hidden)}

    return [
        Case("rms_norm", f"[{rows}, {hidden}]", lambda d, t, _: norm_inputs(d, t, False), lambda m, i: m.rms_norm(**i)),
        Case(
            "fused_add_rms_norm", f"[{rows}, {hidden}]", lambda d, t, _: norm_inputs(d, t, True),
            lambda m, i: m.fused_add_rms_norm(**i),
        ),
        Case("rms_norm_gated", f"[{rows}, {hidden}]", gated_norm_inputs, lambda m, i: m.rms_norm_gated(**i)),
        Case(
            "rms_norm_gated_grouped", f"[{rows}, {hidden}], groups of {group}", gated_norm_inputs,
            lambda m, i: m.rms_norm_gated(**i, group_size=group, norm_before_gate=False),
        ),
        Case("layer_norm", f"[{rows}, {hidden}]", ln_inputs, lambda m, i: m.layer_norm(**i)),
        Case("layer_norm_1p", f"[{rows}, {hidden}], weight + 1", ln_inputs, lambda m, i: m.layer_norm(**i, offset=1.0)),
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
        Case("swiglu", f"[{rows}, {inter}]", gate_inputs, lambda m, i: m.swiglu(**i)),
        Case("geglu", f"[{rows}, {inter}]", gate_inputs, lambda m, i: m.geglu(**i)),
        Case("relu2", f"[{rows}, {inter}]", relu2_inputs, lambda m, i: m.relu2(**i)),
        Case(
            "swiglu_clamped", f"[{rows}, 2·{expert_inter}] interleaved", gate_up_inputs,
            lambda m, i: m.swiglu_clamped(**i),
        ),
        Case(
            "lora_linear", f"[{rows}, {hidden}] x [{inter}, {hidden}], r 16", lora_inputs,
            lambda m, i: m.lora_linear(**i, scaling=2.0),
        ),
        Case(
            "moe_experts", f"[{moe_tokens}, {moe_hidden}], {n_experts} experts top-{top_k}, I {moe_inter}", moe_inputs,
            lambda m, i: m.moe_experts(**i),
        ),
        Case("cross_entropy", f"[{n_tokens}, {vocab}]", ce_inputs, lambda m, i: m.cross_entropy(**i)),
        Case(
            "fused_linear_cross_entropy", f"[{n_tokens}, {lm_hidden}] x [{vocab}, {lm_hidden}]", flce_inputs,
            lambda m, i: m.fused_linear_cross_entropy(**i),
        ),
    ]


def _relative_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    actual, truth = actual.detach().double(), truth.detach().double()
    scale = truth.norm().item()
    return (actual - truth).norm().item() / (scale if scale > 0 else 1.0)


def _forward_backward(module, run, inputs, grad_seed: int):
    inputs = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    outputs = run(module, inputs)
    outputs = tuple(o for o in (outputs if isinstance(outputs, tuple) else (outputs,)) if o is not None)
    generator = torch.Generator(device=outputs[0].device).manual_seed(grad_seed)
    grads = [torch.randn(o.shape, device=o.device, generator=generator).to(o.dtype) for o in outputs]
    torch.autograd.backward(outputs, grads)
    input_grads = {k: v.grad for k, v in inputs.items() if v.grad is not None}
    return outputs, input_grads


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment_lines(device: torch.device) -> list[str]:
    if device.type == "cuda":
        where = f"GPU: {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        where = "no GPU: kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1)"
    return [
        f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}",
        where,
    ]


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = device.type != "cuda" or interpreting()
    for line in environment_lines(device):
        print(line)
    header = f"{'op':<28}{'shape':<40}{'dtype':<10}{'output err':>12}{'grad err':>12}{'limit':>9}{'time (ms)':>11}  ok"
    print(header)
    print("-" * len(header))
    failures = 0
    torch.manual_seed(0)
    for case in _cases(small):
        inputs = case.make_inputs(device, case.dtype, False)
        _forward_backward(F, case.run, inputs, grad_seed=1)
        _sync(device)
        start = time.perf_counter()
        outputs, grads = _forward_backward(F, case.run, inputs, grad_seed=1)
        _sync(device)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
        truths, truth_grads = _forward_backward(reference, case.run, inputs64, grad_seed=1)
        output_error = max(_relative_error(o, t) for o, t in zip(outputs, truths))
        # A gradient the reference has and tigon lacks is a failure, never a skipped comparison.
        grad_error = max(_relative_error(grads[k], t) if k in grads else float("inf") for k, t in truth_grads.items())
        limit = TOLERANCE[case.dtype]
        ok = output_error <= limit and grad_error <= limit
        failures += not ok
        dtype = str(case.dtype).removeprefix("torch.")
        print(
            f"{case.name:<28}{case.shape:<40}{dtype:<10}{output_error:>12.2e}{grad_error:>12.2e}"
            f"{limit:>9.0e}{elapsed_ms:>11.2f}  {'yes' if ok else 'NO'}"
        )
    print(f"{len(_cases(small)) - failures} passed, {failures} failed")
    return 1 if failures else 0
