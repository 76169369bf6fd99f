"""Plain-PyTorch references, one per op: the truth for tests, ``tigon check`` and the ``torch`` providers of ``tigon bench``.

Each follows what Hugging Face's eager modules compute. Given bf16/fp16 inputs they run as the
eager model does (fp32 math where it upcasts); given fp64 inputs they compute everything in fp64,
which is how the tests obtain a higher-precision truth from the very same input values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    compute = _compute_dtype(x.dtype)
    xf = x.to(compute)
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "llama":
        x_hat = x_hat.to(x.dtype)
        return x_hat if weight is None else (offset + weight).to(x.dtype) * x_hat
    if weight is not None:
        x_hat = x_hat * (offset + weight.to(compute))
    return x_hat.to(x.dtype)


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
    summed = x + residual
    return rms_norm(summed, weight, eps, offset, casting_mode), summed


def rms_norm_gated(x, gate, weight=None, eps=1e-6, group_size=None, norm_before_gate=True, casting_mode="llama"):
    """Qwen3-Next's ``Qwen3NextRMSNormGated`` ("llama", norm before gate), Falcon-H1's
    ``FalconH1RMSNormGated`` ("gemma", ``group_size = H / n_groups``) and Mamba2's
    ``MambaRMSNormGated`` ("llama", gate before norm) in one, with their casts: the gate's
    product in fp32, and in "llama" casting ``weight * x̂.to(x.dtype)`` in torch's promoted dtype."""
    compute = _compute_dtype(x.dtype)
    xf = x.to(compute)
    silu_gate = None if gate is None else F.silu(gate.to(compute))
    if silu_gate is not None and not norm_before_gate:
        xf = xf * silu_gate
    groups = xf.unflatten(-1, (-1, group_size or x.shape[-1]))
    x_hat = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    if casting_mode == "llama":
        x_hat = x_hat.to(x.dtype)
        y = x_hat if weight is None else weight * x_hat
    else:
        y = x_hat if weight is None else x_hat * weight.to(compute)
    if silu_gate is not None and norm_before_gate:
        y = y * silu_gate
    return y.to(x.dtype)


def layer_norm(x, weight=None, bias=None, eps=1e-5, offset=0.0):
    """``F.layer_norm``; ``offset`` is added to the weight in its dtype (Nemotron's ``weight + 1``)."""
    compute = _compute_dtype(x.dtype)
    if weight is not None and offset:
        weight = weight + offset
    out = F.layer_norm(
        x.to(compute), x.shape[-1:],
        None if weight is None else weight.to(compute),
        None if bias is None else bias.to(compute),
        eps,
    )
    return out.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_interleaved_pairs(x):
    """DeepSeek V4's ``rotate_half``: ``(x[2i], x[2i+1]) → (−x[2i+1], x[2i])``."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


# One reference per rotary form, each on the rotated features ``x [..., R]`` with tables that
# broadcast against them, written as the Hugging Face function it names computes.


def rope_rotate_half(x, cos, sin):
    """Llama's ``apply_rotary_pos_emb``: ``x·cos + rotate_half(x)·sin``, tables ``[..., R]``."""
    return x * cos + rotate_half(x) * sin


def rope_half_table(x, cos, sin):
    """GPT-OSS's ``_apply_rotary_emb``: the two halves rotated by tables ``[..., R/2]``."""
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    return torch.cat((first_half * cos - second_half * sin, second_half * cos + first_half * sin), dim=-1)


def rope_complex(x, cos, sin):
    """Llama 4's and DeepSeek V2's ``apply_rotary_emb``: interleaved pairs as complex numbers times
    ``freqs_cis = cos + i·sin`` (tables ``[..., R/2]``), in fp32 (fp64 for fp64 inputs)."""
    real = _compute_dtype(x.dtype)
    pairs = torch.view_as_complex(x.to(real).reshape(*x.shape[:-1], -1, 2).contiguous())
    freqs_cis = torch.complex(cos.to(real), sin.to(real))
    return torch.view_as_real(pairs * freqs_cis).flatten(-2).to(x.dtype)


