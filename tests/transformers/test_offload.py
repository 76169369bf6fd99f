"""Offloaded checkpoints (tigon.transformers.offload through set_checkpointing(..., offload=True)).

On the CPU the offloader runs its whole path without streams (a copy into a host buffer and back);
on a GPU the copies run on a side stream, pinned, with the next layer's input fetched ahead. Either
way the losses and gradients must be bitwise those of the same plan without offload, the saved
inputs must really leave (counted by the saved-tensor hooks), and the buffers must be reused.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_peft_lora import lora_model
from tiny_models import loss_and_grads, tiny_batch, tiny_model
from utils import ON_GPU

from tigon.transformers import apply_tigon, offload_host_bytes, set_checkpointing
from tigon.transformers.offload import ActivationOffloader, OffloadedCheckpoint

N_LAYERS = 4


@pytest.mark.parametrize("patched", [False, True], ids=["hf", "tigon"])
@pytest.mark.parametrize("kept", [0, 2])
def test_offload_gives_bitwise_the_gradients_of_the_same_plan(patched, kept):
    model = tiny_model("llama", num_hidden_layers=N_LAYERS).train()
    if patched:
        apply_tigon(model)
    input_ids, labels = tiny_batch()
    set_checkpointing(model, kept)
    truth_loss, truth_grads = loss_and_grads(model, input_ids, labels)
    set_checkpointing(model, kept, offload=True)
    for step in range(2):  # the second step reuses the first one's buffers
        loss, grads = loss_and_grads(model, input_ids, labels)
        assert torch.equal(loss, truth_loss), f"step {step}"
        assert grads.keys() == truth_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, truth_grads[name]), f"step {step}: {name}'s gradient differs"


@pytest.mark.parametrize("model_type", ["peft_lora", "qwen3_moe"])
def test_offload_composes_with_peft_and_moe_experts(model_type):
    if model_type == "peft_lora":
        model = lora_model("peft_then_patch")
    else:
        model = apply_tigon(tiny_model("qwen3_moe", num_hidden_layers=N_LAYERS).train())
    input_ids, labels = tiny_batch()
    set_checkpointing(model, 0)
    truth_loss, truth_grads = loss_and_grads(model, input_ids, labels)
    set_checkpointing(model, 0, offload=True)
    loss, grads = loss_and_grads(model, input_ids, labels)
    assert torch.equal(loss, truth_loss) and grads.keys() == truth_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, truth_grads[name]), name
    assert offload_host_bytes(model) > 0


def test_offload_wraps_only_the_recomputed_layers_and_undoes():
    model = apply_tigon(tiny_model("llama", num_hidden_layers=N_LAYERS).train())
    set_checkpointing(model, 1, offload=True)
    wrapped = [isinstance(layer._gradient_checkpointing_func, OffloadedCheckpoint) for layer in model.model.layers]
    assert wrapped == [True, True, True, False]
    # tigon's MLP still sees non-reentrant checkpointing through the wrapper's keywords.
    assert model.model.layers[0].mlp._gradient_checkpointing_func.keywords["use_reentrant"] is False
    set_checkpointing(model, 1)
    assert not any(isinstance(layer._gradient_checkpointing_func, OffloadedCheckpoint) for layer in model.model.layers)


def test_each_recomputed_layer_input_goes_to_host_once_and_comes_back_once(monkeypatch):
    model = tiny_model("llama", num_hidden_layers=N_LAYERS).train()
    set_checkpointing(model, 1, offload=True)
    offloader = model._tigon_offloader
    moved = {"out": 0, "back": 0}
    offload, fetch = offloader._offload, offloader._fetch

    def counting_offload(tensor):
        moved["out"] += 1
        return offload(tensor)

    def counting_fetch(saved):
        moved["back"] += 1
        return fetch(saved)

    monkeypatch.setattr(offloader, "_offload", counting_offload)
    monkeypatch.setattr(offloader, "_fetch", counting_fetch)
    input_ids, labels = tiny_batch()
    model(input_ids=input_ids, labels=labels).loss.backward()
    assert moved == {"out": N_LAYERS - 1, "back": N_LAYERS - 1}
    hidden = model.config.hidden_size * input_ids.numel() * 4
    assert offload_host_bytes(model) == (N_LAYERS - 1) * hidden


@pytest.mark.parametrize("offload", [False, True])
def test_the_device_inputs_are_freed_once_offloaded(offload):
    model = apply_tigon(tiny_model("llama", num_hidden_layers=N_LAYERS).train())
    set_checkpointing(model, 1, offload=offload)
    inputs = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    loss = model(input_ids=tiny_batch()[0], labels=tiny_batch()[1]).loss
    gc.collect()
    alive = [ref() is not None for ref in inputs]
    # The last layer keeps its activations (its input among them); the recomputed ones keep only
    # their input, on the device unless offloaded.
    assert alive == [not offload] * (N_LAYERS - 1) + [True]
    loss.backward()


def test_host_buffers_are_reused_across_steps_and_released_for_longer_sequences():
    model = tiny_model("llama", num_hidden_layers=N_LAYERS).train()
    set_checkpointing(model, 0, offload=True)
    input_ids, labels = tiny_batch()
    row_bytes = model.config.hidden_size * 4
    for _ in range(2):
        loss_and_grads(model, input_ids, labels)
        gc.collect()
        assert offload_host_bytes(model) == N_LAYERS * input_ids.numel() * row_bytes
    longer = torch.cat((input_ids, input_ids), dim=1)
    loss_and_grads(model, longer, torch.cat((labels, labels), dim=1))
    assert offload_host_bytes(model) == N_LAYERS * longer.numel() * row_bytes
    loss_and_grads(model, input_ids, labels)  # shorter again: the longer buffers serve
    assert offload_host_bytes(model) == N_LAYERS * longer.numel() * row_bytes


def test_a_graph_freed_without_backward_gives_its_buffers_back():
    model = tiny_model("llama", num_hidden_layers=N_LAYERS).train()
    set_checkpointing(model, 0, offload=True)
    input_ids, labels = tiny_batch()
    for _ in range(3):
        loss = model(input_ids=input_ids, labels=labels).loss
        del loss
        gc.collect()
    assert offload_host_bytes(model) == N_LAYERS * input_ids.numel() * model.config.hidden_size * 4
    assert all(ref() is None for ref in model._tigon_offloader._waiting)


def test_set_checkpointing_refuses_a_non_boolean_offload():
    model = tiny_model("llama", num_hidden_layers=N_LAYERS)
    with pytest.raises(TypeError, match="offload must be True or False, got 'auto'"):
        set_checkpointing(model, 0, offload="auto")


@pytest.mark.skipif(not ON_GPU, reason="pinned buffers and the side stream")
def test_on_gpu_the_inputs_leave_the_device_and_the_buffers_are_pinned():
    """Bitwise on the GPU needs a deterministic step: eager attention (SDPA's flash backward adds
    into dq with atomics) and PyTorch's deterministic embedding backward.

    What offload saves is measured between forward and backward, where every recomputed layer's
    input waits: the step's peak comes later, in the first layer's backward, where no input waits
    any more and the parameter gradients (which grow as backward goes down the layers) dominate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=4096, attn_implementation="eager")
    torch.manual_seed(0)
    model = apply_tigon(LlamaForCausalLM(config).cuda().to(torch.bfloat16).train())
    tokens = torch.randint(0, config.vocab_size, (1, 4096), device="cuda")
    held, grads = {}, {}
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for offload in (False, True, True):
            set_checkpointing(model, 0, offload=offload)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            loss = model(input_ids=tokens, labels=tokens).loss
            held[offload] = torch.cuda.memory_allocated() - base
            loss.backward()
            step = {name: p.grad.clone() for name, p in model.named_parameters()}
            for name, grad in grads.get(offload, {}).items():
                assert torch.equal(step[name], grad), f"offload {offload}, second step: {name}"
            grads.setdefault(offload, step)
            model.zero_grad(set_to_none=True)
    finally:
        torch.use_deterministic_algorithms(False)
    for name, grad in grads[False].items():
        assert torch.equal(grads[True][name], grad), name
    layer_input = tokens.numel() * config.hidden_size * 2
    # None of the six layer inputs waits on the device for backward (a freed tensor whose copy to the
    # host is still running no longer counts as allocated).
    assert held[False] - held[True] >= 5.5 * layer_input, (held, layer_input)
    assert model._tigon_offloader._free[0].is_pinned()


