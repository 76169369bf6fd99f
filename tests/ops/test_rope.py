import importlib
from types import SimpleNamespace

import pytest
import torch

from tigon.testing import reference
import tigon.functional as tf
from tigon.ops.rope import rope_rotate
from utils import DEVICE, DTYPES, ON_GPU, assert_close, leaf_copies, pick, randn

# (batch, q heads, k heads, positions, head dim, rotary dim)
SHAPES = pick(
    cpu=[
        (2, 4, 4, 37, 64, 64),     # Hq = Hk, T not a power of two
        (2, 4, 2, 19, 128, 128),   # GQA
        (1, 3, 1, 45, 48, 48),     # MQA, D not a power of two
        (2, 4, 2, 23, 128, 64),    # partial rotary
        (1, 12, 4, 9, 48, 32),     # partial rotary; 16 heads span two programs, one holding q and k heads
    ],
    gpu=[
        (4, 32, 8, 1024, 128, 128),
        (2, 16, 16, 1000, 64, 64),
        (3, 8, 1, 333, 48, 48),
        (2, 32, 8, 777, 128, 64),
        (1, 12, 4, 2049, 80, 32),
    ],
)
# Layouts of q and k: as HF hands them over (a transposed [B, T, H, D] projection), contiguous,
# heads sliced out of one fused qkv projection (not dense), and features not contiguous.
LAYOUTS = ("transposed", "contiguous", "fused_qkv", "feature_strided")


def _sectioned(rotary_dim):
    """About Qwen2-VL's proportions (16, 24, 24 of 64 pairs), with h ≠ w so that a kernel
    confusing the two cannot pass."""
    pairs = rotary_dim // 2
    t = pairs // 4
    h = (pairs - t) // 2 + 1
    return t, h, pairs - t - h


def _interleaved_sections(rotary_dim):
    """About Qwen3-VL's proportions (24, 20, 20 of 64 pairs): 3h and 3w stop short of the last
    pairs; h ≠ w as above."""
    pairs = rotary_dim // 2
    h = 5 * pairs // 16
    return pairs - 2 * h + 1, h, h - 1


# Every variant of the op: its options (M-RoPE sections as functions of the rotary dim) and whether
# its tables are half width (one angle per pair). Each names the Hugging Face form it computes.
VARIANTS = {
    "rotate_half": ({}, False),                                                 # Llama
    "half_table": ({}, True),                                                   # GPT-OSS
    "interleaved": ({"interleaved": True}, True),                               # Llama 4, DeepSeek V2 (complex)
    "interleaved_full_table": ({"interleaved": True}, False),                   # DeepSeek V4's repeated tables
    "deinterleave": ({"interleaved": True, "deinterleave_output": True}, True),  # DeepSeek V3
    "deinterleave_full_table": ({"interleaved": True, "deinterleave_output": True}, False),
    "rotary_last": ({"interleaved": True, "rotary_last": True}, True),          # DeepSeek V4
    "rotary_last_rotate_half": ({"rotary_last": True}, False),
    "mrope": ({"mrope_section": _sectioned}, False),                            # Qwen2-VL (old API)
    "mrope_half_table": ({"mrope_section": _sectioned}, True),                  # Qwen2-VL planes
    "mrope_interleaved": ({"mrope_section": _interleaved_sections, "mrope_interleaved": True}, True),  # Qwen3-VL
    "mrope_interleaved_full_table": ({"mrope_section": _interleaved_sections, "mrope_interleaved": True}, False),
    "mrope_complex": ({"mrope_section": _sectioned, "interleaved": True}, False),
}


def _options(variant, rotary_dim):
    options, half_table = VARIANTS[variant]
    options = {name: value(rotary_dim) if callable(value) else value for name, value in options.items()}
    return options, rotary_dim // 2 if half_table else rotary_dim


def _heads(batch, q_heads, k_heads, seq_len, head_dim, layout, dtype):
    if layout == "transposed":
        q = randn(batch, seq_len, q_heads, head_dim, dtype=dtype).transpose(1, 2)
        k = randn(batch, seq_len, k_heads, head_dim, dtype=dtype).transpose(1, 2)
    elif layout == "contiguous":
        q = randn(batch, q_heads, seq_len, head_dim, dtype=dtype)
        k = randn(batch, k_heads, seq_len, head_dim, dtype=dtype)
    elif layout == "fused_qkv":
        qkv = randn(batch, seq_len, (q_heads + 2 * k_heads) * head_dim, dtype=dtype)
        q, k, _ = qkv.split((q_heads * head_dim, k_heads * head_dim, k_heads * head_dim), dim=-1)
        q = q.view(batch, seq_len, q_heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, k_heads, head_dim).transpose(1, 2)
    else:
        q = randn(batch, q_heads, head_dim, seq_len, dtype=dtype).transpose(2, 3)
        k = randn(batch, k_heads, head_dim, seq_len, dtype=dtype).transpose(2, 3)
    return q.requires_grad_(), k.requires_grad_()