def rope_interleaved(x, cos, sin):
    """DeepSeek V4's ``apply_rotary_pos_emb`` once its tables are repeated per feature:
    ``x·cos + rotate_interleaved_pairs(x)·sin`` in fp32, tables ``[..., R]`` in the interleaved layout."""
    compute = torch.promote_types(_compute_dtype(x.dtype), cos.dtype)
    return (x.to(compute) * cos + rotate_interleaved_pairs(x).to(compute) * sin).to(x.dtype)


def rope_deinterleave(x, cos, sin):
    """DeepSeek V3's ``apply_rotary_pos_emb_interleave``: interleaved pairs in, half-split out,
    ``cat([x_even·cos − x_odd·sin, x_odd·cos + x_even·sin])`` with tables ``[..., R/2]``. A
    full-width table multiplies the outputs it lines up with: its first half the evens' rotations,
    its second half the odds' (Hugging Face reads only the first half; its halves are equal)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    if cos.shape[-1] == x.shape[-1]:
        (cos_even, cos_odd), (sin_even, sin_odd) = cos.split(half, dim=-1), sin.split(half, dim=-1)
    else:
        cos_even = cos_odd = cos
        sin_even = sin_odd = sin
    return torch.cat((even * cos_even - odd * sin_even, odd * cos_odd + even * sin_odd), dim=-1)


def _mrope_pair_table(planes, mrope_section, interleaved):
    """One table ``[..., R/2]`` (an angle per pair) from the three planes ``[3, ..., R/2]``:
    Qwen2-VL's ``recomposition_frequencies`` (chunk ``i`` of the split by ``mrope_section`` from
    plane ``i % 3``) or Qwen3-VL's interleaved one (plane 1 at ``1, 4, ... < 3h``, plane 2 at
    ``2, 5, ... < 3w``, plane 0 elsewhere)."""
    if not interleaved:
        return torch.cat([chunk[i % 3] for i, chunk in enumerate(planes.split(list(mrope_section), dim=-1))], dim=-1)
    table = planes[0].clone()
    for plane, offset in ((1, 1), (2, 2)):
        pairs = slice(offset, 3 * mrope_section[plane], 3)
        table[..., pairs] = planes[plane][..., pairs]
    return table


def mrope_table(planes, mrope_section, interleaved=False, out_interleaved=False):
    """The combined cos or sin table of multimodal RoPE from its planes ``[3, B, T, W]``. A
    full-width table is two per-pair tables, the entries of each pair's first and second output
    (its two halves, or its even and odd entries when the output is interleaved), combined alike."""
    if planes.shape[-1] == sum(mrope_section):
        return _mrope_pair_table(planes, mrope_section, interleaved)
    first, second = (planes[..., 0::2], planes[..., 1::2]) if out_interleaved else planes.chunk(2, dim=-1)
    first, second = (_mrope_pair_table(p, mrope_section, interleaved) for p in (first, second))
    return torch.stack((first, second), dim=-1).flatten(-2) if out_interleaved else torch.cat((first, second), dim=-1)


def rope(q, k, cos, sin, rotary_dim=None, *, interleaved=False, deinterleave_output=False, rotary_last=False,
         mrope_section=None, mrope_interleaved=False):
    """The options of :func:`tigon.functional.rope`, each mapped to the form above it names."""
    rotary_dim = q.shape[-1] if rotary_dim is None else rotary_dim
    half_table = cos.shape[-1] == rotary_dim // 2
    if mrope_section is not None:
        out_interleaved = interleaved and not deinterleave_output
        cos, sin = (mrope_table(t, mrope_section, mrope_interleaved, out_interleaved) for t in (cos, sin))
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if not interleaved:
        form = rope_half_table if half_table else rope_rotate_half
    elif deinterleave_output:
        form = rope_deinterleave
    else:
        form = rope_complex if half_table else rope_interleaved

    def apply(x):
        start = x.shape[-1] - rotary_dim if rotary_last else 0
        before, rotated, after = x[..., :start], x[..., start:start + rotary_dim], x[..., start + rotary_dim:]
        return torch.cat((before, form(rotated, cos, sin).to(x.dtype), after), dim=-1)

    return apply(q), None if k is None else apply(k)


def swiglu(gate, up):
    return F.silu(gate) * up


def geglu(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def relu2(x):
    """Hugging Face's ``ACT2FN["relu2"]`` (Nemotron's MLP)."""
    return torch.square(F.relu(x))


def swiglu_clamped(gate_up, alpha=1.702, limit=7.0):
    """GPT-OSS's ``GptOssExperts._apply_gate``, in the input's dtype as the eager module runs it."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias=None,
                down_bias=None, gate="swiglu", transposed=False, interleaved=False, alpha=1.702, limit=7.0,
                gate_up_lora=None, down_lora=None):
    """Transformers' eager experts loop (``use_experts_implementation``'s reference): each expert's
    tokens through ``gate_up_proj``, the gate, ``down_proj``, scaled by their routing weight and
    summed per token, in the inputs' dtype. A LoRA adapter ``(lora_a [E, r, in], lora_b [E, out,
    r], scaling)`` on either projection is merged into its weight first, as PEFT's
    ``target_parameters`` hands it to the experts: ``W_e + scaling · B_e A_e``."""

    def merged(weight, lora):
        if lora is None:
            return weight
        lora_a, lora_b, scaling = lora
        delta = scaling * (lora_b @ lora_a)  # [E, out, in]
        return weight + (delta.transpose(1, 2) if transposed else delta)

    gate_up_proj, down_proj = merged(gate_up_proj, gate_up_lora), merged(down_proj, down_lora)
    w_gate_up = gate_up_proj if transposed else gate_up_proj.transpose(1, 2)  # [E, H, 2I]
    w_down = down_proj if transposed else down_proj.transpose(1, 2)  # [E, I, H]
    out = torch.zeros_like(hidden_states)
    for expert in range(w_gate_up.shape[0]):
        token, slot = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate_up = hidden_states[token] @ w_gate_up[expert]
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[expert]
        if gate == "swiglu_clamped":
            h = swiglu_clamped(gate_up if interleaved else _interleave(gate_up), alpha, limit)
        else:
            g, u = (gate_up[..., ::2], gate_up[..., 1::2]) if interleaved else gate_up.chunk(2, dim=-1)
            h = (swiglu if gate == "swiglu" else geglu)(g, u)
        y = h @ w_down[expert]
        if down_bias is not None:
            y = y + down_bias[expert]
        out.index_add_(0, token, y * top_k_weights[token, slot, None])
    return out


