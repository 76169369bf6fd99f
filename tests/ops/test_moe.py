import functools

import pytest
import torch

import tigon.functional as tf
from tigon.ops import moe
from tigon.testing import reference
from utils import DEVICE, ON_GPU, assert_close, leaf_copies, pick, randn

# (tokens, hidden, intermediate, experts, top-k): non-powers of two. On the CPU every dimension crosses
# several of the interpreter's 64-wide tiles: about 70 rows per expert, hidden 80, intermediate 72.
SHAPES = pick(cpu=[(173, 80, 72, 5, 2)], gpu=[(16384, 2048, 768, 128, 8), (4099, 2880, 2880, 32, 4)])
# (gate, transposed, interleaved, biases): transformers' layouts (Qwen3-MoE, Mixtral: the first;
# GPT-OSS: the last) and the mixed ones the strides allow.
LAYOUTS = [("swiglu", False, False, False), ("geglu", True, False, False), ("swiglu", False, True, True),
           ("swiglu_clamped", True, True, True)]


def _routing(n_tokens, n_experts, top_k, unused=()):
    """Each token's ``top_k`` distinct experts (none of ``unused``) and softmax weights."""
    logits = torch.randn(n_tokens, n_experts, device=DEVICE)
    logits[:, list(unused)] = -float("inf")
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    return index, weights


def _experts(shape, dtype, layout, unused=()):
    n_tokens, hidden, inter, n_experts, top_k = shape
    _, transposed, _, biases = layout
    index, weights = _routing(n_tokens, n_experts, top_k, unused)
    gate_up_shape = (n_experts, hidden, 2 * inter) if transposed else (n_experts, 2 * inter, hidden)
    down_shape = (n_experts, inter, hidden) if transposed else (n_experts, hidden, inter)
    return dict(
        hidden_states=randn(n_tokens, hidden, dtype=dtype, requires_grad=True),
        top_k_index=index,
        top_k_weights=weights.requires_grad_(),
        gate_up_proj=randn(*gate_up_shape, dtype=dtype, requires_grad=True, scale=hidden**-0.5),
        down_proj=randn(*down_shape, dtype=dtype, requires_grad=True, scale=inter**-0.5),
        gate_up_bias=randn(n_experts, 2 * inter, dtype=dtype, requires_grad=True, scale=0.5) if biases else None,
        down_bias=randn(n_experts, hidden, dtype=dtype, requires_grad=True, scale=0.5) if biases else None,
    )


def _adapters(shape, dtype, rank, projections=("gate_up", "down")):
    """A LoRA adapter per expert on each of ``projections``: ``(lora_a [E, r, in], lora_b [E, out,
    r], scaling)``, both factors random (a trained adapter, not PEFT's zero-initialised B)."""
    _, hidden, inter, n_experts, _ = shape
    dims = dict(gate_up=(2 * inter, hidden), down=(hidden, inter))
    return {
        f"{projection}_lora": (
            randn(n_experts, rank, dims[projection][1], dtype=dtype, requires_grad=True,
                  scale=dims[projection][1] ** -0.5),
            randn(n_experts, dims[projection][0], rank, dtype=dtype, requires_grad=True, scale=rank**-0.5),
            0.75,
        )
        for projection in projections
    }


def _leaves(inputs):
    """The tensors of ``inputs`` by name, an adapter's factors as ``<name>.lora_a`` and ``.lora_b``."""
    leaves = {}
    for name, value in inputs.items():
        if isinstance(value, tuple):
            leaves.update({f"{name}.lora_a": value[0], f"{name}.lora_b": value[1]})
        elif isinstance(value, torch.Tensor):
            leaves[name] = value
    return leaves