def _tables(batch, seq_len, width, kind, dtype, mrope=False, requires_grad=False):
    """Arbitrary cos/sin values (the two halves differ, unlike HF's tables) so that a kernel mixing
    up which entry multiplies which feature cannot pass. M-RoPE tables carry three planes."""
    shape = {"shared": (1, seq_len, width), "per_sequence": (batch, seq_len, width), "2d": (seq_len, width)}[kind]
    if mrope:
        shape = (3, *shape)
    return tuple(randn(*shape, dtype=dtype, requires_grad=requires_grad) for _ in ("cos", "sin"))


def _check_rope(q, k, cos, sin, rotary_dim, dtype, **options):
    """Outputs and the gradients of every input that requires grad (tables included) against the
    fp64 reference; ``k`` may be ``None``."""
    q64, k64, cos64, sin64 = leaf_copies(q, k, cos, sin)
    q_rot, k_rot = tf.rope(q, k, cos, sin, rotary_dim, **options)
    q_truth, k_truth = reference.rope(q64, k64, cos64, sin64, rotary_dim, **options)
    outputs = [("q_rot", q_rot, q_truth)] + ([("k_rot", k_rot, k_truth)] if k is not None else [])
    assert (k_rot is None) == (k is None)
    grads = [torch.randn_like(out) for _, out, _ in outputs]
    torch.autograd.backward([out for _, out, _ in outputs], grads)
    torch.autograd.backward([truth for _, _, truth in outputs], [g.double() for g in grads])
    for name, out, truth in outputs:
        assert out.dtype == dtype and out.shape == truth.shape
        assert_close(out, truth, dtype, name)
    for name, leaf, leaf64 in (("q", q, q64), ("k", k, k64), ("cos", cos, cos64), ("sin", sin, sin64)):
        if leaf is not None and leaf.requires_grad:
            assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
            assert_close(leaf.grad, leaf64.grad, leaf.dtype, f"grad of {name}")
    return q_rot, k_rot


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rope(shape, dtype, layout):
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = shape
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, layout, dtype)
    cos, sin = _tables(batch, seq_len, rotary_dim, "per_sequence", dtype)
    q_rot, k_rot = _check_rope(q, k, cos, sin, rotary_dim, dtype)
    if layout in ("transposed", "contiguous"):
        # Dense inputs keep their layout: a transposed projection's output stays transposed.
        assert q_rot.stride() == q.stride() and k_rot.stride() == k.stride()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[4]], ids=["mqa", "partial"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_rope_variants(variant, shape, dtype):
    """Every variant, forward and the gradients of q, k, cos and sin, on per-sequence tables."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = shape
    options, width = _options(variant, rotary_dim)
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", dtype)
    cos, sin = _tables(batch, seq_len, width, "per_sequence", dtype, "mrope_section" in options, requires_grad=True)
    _check_rope(q, k, cos, sin, rotary_dim, dtype, **options)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["interleaved", "deinterleave", "mrope_interleaved", "rotary_last"])
def test_rope_variant_layouts(variant, layout):
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[3]
    options, width = _options(variant, rotary_dim)
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, layout, torch.bfloat16)
    cos, sin = _tables(batch, seq_len, width, "shared", torch.float32, "mrope_section" in options)
    _check_rope(q, k, cos, sin, rotary_dim, torch.bfloat16, **options)


@pytest.mark.parametrize("variant", VARIANTS)
def test_single_tensor(variant):
    """``k=None`` rotates q alone (Gemma 4, DeepSeek V4) and returns ``(q_rot, None)``."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[4]
    options, width = _options(variant, rotary_dim)
    q, _ = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.float32)
    cos, sin = _tables(batch, seq_len, width, "shared", torch.float32, "mrope_section" in options, requires_grad=True)
    _check_rope(q, None, cos, sin, rotary_dim, torch.float32, **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["shared", "per_sequence", "2d"])