def _interleave(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)


def lora_linear(x, weight, lora_a, lora_b, scaling=1.0, bias=None, x_adapter=None):
    """PEFT's ``lora.Linear`` forward: ``base(x) + lora_B(lora_A(x̃)) · scaling``, ``x̃`` the
    dropout of ``x`` (``x_adapter``) or ``x``, as PEFT computes it: the adapter in its weights'
    dtype (x cast to it), the sum in the wider dtype, rounded to ``x``'s."""
    x_adapter = (x if x_adapter is None else x_adapter).to(lora_a.dtype)
    out = F.linear(x, weight, bias) + F.linear(F.linear(x_adapter, lora_a), lora_b) * scaling
    return out.to(x.dtype)


def add_lora(base_out, x, lora_a, lora_b, scaling=1.0):
    """PEFT's adapter over a quantised base layer's output: ``base_out + lora_B(lora_A(x)) · scaling``."""
    return base_out + F.linear(F.linear(x, lora_a), lora_b) * scaling


def gated_mlp(x, gate_weight, up_weight, down_weight, gate_fn, gate_lora=None, up_lora=None, down_lora=None):
    """``down(gate_fn(gate(x), up(x)))``, each projection a linear layer with an optional LoRA
    adapter ``(lora_a, lora_b, scaling)``."""

    def project(p, weight, lora):
        return F.linear(p, weight) if lora is None else lora_linear(p, weight, *lora)

    h = gate_fn(project(x, gate_weight, gate_lora), project(x, up_weight, up_lora))
    return project(h, down_weight, down_lora)


def swiglu_linear(gate, up, weight, bias=None):
    """The gate and down projection of Llama's MLP: ``linear(silu(gate) · up, weight, bias)``."""
    return F.linear(swiglu(gate, up), weight, bias)


def geglu_linear(gate, up, weight, bias=None):
    """:func:`swiglu_linear` with Gemma's ``gelu_tanh`` gate."""
    return F.linear(geglu(gate, up), weight, bias)


