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


def _tables(batch, seq_len, rotary_dim, kind, dtype):
    """Arbitrary cos/sin values (the two halves differ, unlike HF's tables) so that a kernel mixing
    up which half multiplies which feature cannot pass."""
    shape = {"shared": (1, seq_len, rotary_dim), "per_sequence": (batch, seq_len, rotary_dim), "2d": (seq_len, rotary_dim)}[kind]
    return randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)


def _check_rope(q, k, cos, sin, rotary_dim, dtype):
    q64, k64 = leaf_copies(q, k)
    q_rot, k_rot = tf.rope(q, k, cos, sin, rotary_dim)
    q_truth, k_truth = reference.rope(q64, k64, cos.double(), sin.double(), rotary_dim)
    grads = [torch.randn_like(q_rot), torch.randn_like(k_rot)]
    torch.autograd.backward([q_rot, k_rot], grads)
    torch.autograd.backward([q_truth, k_truth], [g.double() for g in grads])
    for name, out, truth in (("q_rot", q_rot, q_truth), ("k_rot", k_rot, k_truth)):
        assert out.dtype == dtype and out.shape == truth.shape
        assert_close(out, truth, dtype, name)
    assert_close(q.grad, q64.grad, dtype, "grad of q")
    assert_close(k.grad, k64.grad, dtype, "grad of k")
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
@pytest.mark.parametrize("kind", ["shared", "per_sequence", "2d"])
def test_rope_tables(kind, dtype):
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[3]
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", dtype)
    cos, sin = _tables(batch, seq_len, rotary_dim, kind, dtype)
    _check_rope(q, k, cos, sin, rotary_dim, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_fp32_tables(dtype):
    """Tables kept in fp32 while q and k are 16-bit: read as they are, no rounding of cos/sin."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[1]
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", dtype)
    cos, sin = _tables(batch, seq_len, rotary_dim, "shared", torch.float32)
    _check_rope(q, k, cos, sin, rotary_dim, dtype)


def test_matches_hugging_face():
    """Same values as transformers' Llama ``apply_rotary_pos_emb`` with tables from its rotary embedding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    batch, q_heads, k_heads, seq_len, head_dim, _ = SHAPES[1]
    config = LlamaConfig(hidden_size=q_heads * head_dim, num_attention_heads=q_heads, num_key_value_heads=k_heads)
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.float32)
    position_ids = torch.arange(seq_len, device=DEVICE)[None].expand(batch, -1) + 1000
    cos, sin = LlamaRotaryEmbedding(config).to(DEVICE)(q, position_ids)
    q_rot, k_rot = tf.rope(q, k, cos, sin)
    q_truth, k_truth = apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    assert_close(q_rot, q_truth, torch.float32, "q_rot")
    assert_close(k_rot, k_truth, torch.float32, "k_rot")


def test_tables_get_no_grad():
    """cos and sin are functions of position ids: no gradient flows to them, by design."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[0]
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.float32)
    cos, sin = (t.requires_grad_() for t in _tables(batch, seq_len, rotary_dim, "shared", torch.float32))
    q_rot, k_rot = tf.rope(q, k, cos, sin)
    (q_rot.sum() + k_rot.square().sum()).backward()
    assert cos.grad is None and sin.grad is None
    assert q.grad is not None and k.grad is not None


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


def test_empty_inputs():
    q, k = randn(2, 4, 0, 64, requires_grad=True), randn(2, 2, 0, 64, requires_grad=True)
    q_rot, k_rot = tf.rope(q, k, randn(1, 0, 64), randn(1, 0, 64))
    (q_rot.sum() + k_rot.sum()).backward()
    assert q_rot.shape == q.shape and k_rot.shape == k.shape and q.grad.shape == q.shape


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_matches_kernel(layout):
    """The fake (used by torch.compile) gives the real outputs' shapes, dtypes and strides."""
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[4]
    q, k = (t.detach() for t in _heads(batch, q_heads, k_heads, seq_len, head_dim, layout, torch.bfloat16))
    cos, sin = _tables(batch, seq_len, rotary_dim, "shared", torch.bfloat16)
    torch.library.opcheck(
        rope_rotate.op, (q, k, cos, sin, rotary_dim, False),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.slow
def test_compiled_matches_eager():
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = SHAPES[3]
    q, k = _heads(batch, q_heads, k_heads, seq_len, head_dim, "transposed", torch.bfloat16)
    cos, sin = _tables(batch, seq_len, rotary_dim, "shared", torch.bfloat16)

    def loss(q, k):
        q_rot, k_rot = tf.rope(q, k, cos, sin, rotary_dim)
        return (q_rot.float() * 0.5).sum() + k_rot.float().square().sum()

    eager_grads = torch.autograd.grad(loss(q, k), (q, k))
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    compiled_grads = torch.autograd.grad(compiled(q, k), (q, k))
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled_grad, eager_grad)