def _run(inputs, layout, function, dtype=None):
    """Output and every gradient of ``function`` (tigon's or the reference) for one ``dy``."""
    gate, transposed, interleaved, _ = layout

    def copy(value):
        if isinstance(value, tuple):
            return (*leaf_copies(*value[:2], dtype=dtype), value[2])
        return leaf_copies(value, dtype=dtype)[0]

    copies = {name: copy(value) for name, value in inputs.items()} if dtype else inputs
    copies["top_k_index"] = inputs["top_k_index"]
    out = function(**copies, gate=gate, transposed=transposed, interleaved=interleaved)
    dy = torch.randn(out.shape, generator=torch.Generator(DEVICE).manual_seed(1), device=DEVICE)
    out.backward(dy.to(out.dtype))
    grads = {name: t.grad for name, t in _leaves(copies).items() if t.requires_grad}
    return out, grads


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(str(v) for v in layout))
def test_moe_experts_fp32_matches_fp64(shape, layout):
    inputs = _experts(shape, torch.float32, layout)
    out, grads = _run(inputs, layout, tf.moe_experts)
    truth, truth_grads = _run(inputs, layout, reference.moe_experts, dtype=torch.float64)
    assert out.dtype == torch.float32 and out.shape == inputs["hidden_states"].shape
    assert_close(out, truth, torch.float32, "output")
    assert grads.keys() == truth_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype
        # The routing weights' and biases' gradients are sums over many rows.
        assert_close(grad, truth_grads[name], torch.float32, f"grad of {name}", 2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_experts_16bit_within_eager_distance(dtype):
    """In 16 bits, no further from fp64 than transformers' eager experts in that dtype (which
    round every product, the weighted rows and the per-token sums)."""
    shape, layout = SHAPES[0], LAYOUTS[0]
    inputs = _experts(shape, dtype, layout)
    if dtype == torch.bfloat16:
        # Against PEFT's path for LoRA on the experts: the adapters merged into the weights in bf16.
        inputs.update(_adapters(shape, dtype, rank=8))
    out, grads = _run(inputs, layout, tf.moe_experts)
    eager, eager_grads = _run(inputs, layout, reference.moe_experts, dtype=dtype)
    truth, truth_grads = _run(inputs, layout, reference.moe_experts, dtype=torch.float64)

    def distance(actual, expected):
        return ((actual.double() - expected).norm() / expected.norm()).item()

    assert distance(out, truth) <= 1.25 * distance(eager, truth)
    for name, grad in grads.items():
        assert distance(grad, truth_grads[name]) <= 1.25 * distance(eager_grads[name], truth_grads[name]), name


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(str(v) for v in layout))
def test_moe_experts_lora_fp32_matches_fp64(layout):
    """LoRA on both projections of every expert (rank 6: padded to the tensor cores' 16), added
    inside the grouped matmuls: the output and every gradient, the adapters' and the base
    weights', as the reference that merges ``W_e + s·B_e A_e`` first."""
    shape = SHAPES[0]
    inputs = {**_experts(shape, torch.float32, layout), **_adapters(shape, torch.float32, rank=pick(cpu=6, gpu=16))}
    out, grads = _run(inputs, layout, tf.moe_experts)
    truth, truth_grads = _run(inputs, layout, reference.moe_experts, dtype=torch.float64)
    assert_close(out, truth, torch.float32, "output")
    assert grads.keys() == truth_grads.keys() >= {"gate_up_lora.lora_a", "down_lora.lora_b"}
    for name, grad in grads.items():
        assert grad.dtype == torch.float32 and grad.shape == _leaves(inputs)[name].shape
        assert_close(grad, truth_grads[name], torch.float32, f"grad of {name}", 2.0)


@pytest.mark.parametrize("projection", ["gate_up", "down"])
def test_moe_experts_lora_on_one_projection_over_frozen_experts(projection):
    """LoRA training as PEFT sets it up: frozen expert weights (no weight gradient computed), an
    adapter on one projection, some slots dropped (expert parallelism) and an expert with no token."""
    shape, layout = (97, 48, 40, 5, 2), LAYOUTS[0]
    inputs = {**_experts(shape, torch.float32, layout, unused=(3,)), **_adapters(shape, torch.float32, 16, [projection])}
    for name in ("gate_up_proj", "down_proj"):
        inputs[name].requires_grad_(False)
    dropped = torch.rand(inputs["top_k_index"].shape, generator=torch.Generator().manual_seed(3)).to(DEVICE) < 0.3
    inputs["top_k_index"] = inputs["top_k_index"].masked_fill(dropped, shape[3])
    with torch.no_grad():
        inputs["top_k_weights"].masked_fill_(dropped, 0.0)
    out, grads = _run(inputs, layout, functools.partial(tf.moe_experts, allow_dropped=True))
    truth, truth_grads = _run(inputs, layout, reference.moe_experts, dtype=torch.float64)
    assert_close(out, truth, torch.float32, "output")
    assert grads.keys() == {"hidden_states", "top_k_weights", f"{projection}_lora.lora_a", f"{projection}_lora.lora_b"}
    for name, grad in grads.items():
        assert_close(grad, truth_grads[name], torch.float32, f"grad of {name}", 2.0)
    assert not grads[f"{projection}_lora.lora_a"][3].any() and not grads[f"{projection}_lora.lora_b"][3].any()