def swiglu_mlp(x, gate_weight, up_weight, down_weight, gate_lora=None, up_lora=None, down_lora=None):
    """Llama's MLP: :func:`gated_mlp` with the SwiGLU gate."""
    return gated_mlp(x, gate_weight, up_weight, down_weight, swiglu, gate_lora, up_lora, down_lora)


def geglu_mlp(x, gate_weight, up_weight, down_weight, gate_lora=None, up_lora=None, down_lora=None):
    """Gemma's MLP: :func:`gated_mlp` with the GeGLU gate."""
    return gated_mlp(x, gate_weight, up_weight, down_weight, geglu, gate_lora, up_lora, down_lora)


def cross_entropy(
    logits,
    target,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    lse_square_scale=0.0,
    softcap=None,
    return_z_loss=False,
):
    z = logits.to(_compute_dtype(logits.dtype)).reshape(-1, logits.shape[-1])
    target = target.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = target != ignore_index
    per_token = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    # where, not a product with the mask: an ignored row's gradient is then 0 even for an
    # infinite upstream gradient (the mean over no target), as PyTorch's cross entropy gives.
    z_loss = torch.where(valid, lse_square_scale * torch.logsumexp(z, dim=-1).pow(2), 0.0)
    per_token = per_token + z_loss
    if reduction == "none":
        loss, z_loss = per_token.reshape(logits.shape[:-1]), z_loss.reshape(logits.shape[:-1])
    elif reduction == "sum":
        loss, z_loss = per_token.sum(), z_loss.sum()
    else:
        # PyTorch's mean: NaN (0 / 0) when every target is ignored.
        n_valid = valid.sum()
        loss, z_loss = per_token.sum() / n_valid, z_loss.sum() / n_valid
    return (loss, z_loss) if return_z_loss else loss


def fused_linear_cross_entropy(input, weight, target, bias=None, fp8=None, **options):
    """Cross entropy of ``input @ weight.T (+ bias)``; with ``fp8`` (a recipe name) the head's
    matmuls are FP8 ones (:func:`fp8_linear`), over the ``[N, H]`` rows."""
    if fp8 is not None:
        return cross_entropy(fp8_linear(input, weight, bias, fp8), target.reshape(-1), **options)
    logits = input @ weight.T
    if bias is not None:
        logits = logits + bias
    return cross_entropy(logits, target, **options)


# torchao's float8 recipes as (x and W axiswise for the logits, output gradient dtype, W axiswise
# for the input gradient, weight gradient in FP8, power-of-two scales).
FP8_RECIPES = {
    "tensorwise": (False, torch.float8_e5m2, False, True, False),
    "rowwise": (True, torch.float8_e4m3fn, True, True, True),
    "rowwise_with_gw_hp": (True, torch.float8_e4m3fn, False, False, True),
}


def _fp8_scale(amax, dtype, power_of_2):
    """torchao's scale ``max(dtype) / amax``: computed in fp64 (the amax floored at 1e-12), rounded
    to fp32 and, with ``power_of_2``, floored to a power of two."""
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def fake_quantize(t, dtype, dim=None, power_of_2=False):
    """``t`` rounded to FP8 ``dtype`` and back, in fp32: scaled by ``max(dtype) / amax`` over the
    whole tensor (``dim`` ``None``) or over ``dim`` (one scale per slice along the other)."""
    t = t.float()
    scale = _fp8_scale(t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True), dtype, power_of_2)
    return (t * scale).to(dtype).float() / scale


def tensorwise_cast(t, dtype, power_of_2=False):
    """torchao's dynamic tensorwise cast of ``t`` to FP8 ``dtype``: ``(data, scale)``, the bytes of
    ``t · scale`` saturated to the format's range (:func:`_fp8_scale`, over the whole tensor)."""
    t = t.detach().float()
    limit = torch.finfo(dtype).max
    scale = _fp8_scale(t.abs().amax(), dtype, power_of_2)
    return (t * scale).clamp(-limit, limit).to(dtype), scale