def test_rope_tables(kind, dtype):
    """Tables shared by the batch, per sequence or 2-D, with their gradients reduced to their shape."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[3]
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", dtype)
    cos, sin = _tables(batch, seq_len, rotary_dim, kind, dtype, requires_grad=True)
    _check_rope(q, k, cos, sin, rotary_dim, dtype)


@pytest.mark.parametrize("variant", ["half_table", "deinterleave", "mrope_interleaved", "mrope_complex"])
def test_table_grads_shared_by_the_batch(variant):
    """A table (M-RoPE planes too) shared by the batch sums its gradient over the sequences."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[0]
    options, width = _options(variant, rotary_dim)
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.float32)
    cos, sin = _tables(batch, seq_len, width, "shared", torch.float32, "mrope_section" in options, requires_grad=True)
    _check_rope(q, k, cos, sin, rotary_dim, torch.float32, **options)


def test_only_tables_require_grad():
    """cos and sin get their gradient when q and k do not require grad (learned angles)."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[4]
    q, k = (t.detach() for t in _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.float32))
    cos, sin = _tables(batch, seq_len, rotary_dim // 2, "shared", torch.float32, requires_grad=True)
    _check_rope(q, k, cos, sin, rotary_dim, torch.float32, interleaved=True)
    assert q.grad is None and k.grad is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_fp32_tables(dtype):
    """Tables kept in fp32 while q and k are 16-bit: read as they are, no rounding of cos/sin."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[1]
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", dtype)
    cos, sin = _tables(batch, seq_len, rotary_dim, "shared", torch.float32, requires_grad=True)
    _check_rope(q, k, cos, sin, rotary_dim, dtype)


# Hugging Face's own functions on the same inputs: what the model patches rely on. Tables are
# built as the models build them (angles = position · inverse frequency), outputs and gradients
# compared with the function run in fp64.


def _hugging_face(module, name):
    """``name`` from ``transformers.models.<module>``, checked not to be tigon's patch (Hugging
    Face's own may be wrapped by the kernel hub's ``use_kernel_forward_from_hub``)."""
    function = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    for code in (function, getattr(function, "forward", function)):
        assert not code.__module__.startswith("tigon"), f"{module}.{name} is patched by {code.__module__}"
    return function


def _angles(batch, seq_len, pairs, planes=None):
    """``[B, T, pairs]`` rotation angles (``[planes, B, T, pairs]`` with one position per plane) at
    positions past 1000, inverse frequencies as a rotary embedding's."""
    inv_freq = 10000.0 ** (-torch.arange(pairs, device=DEVICE, dtype=torch.float32) / pairs)
    leading = (batch,) if planes is None else (planes, batch)
    positions = torch.randint(1000, 3000, (*leading, seq_len), device=DEVICE).float()
    return positions[..., None] * inv_freq


def _leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


def _check_against(outputs, truths, leaves, leaves64, what):
    """fp32 outputs of tigon against Hugging Face's fp64 ones, then every leaf's gradient."""
    grads = [torch.randn_like(out) for out in outputs]
    torch.autograd.backward(outputs, grads)
    torch.autograd.backward(truths, [g.double() for g in grads])
    for index, (out, truth) in enumerate(zip(outputs, truths)):
        assert_close(out, truth, torch.float32, f"{what}: output {index}")
    for index, (leaf, leaf64) in enumerate(zip(leaves, leaves64)):
        assert_close(leaf.grad, leaf64.grad, torch.float32, f"{what}: grad of input {index}")


def _hf_heads(layout="bhtd"):
    batch, q_heads, k_heads, seq_len, head_dim, _ = SHAPES[1]
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.float32)
    if layout == "bthd":  # leaves of their own, in HF's [B, T, H, D] order
        q, k = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k))
    return q, k