def test_moe_experts_frozen_lora_still_shapes_the_input_gradient():
    """Frozen adapters (no factor gradient computed) still add their term to the output and to the
    input's gradient."""
    shape, layout = SHAPES[0], LAYOUTS[0]
    inputs = {**_experts(shape, torch.float32, layout), **_adapters(shape, torch.float32, rank=8)}
    for name in ("gate_up_proj", "down_proj", "top_k_weights"):
        inputs[name].requires_grad_(False)
    for lora_a, lora_b, _ in (inputs["gate_up_lora"], inputs["down_lora"]):
        lora_a.requires_grad_(False)
        lora_b.requires_grad_(False)
    out, grads = _run(inputs, layout, tf.moe_experts)
    truth, truth_grads = _run(inputs, layout, reference.moe_experts, dtype=torch.float64)
    assert grads.keys() == {"hidden_states"}
    assert_close(out, truth, torch.float32, "output")
    assert_close(grads["hidden_states"], truth_grads["hidden_states"], torch.float32, "grad of hidden_states")


def test_moe_experts_edge_cases():
    """Experts that receive no token, top-1 routing, a single token, an expert count that is not a
    power of two, no token at all, and frozen expert weights (no weight gradient, the input's
    still exact)."""
    layout = LAYOUTS[0]
    for shape, unused in (((23, 32, 24, 7, 2), (0, 3, 6)), ((19, 32, 24, 5, 1), ()), ((1, 32, 24, 3, 2), ())):
        inputs = _experts(shape, torch.float32, layout, unused)
        out, grads = _run(inputs, layout, tf.moe_experts)
        truth, truth_grads = _run(inputs, layout, reference.moe_experts, dtype=torch.float64)
        assert_close(out, truth, torch.float32, f"output {shape}")
        for name, grad in grads.items():
            assert_close(grad, truth_grads[name], torch.float32, f"grad of {name} {shape}", 2.0)
        for expert in unused:
            assert not grads["gate_up_proj"][expert].any() and not grads["down_proj"][expert].any()
    inputs = _experts((0, 32, 24, 3, 2), torch.float32, layout)
    out, grads = _run(inputs, layout, tf.moe_experts)
    assert out.shape == (0, 32) and grads["hidden_states"].shape == (0, 32)
    assert not grads["gate_up_proj"].any() and not grads["down_proj"].any()
    inputs = _experts(SHAPES[0], torch.float32, layout)
    for name in ("gate_up_proj", "down_proj", "top_k_weights"):
        inputs[name].requires_grad_(False)
    out, grads = _run(inputs, layout, tf.moe_experts)
    truth, truth_grads = _run(inputs, layout, reference.moe_experts, dtype=torch.float64)
    assert grads.keys() == {"hidden_states"}
    assert_close(grads["hidden_states"], truth_grads["hidden_states"], torch.float32, "grad of hidden_states")


@pytest.mark.parametrize("shape, layout", [
    *((SHAPES[0], layout) for layout in LAYOUTS),
    ((37, 32, 24, 1, 1), LAYOUTS[0]),  # one expert on this rank: every slot kept or dropped
], ids=lambda value: "-".join(str(v) for v in value))
def test_dropped_slots_add_nothing_and_get_no_gradient(shape, layout):
    """Slots routed to id E (expert parallelism's slots of another rank's experts), which
    moe_experts takes with allow_dropped only, add nothing to the output or to any gradient, and
    their weights' gradient is 0. Uninitialised memory is NaN here (deterministic mode), so a row
    that no kernel writes shows."""
    inputs = _experts(shape, torch.float32, layout)
    n_experts = inputs["gate_up_proj"].shape[0]
    index = inputs["top_k_index"]
    dropped = torch.rand(index.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE) < 0.5
    dropped[0] = True  # a token with no slot here
    inputs["top_k_index"] = index.masked_fill(dropped, n_experts)
    with torch.no_grad():
        inputs["top_k_weights"].masked_fill_(dropped, 0.0)
    with pytest.raises(ValueError, match=rf"top_k_index must hold expert ids in \[0, {n_experts}\), .*"
                                         rf"got ids from 0 to {n_experts}$"):
        tf.moe_experts(**inputs, gate=layout[0], transposed=layout[1], interleaved=layout[2])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
        torch.use_deterministic_algorithms(True)
        try:
            out, grads = _run(inputs, layout, functools.partial(tf.moe_experts, allow_dropped=True))
        finally:
            torch.use_deterministic_algorithms(False)
    truth, truth_grads = _run(inputs, layout, reference.moe_experts, dtype=torch.float64)
    assert not out[0].any()
    assert_close(out, truth, torch.float32, "output")
    assert not grads["top_k_weights"][dropped].any()
    for name, grad in grads.items():
        assert_close(grad, truth_grads[name], torch.float32, f"grad of {name}", 2.0)