class _Fp8Linear(torch.autograd.Function):
    """``x @ Wᵀ`` with each of its three matmuls on fake-quantized operands, as ``recipe`` scales
    them (see :data:`FP8_RECIPES`), in fp32."""

    @staticmethod
    def forward(ctx, x, weight, recipe):
        axiswise, _, _, _, pow2 = FP8_RECIPES[recipe]
        dim = 1 if axiswise else None
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        e4m3 = torch.float8_e4m3fn
        return fake_quantize(x, e4m3, dim, pow2) @ fake_quantize(weight, e4m3, dim, pow2).T

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        axiswise, grad_dtype, weight_axiswise, grad_weight_fp8, pow2 = FP8_RECIPES[ctx.recipe]
        e4m3 = torch.float8_e4m3fn
        grad_input = fake_quantize(grad, grad_dtype, 1 if axiswise else None, pow2) @ fake_quantize(
            weight, e4m3, 0 if weight_axiswise else None, pow2)
        if grad_weight_fp8:
            dim = 0 if axiswise else None
            grad_weight = fake_quantize(grad, grad_dtype, dim, pow2).T @ fake_quantize(x, e4m3, dim, pow2)
        else:
            grad_weight = grad.T @ x.float()
        return grad_input, grad_weight, None


def fp8_linear(input, weight, bias=None, recipe="tensorwise"):
    """``input [..., H] @ weight.T (+ bias)`` → fp32 ``[N, V]``, its three matmuls in FP8 as
    torchao's float8 ``recipe`` computes them (fake-quantized operands, fp32 products), over the
    whole input at once."""
    logits = _Fp8Linear.apply(input.reshape(-1, input.shape[-1]), weight, recipe)
    return logits if bias is None else logits + bias.float()


def fused_linear_logprobs(input, weight, target, bias=None, temperature=1.0, softcap=None, logit_scale=1.0,
                          outputs=("log_probs",), ignore_index=-100, **_):
    """TRL's fused-head fields written out on the full logits (``**_`` takes tigon's performance
    options)."""
    logits = input @ weight.T
    if bias is not None:
        logits = logits + bias
    z = logits.to(_compute_dtype(logits.dtype)) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = z.log_softmax(-1)
    valid = target != ignore_index
    fields = {
        "log_probs": log_p.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1),
        "entropy": -(log_p.exp() * log_p).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * log_p, dim=-1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == target,
    }
    return tuple(
        torch.where(valid, fields[name], torch.zeros((), dtype=fields[name].dtype, device=z.device))
        if name in outputs else None
        for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    )


# --- Preference (tigon.losses.preference) ----------------------------------------------------
# TRL's formulas on logits built in full: the policy's summed log-probabilities per sequence, then
# the loss of each trainer. Each returns (loss, summed logps [S]).


def head_logits(input, weight, bias=None, logits_dtype=None):
    """``input @ weightᵀ (+ bias)``; with ``logits_dtype``, the values rounded to that dtype as a
    model's head stores them (the gradient passes through the rounding unchanged). Losses of whole
    sequences sum thousands of log-probs, so the rounding of 16-bit logits moves them by far more
    than the per-token tolerance: the truth for a 16-bit op is the exact loss of its rounded logits."""
    logits = input @ weight.T
    if bias is not None:
        logits = logits + bias
    if logits_dtype is None:
        return logits
    return logits + (logits.to(logits_dtype).to(logits.dtype) - logits).detach()


def sequence_logps(input, weight, target, bias=None, ignore_index=-100, logits_dtype=None):
    logits = head_logits(input, weight, bias, logits_dtype)
    log_probs = logits.to(_compute_dtype(logits.dtype)).log_softmax(-1)
    mask = target != ignore_index
    token_logps = log_probs.gather(-1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1)
    return (token_logps * mask).sum(-1)


def _n_tokens(target, ignore_index):
    return (target != ignore_index).sum(-1).clamp(min=1)


def _chosen_nll(logps, target, ignore_index):
    n_pairs = logps.shape[0] // 2
    return -logps[:n_pairs].sum() / (target[:n_pairs] != ignore_index).sum().clamp(min=1)