def test_offloader_keeps_tensors_it_was_not_asked_to_move():
    offloader = ActivationOffloader()
    x = torch.randn(3, 5, requires_grad=True)
    other = torch.randn(3, 5, requires_grad=True)
    with offloader.saving(x):
        y = (x * other).sum()
    assert len(offloader._waiting) == 1  # x; other stays
    y.backward()
    assert torch.equal(x.grad, other) and torch.equal(other.grad, x)


def test_a_host_without_the_memory_is_refused_with_what_the_step_needs(monkeypatch):
    from tigon.transformers import offload

    model = tiny_model("llama", num_hidden_layers=N_LAYERS).train()
    set_checkpointing(model, 0, offload=True)
    input_ids, labels = tiny_batch()
    layer_input = input_ids.numel() * model.config.hidden_size * 4
    # Room for two layers' inputs above the 5% reserve of a 100 MiB host; pinned buffers use it up.
    available = 5 * 2**20 + 2 * layer_input + 1
    monkeypatch.setattr(offload, "host_memory", lambda: (available - offload_host_bytes(model), 100 * 2**20))
    with pytest.raises(offload.HostMemoryError, match=r"[\d.]+ GiB of host memory are in use for this step and "
                       r"another [\d.]+ GiB are needed, but the host has [\d.]+ GiB available of 0\.1 GiB"):
        model(input_ids=input_ids, labels=labels)
    assert offload_host_bytes(model) == 2 * layer_input
