"""CUDA-graph capture of tigon's ops and of a patched Hugging Face model's whole training step.

A captured graph replays its kernels with no host involvement, so nothing in it may wait for the
GPU (capture refuses a host sync) or take a decision on the host from a GPU value (the decision
would be frozen at capture). Each GPU test warms up on a side stream, as PyTorch requires before
capture (Triton compiles its kernels, the caching allocator and the optimizer's state settle),
captures, then replays on new inputs copied into the captured ones and compares each replay with
the same work run eagerly on those inputs. The inputs change where a frozen host value would show:
the number of ignored targets (the mean's divisor) and a target out of range, which eager refuses
and a graph ignores (so the eager run it is compared with has ``ignore_index`` there).

A replay runs the kernels the eager call runs, on the same values: the two agree to rounding
(``REPLAY_TOLERANCE``); a divisor frozen at capture or a stale input would be off by far more.

The first test also runs on the CPU: with host syncs forbidden as under capture, tigon's code reads
no tensor value on the host during a patched model's forward and backward.

On a GPU: ``python -m pytest tests/test_cuda_graphs.py -v``.
"""

import copy
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import tigon
import tigon.functional as tf
import tigon.losses
import tigon.ops.cross_entropy as cross_entropy_ops
import tigon.ops.fused_linear as fused_linear_ops
import tigon.ops.fused_linear_logprobs as fused_linear_logprobs_ops
from tigon.transformers import apply_tigon
from utils import DEVICE, TOLERANCE, relative_error

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

REPLAY_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}
IGNORE_INDEX = -100


def warm_up_and_capture(step: Callable, static_inputs, warmup_inputs):
    """Run ``step`` on each of ``warmup_inputs`` (copied into ``static_inputs``) on a side stream,
    then capture ``step(*static_inputs)``. Returns the graph and the captured call's outputs,
    which every replay overwrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for inputs in warmup_inputs:
            copy_into(static_inputs, inputs)
            step(*static_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(*static_inputs)
    return graph, outputs


def copy_into(static_inputs, inputs) -> None:
    with torch.no_grad():
        for static, new in zip(static_inputs, inputs):
            static.copy_(new)


# --- No host read of a tensor by tigon's code where syncs are forbidden (CPU and GPU) ---


class TigonHostReads(TorchDispatchMode):
    """Records where tigon's code reads a tensor's value on the host (``.item()``, ``bool()``,
    ``int()``; ``.tolist()`` through :meth:`watch_tolist`): on a GPU each read waits for it, and
    capture refuses it. Reads by other libraries (transformers checks its own capture state) are
    theirs to avoid."""

    TIGON = os.path.dirname(tigon.__file__)
    TORCH = os.path.dirname(torch.__file__)

    def __init__(self):
        super().__init__()
        self.places = []

    def record(self):
        for frame in reversed(traceback.extract_stack()):
            if frame.filename.startswith(self.TORCH) or frame.filename == __file__:
                continue
            if frame.filename.startswith(self.TIGON):
                self.places.append(f"{frame.filename}:{frame.lineno}")
            return

    def watch_tolist(self, monkeypatch):
        tolist = torch.Tensor.tolist

        def recorded_tolist(tensor):
            self.record()
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", recorded_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A scalar read (item, bool, int) and nonzero, whose output size the host must know.
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero):
            self.record()
        return func(*args, **(kwargs or {}))


def tiny_llama(vocab=160, hidden=32, layers=2, seed=0):
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
        # SDPA without a padding mask builds no mask (it passes is_causal); eager attention's mask
        # copies a host scalar to the GPU at every call, which capture refuses. The GPU tests run SDPA's
        # math backend (math_sdpa), deterministic: the graph and the eager run compute the same bits.
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def batch(vocab, batch_size, seq_len, seed, device=DEVICE):
    """``(input_ids, labels)`` whose count of ignored labels changes with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    labels = input_ids.clone()
    labels[0, : 3 + 5 * seed] = IGNORE_INDEX
    labels[-1, -(1 + seed % 3) :] = IGNORE_INDEX
    return input_ids.to(device), labels.to(device)