def test_matches_llama():
    """transformers' Llama ``apply_rotary_pos_emb`` with tables from its rotary embedding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    apply_rotary_pos_emb = _hugging_face("llama.modeling_llama", "apply_rotary_pos_emb")
    batch, q_heads, k_heads, seq_len, head_dim, _ = SHAPES[1]
    config = LlamaConfig(hidden_size=q_heads * head_dim, num_attention_heads=q_heads, num_key_value_heads=k_heads)
    q, k = _hf_heads()
    position_ids = torch.arange(seq_len, device=DEVICE)[None].expand(batch, -1) + 1000
    cos, sin = _leaves(*LlamaRotaryEmbedding(config).to(DEVICE)(q, position_ids))
    leaves64 = leaf_copies(q, k, cos, sin)
    _check_against(tf.rope(q, k, cos, sin), apply_rotary_pos_emb(*leaves64), [q, k, cos, sin], leaves64, "llama")


def test_matches_gpt_oss():
    """GPT-OSS's ``_apply_rotary_emb``: halves rotated by ``[B, T, D/2]`` tables."""
    apply_rotary_emb = _hugging_face("gpt_oss.modeling_gpt_oss", "_apply_rotary_emb")
    q, k = _hf_heads()
    angles = _angles(q.shape[0], q.shape[2], q.shape[3] // 2)
    cos, sin = _leaves(angles.cos(), angles.sin())
    q64, k64, cos64, sin64 = leaves64 = leaf_copies(q, k, cos, sin)
    truths = [apply_rotary_emb(x, cos64.unsqueeze(1), sin64.unsqueeze(1)) for x in (q64, k64)]
    _check_against(tf.rope(q, k, cos, sin), truths, [q, k, cos, sin], leaves64, "gpt-oss")


def test_matches_gemma4_single_tensor():
    """Gemma 4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)`` on ``[B, T, H, D]`` states."""
    apply_rotary_pos_emb = _hugging_face("gemma4.modeling_gemma4", "apply_rotary_pos_emb")
    x, _ = _hf_heads("bthd")
    angles = _angles(x.shape[0], x.shape[1], x.shape[3] // 2)
    cos, sin = _leaves(torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())
    leaves64 = leaf_copies(x, cos, sin)
    x_rot, none = tf.rope(x.transpose(1, 2), None, cos, sin)
    assert none is None
    truth = apply_rotary_pos_emb(*leaves64, unsqueeze_dim=2)
    _check_against([x_rot.transpose(1, 2)], [truth], [x, cos, sin], leaves64, "gemma 4")


@pytest.mark.parametrize(
    "module, layout", [("deepseek_v2.modeling_deepseek_v2", "bhtd"), ("llama4.modeling_llama4", "bthd")]
)
def test_matches_complex_forms(module, layout):
    """DeepSeek V2's (xq ``[B, H, T, D]``) and Llama 4's (``[B, T, H, D]``) ``apply_rotary_emb``:
    interleaved pairs times ``freqs_cis [B, T, D/2]``, passed as its real and imaginary parts."""
    apply_rotary_emb = _hugging_face(module, "apply_rotary_emb")
    q, k = _hf_heads(layout)
    batch, seq_len = q.shape[0], q.shape[2 if layout == "bhtd" else 1]
    angles = _angles(batch, seq_len, q.shape[3] // 2)
    cos, sin = _leaves(angles.cos(), angles.sin())
    q64, k64, cos64, sin64 = leaves64 = leaf_copies(q, k, cos, sin)
    truths = apply_rotary_emb(q64, k64, torch.complex(cos64, sin64))
    freqs_cis = torch.complex(cos, sin)  # the kernel reads its parts as strided views
    if layout == "bthd":
        outputs = tf.rope(q.transpose(1, 2), k.transpose(1, 2), freqs_cis.real, freqs_cis.imag, interleaved=True)
        outputs = [out.transpose(1, 2) for out in outputs]
    else:
        outputs = tf.rope(q, k, freqs_cis.real, freqs_cis.imag, interleaved=True)
    _check_against(list(outputs), list(truths), [q, k, cos, sin], leaves64, module)


def test_matches_deepseek_v3_interleave():
    """DeepSeek V3's ``apply_rotary_pos_emb_interleave`` with its full-width ``cat(freqs, freqs)``
    tables: given whole (equal halves) or, for exact table gradients, their first half."""
    apply_interleave = _hugging_face("deepseek_v3.modeling_deepseek_v3", "apply_rotary_pos_emb_interleave")
    q, k = _hf_heads()
    angles = _angles(q.shape[0], q.shape[2], q.shape[3] // 2)
    cos_half, sin_half = _leaves(angles.cos(), angles.sin())
    q64, k64, cos64, sin64 = leaves64 = leaf_copies(q, k, cos_half, sin_half)
    truths = apply_interleave(q64, k64, torch.cat((cos64, cos64), -1), torch.cat((sin64, sin64), -1))
    options = {"interleaved": True, "deinterleave_output": True}
    cos_full, sin_full = (torch.cat((t, t), -1).detach() for t in (cos_half, sin_half))
    for out, truth in zip(tf.rope(q, k, cos_full, sin_full, **options), truths):
        assert_close(out, truth, torch.float32, "deepseek v3, full-width tables")
    outputs = tf.rope(q, k, cos_half, sin_half, **options)
    _check_against(list(outputs), list(truths), [q, k, cos_half, sin_half], leaves64, "deepseek v3")


def test_matches_deepseek_v4():
    """DeepSeek V4's ``apply_rotary_pos_emb(x, cos, sin)``: the last ``2·W`` features of each head,
    interleaved pairs, half-width tables ``[B, T, W]``."""
    apply_rotary_pos_emb = _hugging_face("deepseek_v4.modeling_deepseek_v4", "apply_rotary_pos_emb")
    x, _ = _hf_heads()
    angles = _angles(x.shape[0], x.shape[2], 16)  # 32 rotated features of 128
    cos, sin = _leaves(angles.cos(), angles.sin())
    leaves64 = leaf_copies(x, cos, sin)
    x_rot, _ = tf.rope(x, None, cos, sin, rotary_dim=32, interleaved=True, rotary_last=True)
    _check_against([x_rot], [apply_rotary_pos_emb(*leaves64)], [x, cos, sin], leaves64, "deepseek v4")


@pytest.mark.parametrize("width", ["half", "full"])
@pytest.mark.parametrize(
    "module, embedding, section, interleaved",
    [
        ("qwen2_vl.modeling_qwen2_vl", "Qwen2VLRotaryEmbedding", (16, 24, 24), False),
        ("qwen3_vl.modeling_qwen3_vl", "Qwen3VLTextRotaryEmbedding", (24, 20, 20), True),
    ],
)
def test_matches_qwen_vl_mrope(module, embedding, section, interleaved, width):
    """Qwen2-VL's and Qwen3-VL's M-RoPE: the planes of angles ``[3, B, T, D/2]`` (time, height,
    width positions) combined by the rotary embedding's ``recomposition_frequencies``, then
    ``apply_rotary_pos_emb``; tigon reads the planes (half width, or duplicated to full width as
    the pre-5.x ``apply_multimodal_rotary_pos_emb`` took them) directly."""
    rotary_embedding = _hugging_face(module, embedding)
    apply_rotary_pos_emb = _hugging_face(module, "apply_rotary_pos_emb")
    q, k = _hf_heads()
    # The models' sections are for 64 angles per head (head_dim 128): scaled to these heads'.
    section = tuple(size * q.shape[3] // 128 for size in section)
    stand_in = SimpleNamespace(mrope_section=list(section))  # all recomposition_frequencies reads

    def combined(planes):  # clone: Qwen3-VL's recomposition writes into plane 0
        return rotary_embedding.recomposition_frequencies(stand_in, planes.clone())

    angles = _angles(q.shape[0], q.shape[2], q.shape[3] // 2, planes=3)
    cos, sin = _leaves(angles.cos(), angles.sin())
    q64, k64, cos64, sin64 = leaves64 = leaf_copies(q, k, cos, sin)
    truths = apply_rotary_pos_emb(q64, k64, combined(cos64), combined(sin64))
    tables = (cos, sin) if width == "half" else (torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    outputs = tf.rope(q, k, *tables, mrope_section=section, mrope_interleaved=interleaved)
    _check_against(list(outputs), list(truths), [q, k, cos, sin], leaves64, module)


def test_variant_errors():
    q, k = randn(1, 4, 6, 8), randn(1, 2, 6, 8)
    cos = sin = randn(1, 6, 8)

    def raises(error, match, *args, **kwargs):
        with pytest.raises(error, match=match):
            tf.rope(*args, **kwargs)

    raises(ValueError, r"deinterleave_output=True needs interleaved=True", q, k, cos, sin, deinterleave_output=True)
    raises(ValueError, r"mrope_interleaved=True needs mrope_section", q, k, cos, sin, mrope_interleaved=True)
    raises(ValueError, r"mrope_section must be three sizes \(t, h, w\) >= 0 summing to rotary_dim/2 = 4; "
           r"got \(1, 1, 1\)", q, k, randn(3, 1, 6, 8), randn(3, 1, 6, 8), mrope_section=(1, 1, 1))
    raises(ValueError, r"mrope_section must be three sizes .* got 4", q, k, cos, sin, mrope_section=4)
    raises(ValueError, r"cos must be \[3, B or 1, T, rotary_dim\] = \[3, 1 or 1, 6, 8\] .*got \(1, 6, 8\)",
           q, k, cos, sin, mrope_section=(2, 1, 1))
    raises(ValueError, r"sin must be \[B or 1, T, rotary_dim\] = \[1 or 1, 6, 8\] or \[T, rotary_dim\], or of width "
           r"rotary_dim/2 = 4 \(one angle per pair\); got \(1, 6, 6\)", q, k, cos, randn(1, 6, 6))
    raises(ValueError, r"cos must be .* like sin .*got cos \(1, 6, 8\), sin \(1, 6, 4\)", q, k, cos, randn(1, 6, 4))
    raises(ValueError, r"cos must be \[B or 1, T, rotary_dim\] = \[1 or 1, 6, 4\]", q, k, cos, sin, rotary_dim=4)
    raises(TypeError, r"k has dtype torch.int64", q, k.long(), cos, sin)


def test_nan_and_inf_propagate():
    """A non-finite feature spoils its own output and its rotation partner, nothing else."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[3]
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.float32)
    cos, sin = _tables(batch, seq_len, rotary_dim, "per_sequence", torch.float32)
    with torch.no_grad():
        q[1, 0, 5, 3] = float("nan")
        k[0, 1, 2, rotary_dim + 1] = float("inf")
    q_rot, k_rot = tf.rope(q, k, cos, sin, rotary_dim)
    half = rotary_dim // 2
    assert q_rot[1, 0, 5, [3, 3 + half]].isnan().all()
    assert q_rot.isnan().sum() == 2 and q_rot.isfinite().sum() == q_rot.numel() - 2
    assert k_rot[0, 1, 2, rotary_dim + 1] == float("inf") and k_rot.isfinite().sum() == k_rot.numel() - 1
    q_rot, _ = tf.rope(q, None, cos[..., :half], sin[..., :half], rotary_dim, interleaved=True)
    assert q_rot[1, 0, 5, [2, 3]].isnan().all() and q_rot.isnan().sum() == 2


def test_empty_inputs():
    q, k = randn(2, 4, 0, 64, requires_grad=True), randn(2, 2, 0, 64, requires_grad=True)
    cos, sin = randn(1, 0, 64, requires_grad=True), randn(1, 0, 64, requires_grad=True)
    q_rot, k_rot = tf.rope(q, k, cos, sin)
    (q_rot.sum() + k_rot.sum()).backward()
    assert q_rot.shape == q.shape and k_rot.shape == k.shape and q.grad.shape == q.shape
    assert cos.grad.shape == cos.shape and sin.grad.shape == sin.shape


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_matches_kernel(layout):
    """The fake (used by torch.compile) gives the real outputs' shapes, dtypes and strides."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[4]
    q, k = (t.detach() for t in _heads(batch, q_heads, k_heads, seq_len, head_dim, layout, torch.bfloat16))
    cos, sin = _tables(batch, seq_len, rotary_dim, "shared", torch.bfloat16)
    torch.library.opcheck(
        rope_rotate.op, (q, k, cos, sin, False, rotary_dim),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_fake_matches_kernel_with_options():
    """The same with every option set and an empty k (how ``k=None`` reaches the op)."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[4]
    q, _ = (t.detach() for t in _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.bfloat16))
    cos, sin = _tables(batch, seq_len, rotary_dim // 2, "shared", torch.bfloat16, mrope=True)
    section = list(_interleaved_sections(rotary_dim))
    torch.library.opcheck(
        rope_rotate.op, (q, q[:, :0], cos, sin, True, rotary_dim, True, True, True, section, True),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["rotate_half", "mrope_interleaved"])
@pytest.mark.parametrize("with_k", [True, False], ids=["q_and_k", "q_only"])
def test_compiled_matches_eager(variant, with_k):
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[3]
    options, width = _options(variant, rotary_dim)
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.bfloat16)
    k = k if with_k else None
    cos, sin = _tables(batch, seq_len, width, "shared", torch.bfloat16, "mrope_section" in options, requires_grad=True)
    inputs = [t for t in (q, k, cos, sin) if t is not None]

    def loss(q, k, cos, sin):
        q_rot, k_rot = tf.rope(q, k, cos, sin, rotary_dim, **options)
        return (q_rot.float() * 0.5).sum() + (0 if k_rot is None else k_rot.float().square().sum())

    eager_grads = torch.autograd.grad(loss(q, k, cos, sin), inputs)
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    compiled_grads = torch.autograd.grad(compiled(q, k, cos, sin), inputs)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled_grad, eager_grad)
