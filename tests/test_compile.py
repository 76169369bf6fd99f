"""Every op is a registered custom op: torch.compile(fullgraph=True) traces a model using all of
them without a graph break, and the compiled model computes what the eager one does."""

import pytest
import torch

import tigon.functional as tf
from tigon import nn as tnn
from utils import DEVICE, ON_GPU, randn

# Inductor on the GPU; on the CPU AOTAutograd's eager backend, which traces forward and backward
# exactly as inductor would see them, without spending minutes generating C++.
BACKEND = "inductor" if ON_GPU else "aot_eager"


class TinyBlock(torch.nn.Module):
    def __init__(self, hidden=64, heads=4, kv_heads=2, inter=96, vocab=130):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm = tnn.RMSNorm(hidden)
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(kv_heads * self.head_dim, hidden, bias=False)
        self.post_norm = tnn.LayerNorm(hidden)
        self.mlp = tnn.SwiGLUMLP(hidden, inter)
        self.geglu_mlp = tnn.GeGLUMLP(hidden, inter)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, cos, sin, target):
        batch, seq, _ = x.shape
        h = self.norm(x)
        q = self.q_proj(h).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = tf.rope(q, k, cos, sin)
        mixed = q[:, : self.kv_heads] + k
        attn = self.o_proj(mixed.transpose(1, 2).reshape(batch, seq, -1))
        normed, residual = tf.fused_add_rms_norm(attn, x, self.norm.weight)
        h = self.mlp(self.post_norm(normed)) + self.geglu_mlp(normed) + residual
        flat = h.reshape(-1, h.shape[-1])
        logits = self.lm_head(flat)
        ce = tf.cross_entropy(logits, target.reshape(-1), inplace_backward=True)
        flce = tf.fused_linear_cross_entropy(flat, self.lm_head.weight, target.reshape(-1), chunk_memory_bytes=4096)
        return ce + flce


def _block_inputs(seed, batch=2, seq=12):
    """``(x, cos, sin, target)`` for TinyBlock; how many targets are ignored changes with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, 64, generator=generator).to(DEVICE)
    angles = torch.rand(1, seq, 8, generator=generator) * 6.28
    angles = torch.cat((angles, angles), dim=-1).to(DEVICE)
    target = torch.randint(0, 130, (batch, seq), generator=generator)
    target[0, : 3 + seed] = -100
    return x, angles.cos(), angles.sin(), target.to(DEVICE)


def _loss_and_grads(model, fn, inputs):
    model.zero_grad()
    loss = fn(*inputs)
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_fullgraph_compile_matches_eager():
    torch.manual_seed(0)
    model = TinyBlock().to(DEVICE)
    inputs = _block_inputs(0)
    eager_loss, eager_grads = _loss_and_grads(model, model, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    compiled_loss, compiled_grads = _loss_and_grads(model, compiled, inputs)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_reduce_overhead_compile_replays_as_eager():
    """``mode="reduce-overhead"`` records forward and backward as CUDA graphs (cudagraph trees) with
    tigon's ops inside and replays them: on new inputs, with a different count of ignored targets
    each time (the losses' mean divides by it on the device), the loss and gradients are eager's."""
    torch.manual_seed(0)
    model = TinyBlock().to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for seed in range(5):  # the first calls warm up and record; the later ones replay
        inputs = _block_inputs(seed)
        eager_loss, eager_grads = _loss_and_grads(model, model, inputs)
        torch.compiler.cudagraph_mark_step_begin()
        compiled_loss, compiled_grads = _loss_and_grads(model, compiled, inputs)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6, msg=f"loss, call {seed}")
        for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
            torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6, msg=f"gradient, call {seed}")


@pytest.mark.slow
def test_lora_paths_compile_fullgraph():
    """The LoRA functions keep their inputs through a separate node in eager mode; traced, they
    save them themselves, and the compiled result is the eager one."""
    torch.manual_seed(0)
    hidden, inter, rank = 32, 48, 4
    x = randn(2, 5, hidden, requires_grad=True)
    projection = randn(hidden, hidden, scale=hidden**-0.5)
    mlp = [randn(inter, hidden, scale=hidden**-0.5), randn(inter, hidden, scale=hidden**-0.5),
           randn(hidden, inter, scale=inter**-0.5)]

    def adapter(n_out, n_in, scaling):
        return randn(rank, n_in, requires_grad=True), randn(n_out, rank, requires_grad=True), scaling

    adapters = [adapter(hidden, hidden, 0.5), adapter(hidden, hidden, 1.5),
                *(adapter(*weight.shape, 2.0) for weight in mlp)]

    def block(x):
        h = tf.lora_linear(x, projection, *adapters[0])
        h = tf.add_lora(h, x, *adapters[1])
        return tf.swiglu_mlp(h, *mlp, gate_lora=adapters[2], up_lora=adapters[3], down_lora=adapters[4]).square().sum()

    leaves = [x, *(t for a in adapters for t in a[:2])]
    eager = torch.autograd.grad(block(x), leaves)
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(block, fullgraph=True, backend=BACKEND)(x), leaves)
    for compiled_grad, eager_grad in zip(compiled, eager):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["", "lora"])
def test_moe_experts_compile_fullgraph(lora):
    """The experts' routing and kernels are custom ops: a fullgraph compile matches eager mode,
    with LoRA adapters on the experts (frozen) too."""
    torch.manual_seed(0)
    tokens, hidden, inter, n_experts, top_k, rank = 21, 32, 24, 5, 2, 4
    x = randn(tokens, hidden, requires_grad=True)
    router = randn(n_experts, hidden, requires_grad=True)
    gate_up = randn(n_experts, 2 * inter, hidden, requires_grad=not lora, scale=hidden**-0.5)
    down = randn(n_experts, hidden, inter, requires_grad=not lora, scale=inter**-0.5)
    factors = [randn(n_experts, rank, hidden, requires_grad=True), randn(n_experts, 2 * inter, rank, requires_grad=True),
               randn(n_experts, rank, inter, requires_grad=True), randn(n_experts, hidden, rank, requires_grad=True)]
    adapters = dict(gate_up_lora=(*factors[:2], 0.5), down_lora=(*factors[2:], 0.5)) if lora else {}

    def block(x):
        weights, index = torch.topk(torch.softmax(x @ router.T, dim=-1), top_k, dim=-1)
        return tf.moe_experts(x, index, weights, gate_up, down, **adapters).square().sum()

    leaves = [x, router, *(factors if lora else (gate_up, down))]
    eager = torch.autograd.grad(block(x), leaves)
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(block, fullgraph=True, backend=BACKEND)(x), leaves)
    for compiled_grad, eager_grad in zip(compiled, eager):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-5)