@pytest.mark.parametrize("loss", ["fused_linear_cross_entropy", "cross_entropy"])
def test_no_host_read_by_tigon_where_syncs_are_forbidden(monkeypatch, hugging_face_modules_restored, loss):
    """Catches on any device what capture would refuse on a GPU: with host syncs forbidden, as
    during capture, tigon's code reads no tensor value on the host in a patched model's forward
    and backward (its loss, norms, rotary embedding, MLP), nor in the log-probs head's backward
    with ``grad_in_forward``."""
    for module in (cross_entropy_ops, fused_linear_ops, fused_linear_logprobs_ops):
        monkeypatch.setattr(module, "host_sync_allowed", lambda tensor: False)
    model = tiny_llama().to(DEVICE)
    fused = loss == "fused_linear_cross_entropy"
    apply_tigon(model, fused_linear_cross_entropy=fused, cross_entropy=not fused)
    model.train()
    input_ids, labels = batch(160, 2, 16, seed=1)
    target = labels.reshape(-1)
    hidden = torch.randn(target.numel(), 32, device=DEVICE, requires_grad=True)
    weight = torch.randn(160, 32, device=DEVICE, requires_grad=True)
    reads = TigonHostReads()
    reads.watch_tolist(monkeypatch)
    with reads:
        model(input_ids=input_ids, labels=labels).loss.backward()
        log_probs = tf.fused_linear_logprobs(hidden, weight, target, chunk_memory_bytes=10 * 160 * 4,
                                             grad_in_forward=True)[0]
        log_probs.sum().backward()
    assert not reads.places, f"host reads of GPU values by tigon at {reads.places}"


# --- Each op family: forward and backward captured, replayed on new inputs ---


@dataclass
class OpCase:
    """``inputs(seed, dtype)`` → the op's arguments (differentiable ones require grad) and, last,
    the upstream gradient; ``forward(*arguments)`` → a scalar, whose gradients with respect to
    the arguments that require grad are compared too. ``vocab``: the targets' class count, for
    the ops that take targets (as the argument before the upstream gradient)."""

    forward: Callable
    inputs: Callable
    vocab: int | None = None


def _targets(n_rows, vocab, seed, generator):
    target = torch.randint(0, vocab, (n_rows,), generator=generator)
    target[torch.randperm(n_rows, generator=generator)[: 5 + 20 * seed]] = IGNORE_INDEX
    return target