def _sigmoid_preference(logits, label_smoothing=0.0):
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def dpo_loss(input, weight, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None, beta=0.1,
             ignore_index=-100, compute_nll_loss=False, logits_dtype=None):
    logps = sequence_logps(input, weight, target, bias, ignore_index, logits_dtype)
    ref = torch.zeros_like(logps)
    if ref_input is not None:
        with torch.no_grad():
            ref = sequence_logps(ref_input, ref_weight, target, ref_bias, ignore_index, logits_dtype).to(logps.dtype)
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    loss = -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()
    if compute_nll_loss:
        loss = loss + _chosen_nll(logps, target, ignore_index)
    return loss, logps


def cpo_loss(input, weight, target, bias=None, beta=0.1, alpha=1.0, label_smoothing=0.0, ignore_index=-100, logits_dtype=None):
    logps = sequence_logps(input, weight, target, bias, ignore_index, logits_dtype)
    chosen, rejected = logps.chunk(2)
    loss = _sigmoid_preference(beta * (chosen - rejected), label_smoothing).mean()
    return loss + alpha * _chosen_nll(logps, target, ignore_index), logps


def simpo_loss(input, weight, target, bias=None, beta=2.0, gamma=0.5, label_smoothing=0.0, ignore_index=-100, logits_dtype=None):
    logps = sequence_logps(input, weight, target, bias, ignore_index, logits_dtype)
    chosen, rejected = (logps / _n_tokens(target, ignore_index)).chunk(2)
    return _sigmoid_preference(beta * (chosen - rejected) - gamma, label_smoothing).mean(), logps


def orpo_loss(input, weight, target, bias=None, beta=0.1, ignore_index=-100, logits_dtype=None):
    logps = sequence_logps(input, weight, target, bias, ignore_index, logits_dtype)
    chosen, rejected = (logps / _n_tokens(target, ignore_index)).chunk(2)
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    return _chosen_nll(logps, target, ignore_index) - beta * F.logsigmoid(log_odds).mean(), logps


def kto_loss(input, weight, target, preference_labels, bias=None, ref_input=None, ref_weight=None, ref_bias=None,
             kl=None, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, ignore_index=-100, logits_dtype=None):
    logps = sequence_logps(input, weight, target, bias, ignore_index, logits_dtype)
    ref = torch.zeros_like(logps)
    if ref_input is not None:
        with torch.no_grad():
            ref = sequence_logps(ref_input, ref_weight, target, ref_bias, ignore_index, logits_dtype).to(logps.dtype)
    baseline = 0.0 if kl is None else kl
    log_ratios = logps - ref
    losses = torch.where(
        preference_labels,
        desirable_weight * (1 - torch.sigmoid(beta * (log_ratios - baseline))),
        undesirable_weight * (1 - torch.sigmoid(beta * (baseline - log_ratios))),
    )
    return losses.mean(), logps


# --- Distillation (tigon.losses.distillation) --------------------------------------------------
# The divergences written out on full rows (TRL's generalized JSD for jsd); rows whose label is
# ignore_index are left out of sums and means, a mean over no rows is 0.


def kl_div(input, target, reduction="mean", log_target=False):
    compute = _compute_dtype(input.dtype)
    loss = F.kl_div(input.to(compute), target.to(compute), reduction=reduction, log_target=log_target)
    return loss.to(input.dtype) if reduction == "none" else loss


def _valid_rows(input, labels, ignore_index):
    if labels is None:
        return torch.ones(input.shape[:-1], dtype=torch.bool, device=input.device)
    return labels != ignore_index


def jsd(input, target, labels=None, beta=0.5, ignore_index=-100):
    compute = _compute_dtype(input.dtype)
    s, t = input.to(compute), target.to(compute)
    if beta == 0:
        pointwise = t.exp() * (t - s)
    elif beta == 1:
        pointwise = s.exp() * (s - t)
    else:
        mixture = torch.log((1 - beta) * s.exp() + beta * t.exp())
        pointwise = beta * t.exp() * (t - mixture) + (1 - beta) * s.exp() * (s - mixture)
    valid = _valid_rows(input, labels, ignore_index)
    return torch.where(valid, pointwise.sum(-1), 0).sum() / valid.sum().clamp(min=1)