def test_routing_schedule_covers_every_row_once():
    top_k_index, _ = _routing(37, 6, 3, unused=(2,))
    order, row_token, expert_end, tile_expert, tile_row = moe.routing(top_k_index, 6, block_m=4)
    flat = top_k_index.reshape(-1)
    assert torch.equal(row_token.long(), order.long() // 3)
    assert torch.equal(flat[order.long()], flat.sort(stable=True).values)
    assert expert_end.tolist() == torch.bincount(flat, minlength=6).cumsum(0).tolist()
    starts = [0, *expert_end.tolist()[:-1]]
    covered = []
    for expert, row in zip(tile_expert.tolist(), tile_row.tolist()):
        if expert < 0:
            continue
        assert starts[expert] <= row < expert_end[expert]
        covered += range(row, min(row + 4, expert_end[expert]))
    assert sorted(covered) == list(range(flat.numel()))


def test_moe_experts_refuses_bad_input():
    inputs = _experts(SHAPES[0], torch.float32, LAYOUTS[0])
    n_experts = inputs["gate_up_proj"].shape[0]
    bad_ids = inputs["top_k_index"].clone()
    bad_ids[3, 1] = n_experts
    with pytest.raises(ValueError, match=rf"top_k_index must hold expert ids in \[0, {n_experts}\).*got ids from 0 to {n_experts}"):
        tf.moe_experts(**{**inputs, "top_k_index": bad_ids})
    bad_ids[3, 1] = n_experts + 1
    with pytest.raises(ValueError, match=rf"top_k_index must hold expert ids in \[0, {n_experts}\] \({n_experts}: a dropped "
                                         rf"slot.*got ids from 0 to {n_experts + 1}"):
        tf.moe_experts(**{**inputs, "top_k_index": bad_ids}, allow_dropped=True)
    bad_ids[3, 1] = -1
    with pytest.raises(ValueError, match=r"got ids from -1 to"):
        tf.moe_experts(**{**inputs, "top_k_index": bad_ids}, allow_dropped=True)
    with pytest.raises(ValueError, match=r"down_proj must have shape .*\[E, H, I\]"):
        tf.moe_experts(**{**inputs, "down_proj": inputs["down_proj"][:, :, :-1]})
    with pytest.raises(ValueError, match=r"gate_up_proj must have shape .*transposed \[E, H, 2I\]"):
        tf.moe_experts(**inputs, transposed=True)
    with pytest.raises(ValueError, match=r"top_k_weights must have shape .*as top_k_index"):
        tf.moe_experts(**{**inputs, "top_k_weights": inputs["top_k_weights"][:, :1]})
    with pytest.raises(ValueError, match=r"gate must be one of"):
        tf.moe_experts(**inputs, gate="relu")
    with pytest.raises(TypeError, match=r"top_k_index"):
        tf.moe_experts(**{**inputs, "top_k_index": inputs["top_k_index"].float()})
    with pytest.raises(TypeError, match=r"one dtype, got .*down_proj torch.float16"):
        tf.moe_experts(**{**inputs, "down_proj": inputs["down_proj"].half()})
    lora_a, lora_b, scaling = _adapters(SHAPES[0], torch.float32, 4, ["gate_up"])["gate_up_lora"]
    n_inter = inputs["down_proj"].shape[2]
    with pytest.raises(TypeError, match=r"^gate_up_lora must be None or \(lora_a, lora_b, scaling\), got Tensor$"):
        tf.moe_experts(**inputs, gate_up_lora=lora_a)
    with pytest.raises(ValueError, match=rf"^down_lora\[1\] \(lora_b\) must have shape \({n_experts}, 80, 4\) "
                                         r"\(\[E, out_features of the base weight, rank of lora_a\]\)"):
        tf.moe_experts(**inputs, down_lora=(lora_a[:, :, :n_inter], lora_a[:, :, :n_inter], scaling))
    with pytest.raises(ValueError, match=r"^gate_up_lora\[0\] \(lora_a\) must have 3 dimension"):
        tf.moe_experts(**inputs, gate_up_lora=(lora_a[0], lora_b, scaling))
    with pytest.raises(TypeError, match=r"one dtype, got hidden_states torch.float32, gate_up_lora\[0\] \(lora_a\) "
                                        r"torch.bfloat16"):
        tf.moe_experts(**inputs, gate_up_lora=(lora_a.bfloat16(), lora_b.bfloat16(), scaling))


def test_moe_experts_names_the_layout_of_gate_up_proj():
    # E 4, H 12, I 8 given in the [E, H, 2I] layout without transposed=True: the expected shape is
    # [E, 2I, H] = (4, 16, 12), read from the tensor's own 2I axis, and the flag that fits it is named.
    n_experts, hidden, inter, n_tokens = 4, 12, 8, 5
    x = randn(n_tokens, hidden)
    top_k_index = torch.randint(0, n_experts, (n_tokens, 2), device=DEVICE)
    top_k_weights = torch.rand(n_tokens, 2, device=DEVICE)
    gate_up, down = randn(n_experts, hidden, 2 * inter), randn(n_experts, inter, hidden)
    with pytest.raises(ValueError, match=r"^gate_up_proj must have shape \(4, 16, 12\) \(\[E, 2I, H\] with E = 4 "
                                         r"experts, H = 12 of hidden_states, I = 8\), got \(4, 12, 16\): that is the "
                                         r"transposed \[E, H, 2I\] layout, pass transposed=True$"):
        tf.moe_experts(x, top_k_index, top_k_weights, gate_up, down)
    with pytest.raises(ValueError, match=r"^gate_up_proj must have shape \(4, 12, 16\) \(transposed \[E, H, 2I\].*"
                                         r"pass transposed=False$"):
        tf.moe_experts(x, top_k_index, top_k_weights, gate_up.transpose(1, 2), down, transposed=True)
    with pytest.raises(ValueError, match=r"^down_proj must have shape \(4, 12, 8\) \(\[E, H, I\], H = 12 of "
                                         r"hidden_states, I = 8 from gate_up_proj\), got \(4, 8, 12\)$"):
        tf.moe_experts(x, top_k_index, top_k_weights, gate_up.transpose(1, 2), down)


@pytest.mark.skipif(not ON_GPU, reason="needs tensors past 2^31 elements")
def test_moe_experts_offsets_past_int32():
    """Row offsets of ``x`` and ``dx`` past 2³¹ elements: the last tokens match the reference."""
    n_tokens, hidden, inter, n_experts = 2**31 // 4096 + 3000, 4096, 64, 4
    x = randn(n_tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    index = torch.randint(0, n_experts, (n_tokens, 1), device=DEVICE)
    weights = torch.rand(n_tokens, 1, device=DEVICE)
    gate_up = randn(n_experts, 2 * inter, hidden, dtype=torch.bfloat16, scale=hidden**-0.5)
    down = randn(n_experts, hidden, inter, dtype=torch.bfloat16, scale=inter**-0.5)
    out = tf.moe_experts(x, index, weights, gate_up, down)
    dy = torch.zeros_like(out)
    dy[-2000:] = torch.randn(2000, hidden, device=DEVICE, dtype=dy.dtype)
    out.backward(dy)
    tail = x[-2000:].detach().double().requires_grad_()
    truth = reference.moe_experts(tail, index[-2000:], weights[-2000:].double(), gate_up.double(), down.double())
    truth.backward(dy[-2000:].double())
    assert_close(out[-2000:], truth, torch.bfloat16, "output of the last tokens")
    assert_close(x.grad[-2000:], tail.grad, torch.bfloat16, "grad of the last tokens", 2.0)