def _randn(generator, *shape, dtype, requires_grad=True, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(DEVICE, dtype).requires_grad_(requires_grad)


def _norm_inputs(seed, dtype, bias=False):
    generator = torch.Generator().manual_seed(seed)
    x = _randn(generator, 4, 33, 256, dtype=dtype)
    weight = _randn(generator, 256, dtype=dtype)
    extra = [_randn(generator, 256, dtype=dtype)] if bias else []
    return [x, weight, *extra, _randn(generator, 4, 33, 256, dtype=torch.float32, requires_grad=False)]


def _rope_inputs(seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    angles = torch.rand(1, 48, 32, generator=generator) * 6.28
    angles = torch.cat((angles, angles), dim=-1).to(DEVICE)
    q, k = _randn(generator, 2, 4, 48, 64, dtype=dtype), _randn(generator, 2, 2, 48, 64, dtype=dtype)
    upstream = _randn(generator, 2 * 4 * 48 * 64 + 2 * 2 * 48 * 64, dtype=torch.float32, requires_grad=False)
    return [q, k, angles.cos(), angles.sin(), upstream]


def _gated_inputs(seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    return [_randn(generator, 300, 512, dtype=dtype), _randn(generator, 300, 512, dtype=dtype),
            _randn(generator, 300, 512, dtype=torch.float32, requires_grad=False)]


def _head_inputs(n_rows, hidden, vocab, bias, reduction):
    def inputs(seed, dtype):
        generator = torch.Generator().manual_seed(seed)
        tensors = [_randn(generator, n_rows, hidden, dtype=dtype),
                   _randn(generator, vocab, hidden, dtype=dtype, scale=hidden**-0.5)]
        if bias:
            tensors.append(_randn(generator, vocab, dtype=dtype))
        if reduction == "uniform":
            upstream = torch.full((n_rows,), -0.37)
        else:
            upstream = torch.randn((n_rows,) if reduction in ("none", "per_token") else (), generator=generator)
        return [*tensors, _targets(n_rows, vocab, seed, generator).to(DEVICE), upstream.to(DEVICE)]

    return inputs


def _weighted(out, upstream):
    return (out.float() * upstream).sum()


def _cross_entropy(reduction, **options):
    def forward(hidden, weight, target, upstream):
        # Logits from a matmul, as in a model: with inplace_backward the gradient overwrites them.
        logits = hidden @ weight.t()
        return _weighted(tf.cross_entropy(logits, target, reduction=reduction, **options), upstream)

    return OpCase(forward, _head_inputs(512, 64, 2000, False, reduction), vocab=2000)


def _fused_linear_cross_entropy(reduction, **options):
    def forward(hidden, weight, bias, target, upstream):
        # 3000 classes of fp32 logits in chunks of 256 rows: three chunks, the last partial.
        loss = tf.fused_linear_cross_entropy(
            hidden, weight, target, bias, reduction=reduction, chunk_memory_bytes=256 * 3000 * 4, **options,
        )
        return _weighted(loss, upstream)

    return OpCase(forward, _head_inputs(600, 128, 3000, True, reduction), vocab=3000)


def _fused_linear_logprobs(upstream_kind):
    def forward(hidden, weight, bias, target, upstream):
        log_probs, entropy = tf.fused_linear_logprobs(
            hidden, weight, target, bias, outputs=("log_probs", "entropy"), chunk_memory_bytes=256 * 3000 * 4,
            grad_in_forward=True,
        )[:2]
        loss = _weighted(log_probs, upstream)
        return loss if upstream_kind == "uniform" else loss - entropy.sum()

    return OpCase(forward, _head_inputs(600, 128, 3000, True, upstream_kind), vocab=3000)


def _fused_linear_jsd_inputs(seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    n_rows, hidden, teacher_hidden, vocab = 600, 128, 192, 3000
    return [
        _randn(generator, n_rows, hidden, dtype=dtype),
        _randn(generator, vocab, hidden, dtype=dtype, scale=hidden**-0.5),
        # The teacher is fixed: it requires no gradient.
        _randn(generator, n_rows, teacher_hidden, dtype=dtype, requires_grad=False),
        _randn(generator, vocab, teacher_hidden, dtype=dtype, requires_grad=False, scale=teacher_hidden**-0.5),
        # The labels only mask rows (any value but ignore_index counts): no out-of-range case.
        _targets(n_rows, vocab, seed, generator).to(DEVICE),
        torch.randn((), generator=generator).to(DEVICE),
    ]


def _fused_linear_jsd(hidden, weight, teacher_hidden, teacher_weight, labels, upstream):
    # Both models' logits of 3000 classes in chunks of 256 rows: three chunks, the last partial.
    loss = tigon.losses.fused_linear_jsd(
        hidden, weight, teacher_hidden, teacher_weight, labels, beta=0.4, temperature=2.0,
        chunk_memory_bytes=256 * 3000 * (hidden.element_size() + teacher_hidden.element_size()),
    )
    return _weighted(loss, upstream)


OP_CASES = {
    "rms_norm": OpCase(lambda x, w, up: _weighted(tf.rms_norm(x, w), up), _norm_inputs),
    "layer_norm": OpCase(lambda x, w, b, up: _weighted(tf.layer_norm(x, w, b), up),
                         lambda seed, dtype: _norm_inputs(seed, dtype, bias=True)),
    "rope": OpCase(
        lambda q, k, cos, sin, up: _weighted(torch.cat([t.flatten() for t in tf.rope(q, k, cos, sin)]), up),
        _rope_inputs,
    ),
    "swiglu": OpCase(lambda gate, up_proj, up: _weighted(tf.swiglu(gate, up_proj), up), _gated_inputs),
    "geglu": OpCase(lambda gate, up_proj, up: _weighted(tf.geglu(gate, up_proj), up), _gated_inputs),
    "cross_entropy-mean": _cross_entropy("mean"),
    "cross_entropy-none": _cross_entropy("none"),
    "cross_entropy-mean-inplace": _cross_entropy("mean", inplace_backward=True),
    "cross_entropy-options": _cross_entropy(
        "mean", label_smoothing=0.1, lse_square_scale=1e-3, softcap=30.0, inplace_backward=True,
    ),
    "fused_linear_cross_entropy-mean": _fused_linear_cross_entropy("mean"),
    "fused_linear_cross_entropy-sum": _fused_linear_cross_entropy("sum"),
    "fused_linear_cross_entropy-none": _fused_linear_cross_entropy("none"),
    "fused_linear_cross_entropy-options": _fused_linear_cross_entropy(
        "mean", label_smoothing=0.1, lse_square_scale=1e-3, softcap=30.0,
    ),
    # SFT's uniform log-probs gradient, which grad_in_forward serves from the forward's gradients
    # (checked on the device under capture); GRPO's per-token one with an entropy term.
    "fused_linear_logprobs-uniform": _fused_linear_logprobs("uniform"),
    "fused_linear_logprobs-per_token": _fused_linear_logprobs("per_token"),
    # The mean's divisor counted on the device, the number of ignored rows changing per replay.
    "fused_linear_jsd": OpCase(_fused_linear_jsd, _fused_linear_jsd_inputs),
}


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_forward_and_backward_replay_as_eager(name, dtype):
    case = OP_CASES[name]

    def step(*arguments):
        out = case.forward(*arguments)
        differentiable = [t for t in arguments if t.requires_grad]
        return (out.detach(), *torch.autograd.grad(out, differentiable))

    static_inputs = case.inputs(0, dtype)
    graph, static_outputs = warm_up_and_capture(step, static_inputs, [case.inputs(0, dtype)] * 3)
    for seed in (1, 2, 3):
        replay_inputs = case.inputs(seed, dtype)
        eager_inputs = case.inputs(seed, dtype)
        if case.vocab is not None and seed == 3:
            # Out of range: ignored by the graph, refused by eager, which gets ignore_index there.
            replay_inputs[-2][[0, 7]] = torch.tensor([case.vocab, -3], device=DEVICE)
            eager_inputs[-2][[0, 7]] = IGNORE_INDEX
        copy_into(static_inputs, replay_inputs)
        graph.replay()
        expected = step(*eager_inputs)
        for what, replayed, eager in zip(("output", "gradients"), static_outputs, expected):
            torch.testing.assert_close(replayed, eager, **REPLAY_TOLERANCE[dtype], msg=f"{name}, seed {seed}: {what}")


@requires_cuda
@pytest.mark.parametrize("name", ["cross_entropy-mean", "cross_entropy-mean-inplace", "fused_linear_cross_entropy-mean"])
def test_mean_over_no_target_replays_as_nan(name):
    """A replay whose targets are all ignored: the mean's 0 / 0 is taken on the device, NaN as
    PyTorch's, with zero gradients, though the graph was captured with counted targets."""
    case = OP_CASES[name]

    def step(*arguments):
        out = case.forward(*arguments)
        return (out.detach(), *torch.autograd.grad(out, [t for t in arguments if t.requires_grad]))

    static_inputs = case.inputs(0, torch.float32)
    graph, static_outputs = warm_up_and_capture(step, static_inputs, [case.inputs(0, torch.float32)] * 3)
    replay_inputs = case.inputs(1, torch.float32)
    replay_inputs[-2].fill_(IGNORE_INDEX)
    copy_into(static_inputs, replay_inputs)
    graph.replay()
    loss, *grads = static_outputs
    assert loss.isnan()
    assert all(not grad.any() for grad in grads)


# --- A patched Llama's whole training step ---


@pytest.fixture
def math_sdpa():
    """SDPA's math backend and PyTorch's deterministic algorithms (the embedding's backward then
    sorts instead of adding with atomics): the eager and the replayed steps compute the same bits."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic)


@requires_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_llama_training_step_replays_as_eager_steps(hugging_face_modules_restored, math_sdpa, precision):
    """Forward, backward and AdamW's step of a patched 2-layer Llama, captured in one graph and
    replayed on new batches, give the losses, gradients and weights of the same steps run
    eagerly from the same weights (after the same warm-up steps)."""
    vocab, batch_size, seq_len, warmup, replays = 1000, 4, 128, 3, 4
    base = tiny_llama(vocab=vocab, hidden=256)

    def patched_copy():
        model = apply_tigon(copy.deepcopy(base).cuda())
        model.train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    def train_step(model, optimizer):
        def step(input_ids, labels):
            optimizer.zero_grad(set_to_none=True)
            # Autocast's weight cache would keep casts made at capture: it must be off in a graph.
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision != "fp32", cache_enabled=False):
                loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            return loss.detach()

        return step

    batches = [batch(vocab, batch_size, seq_len, seed) for seed in range(warmup + replays)]
    eager_model, eager_optimizer = patched_copy()
    eager_step = train_step(eager_model, eager_optimizer)
    def gradients_and_weights(model):
        return [(name, p.grad.clone(), p.detach().clone()) for name, p in model.named_parameters()]

    eager_losses = []
    for step, inputs in enumerate(batches):
        eager_losses.append(eager_step(*inputs).clone())
        if step == warmup:
            eager_first = gradients_and_weights(eager_model)

    graph_model, graph_optimizer = patched_copy()
    static_inputs = [tensor.clone() for tensor in batches[0]]
    graph, static_loss = warm_up_and_capture(train_step(graph_model, graph_optimizer), static_inputs,
                                             batches[:warmup])
    graph_losses = []
    for replay, inputs in enumerate(batches[warmup:]):
        copy_into(static_inputs, inputs)
        graph.replay()
        graph_losses.append(static_loss.clone())
        if replay == 0:
            graph_first = gradients_and_weights(graph_model)

    # Deterministic algorithms make the embedding's backward sort rather than add with atomics, but
    # cuBLAS may still pick other algorithms inside a capture: the runs differ in the last bits, which
    # later steps carry on (a bf16 loss by 1.0e-5 of itself after 7 steps, measured on the H100, its
    # gradients by 1% by then). So the losses are compared at every replay, and the gradients and
    # weights after the first, one step from the same state. Each step moves a weight by about
    # lr = 1e-3, a twentieth of its scale, which a replay that skipped the optimizer, or read a stale
    # batch, would be off by; a mean's divisor frozen at capture would change the loss by more than
    # 1e-3 of itself. Under bf16 autocast a differing last bit is a bf16 one: gradients and weights
    # compare by bf16's norm-wise tolerance.
    loss_rtol = 1e-5 if precision == "fp32" else 1e-4
    torch.testing.assert_close(torch.stack(graph_losses), torch.stack(eager_losses[warmup:]), rtol=loss_rtol, atol=0)
    for (name, graph_grad, graph_weight), (_, eager_grad, eager_weight) in zip(graph_first, eager_first):
        if precision == "fp32":
            torch.testing.assert_close(graph_grad, eager_grad, rtol=1e-4, atol=1e-7, msg=f"grad of {name}")
            torch.testing.assert_close(graph_weight, eager_weight, rtol=1e-4, atol=1e-5, msg=name)
        else:
            assert relative_error(graph_grad, eager_grad) < TOLERANCE[torch.bfloat16], f"grad of {name}"
            assert relative_error(graph_weight, eager_weight) < TOLERANCE[torch.bfloat16], name