def tvd(input, target, labels=None, reduction="batchmean", ignore_index=-100):
    compute = _compute_dtype(input.dtype)
    valid = _valid_rows(input, labels, ignore_index)
    pointwise = torch.where(valid.unsqueeze(-1), 0.5 * (input.to(compute) - target.to(compute)).abs(), 0)
    if reduction == "none":
        return pointwise.to(input.dtype)
    n_valid = valid.sum().clamp(min=1)
    divisor = {"sum": 1, "batchmean": n_valid, "mean": n_valid * input.shape[-1]}[reduction]
    return pointwise.sum() / divisor


def fused_linear_jsd(input, weight, teacher_input, teacher_weight, labels=None, beta=0.5, ignore_index=-100,
                     temperature=1.0, logits_dtype=None, teacher_logits_dtype=None):
    compute = _compute_dtype(input.dtype)
    student = head_logits(input, weight, logits_dtype=logits_dtype).to(compute) / temperature
    with torch.no_grad():
        teacher = head_logits(teacher_input, teacher_weight, logits_dtype=teacher_logits_dtype).to(compute) / temperature
    return jsd(student.log_softmax(-1), teacher.log_softmax(-1), labels, beta, ignore_index)


# --- GRPO family (tigon.losses.grpo) -------------------------------------------------------------
# TRL 1.16's GRPOTrainer._compute_loss for one process without gradient accumulation, and without
# its optional extras (top-entropy mask, off-policy mask, vLLM importance-sampling correction,
# bias-corrected KL).

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def _choose(condition, value_if_true, value_if_false, like):
    """``torch.where`` over two numbers, in ``like``'s dtype (with two Python numbers it would
    round them to the default float32)."""
    return torch.where(condition, torch.tensor(value_if_true, dtype=like.dtype, device=like.device), value_if_false)


def _vespo_weights(advantages, log_ratio, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's gamma weight φ(w) = e^λ · w^k · e^(−λw) of the sequence's ratio w = exp Σₜ log rₜ
    (φ(1) = 1), written in log space with TRL's clamps; a constant factor, no gradient."""
    log_w = (log_ratio.detach().clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
    positive = advantages >= 0
    k = _choose(positive, k_pos, k_neg, log_w)
    lam = _choose(positive, lambda_pos, lambda_neg, log_w).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss_from_logps(per_token_logps, completion_mask, advantages, old_per_token_logps=None,
                         ref_per_token_logps=None, num_items_in_batch=None, beta=0.0, epsilon_low=0.2,
                         epsilon_high=0.2, delta=None, loss_type="dapo", importance_sampling_level="token",
                         max_completion_length=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                         vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                         entropy=None):
    """The GRPO family's loss from the policy's per-token log-probs ``per_token_logps [B, T]``.

    With ``log rₜ = logpₜ − old logpₜ`` (``old = logp.detach()`` when not given: ratio 1, gradient
    of logp) the importance weight is ``rₜ`` (token) or ``exp(mean over the sequence's tokens of
    log rₜ)`` (sequence, GSPO), and with advantage ``A`` per sequence the per-token loss is

    - grpo, bnpo, dr_grpo, dapo, luspo: ``−min(min(r, δ)·A, clip(r, 1 − ε_low, 1 + ε_high)·A)``
      (``min(r, δ)`` only when ``delta`` is given);
    - cispo: ``−sg(min(r, ε_high))·A·logp``;
    - sapo: ``−σ(τ·(r − 1))·4/τ·A``, τ = ``sapo_temperature_pos`` if A > 0 else ``_neg``;
    - vespo: ``−φ(w)·A·logp``, φ of the sequence's ratio (see ``_vespo_weights``);

    plus ``β·(e^(ref − logp) − (ref − logp) − 1)`` when ``beta ≠ 0``. Over the active tokens of
    ``completion_mask`` it is then averaged per sequence and over sequences (grpo, sapo), averaged
    over all tokens (bnpo), summed and divided by B·``max_completion_length`` (dr_grpo; T when not
    given), by ``num_items_in_batch`` or else the number of tokens (dapo, cispo, vespo), or summed
    per sequence and averaged over sequences (luspo).

    Returns ``(loss, metrics)``: the means over active tokens of ``entropy`` (when given) and of
    the KL term (when ``beta ≠ 0``), and what TRL logs for the loss type: ``clip_ratio_low``,
    ``_high`` and ``_region`` for the PPO-clipped types (the share of tokens whose ratio, after
    ``delta``'s cap, is below 1 − ε_low with A < 0, above 1 + ε_high with A > 0, either),
    ``cispo_clip_ratio`` (r > ε_high with A > 0), ``vespo_phi_seq_mean``, nothing for sapo. At
    the sequence level the ratios are, as in TRL, means over the B sequences.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    dtype = per_token_logps.dtype
    mask = completion_mask.to(dtype)
    advantages = advantages.to(dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps.to(dtype)

    log_ratio = per_token_logps - old
    if importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_weights)

    clip_ratios = {}
    if loss_type == "cispo":
        per_token_loss = -ratio.clamp(max=epsilon_high).detach() * advantages * per_token_logps
        clip_ratios["cispo_clip_ratio"] = (ratio > epsilon_high) & (advantages > 0)
    elif loss_type == "sapo":
        temperature = _choose(advantages > 0, sapo_temperature_pos, sapo_temperature_neg, ratio)
        per_token_loss = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages
    elif loss_type == "vespo":
        phi = _vespo_weights(advantages, log_ratio, mask, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
        per_token_loss = -phi * advantages * per_token_logps
    else:
        clipped_ratio = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            ratio = ratio.clamp(max=delta)
        per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
        clipped_low = (ratio < 1 - epsilon_low) & (advantages < 0)
        clipped_high = (ratio > 1 + epsilon_high) & (advantages > 0)
        clip_ratios.update(clip_ratio_low=clipped_low, clip_ratio_high=clipped_high,
                           clip_ratio_region=clipped_low | clipped_high)

    if beta != 0.0:
        ref = ref_per_token_logps.to(dtype)
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        per_token_loss = per_token_loss + beta * per_token_kl

    masked_loss = per_token_loss * mask  # broadcasts the sequence level's [B, 1] over the tokens
    n_tokens = mask.sum().clamp(min=1.0)
    n_sequences, max_length = mask.shape[0], max_completion_length or mask.shape[1]
    if loss_type in ("grpo", "sapo"):
        loss = (masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked_loss.sum() / n_tokens
    elif loss_type == "dr_grpo":
        loss = masked_loss.sum() / (n_sequences * max_length)
    elif loss_type == "luspo":
        loss = masked_loss.sum(-1).mean()
    else:
        normalizer = n_tokens
        if num_items_in_batch is not None:
            normalizer = torch.as_tensor(num_items_in_batch, dtype=dtype, device=mask.device).clamp(min=1.0)
        loss = masked_loss.sum() / normalizer

    def active_mean(values):
        return (values * mask).sum() / n_tokens

    with torch.no_grad():
        metrics = {}
        if entropy is not None:
            metrics["entropy"] = active_mean(entropy.to(dtype))
        if beta != 0.0:
            metrics["kl"] = active_mean(per_token_kl)
        for name, clipped in clip_ratios.items():
            clipped = clipped.to(dtype)
            metrics[name] = clipped.mean() if importance_sampling_level == "sequence" else active_mean(clipped)
        if loss_type == "vespo":
            metrics["vespo_phi_seq_mean"] = phi.mean()
    return loss, metrics


def grpo_loss(input, weight, completion_ids, completion_mask, advantages, bias=None, old_per_token_logps=None,
              ref_per_token_logps=None, num_items_in_batch=None, temperature=1.0, logits_dtype=None, **options):
    """The GRPO family's loss on the full logits ``input [B, T, H] @ weightᵀ (+ bias)``, divided by
    ``temperature``: log pₜ = log softmax(zₜ / temperature)[completion_idsₜ], entropy
    Hₜ = −Σᵥ pᵥ log pᵥ of the same distribution; ``**options`` as in ``grpo_loss_from_logps``."""
    logits = head_logits(input, weight, bias, logits_dtype)
    log_p = (logits.to(_compute_dtype(logits.dtype)) / temperature).log_softmax(-1)
    ids = torch.where(completion_mask.bool(), completion_ids, 0)  # padding may hold any id
    per_token_logps = log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return grpo_loss_from_logps(per_token_logps, completion_mask, advantages, old_per_token_logps,
                                ref_per_token_logps, num_items_in_batch, entropy=entropy, **options)
