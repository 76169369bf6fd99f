"""The sequence-tiled MLP (tigon.transformers.layers.set_mlp_tiling, apply_tigon(mlp_tile_tokens=...)).

A tiny Llama patched by tigon trains with its MLPs over tiles of a few tokens, alone, under
checkpointing with offloaded inputs, and under PEFT LoRA: its losses and gradients match the untiled
model's within fp32 rounding (the weight gradients are sums over tiles), and the tiles really are
what the MLP computes on. Bad values and models without a tileable MLP are refused, leaving the
model as it was.
"""

from __future__ import annotations

import pytest
import torch
from test_peft_lora import lora_model, step
from tiny_models import loss_and_grads, tiny_batch, tiny_model
from utils import assert_ill_conditioned, relative_error

from tigon.ops import gated as gated_ops
from tigon.testing import TOLERANCE
from tigon.transformers import apply_tigon, set_checkpointing, set_mlp_tiling, unapply_tigon
from tigon.transformers.layers import TigonGatedMLP

TILE = 7  # tokens per tile: tiny_batch's rows split into several tiles, the last one short


def _assert_matches(result, truth, what):
    (loss, grads), (truth_loss, truth_grads) = result, truth
    assert relative_error(loss, truth_loss) < TOLERANCE[torch.float32], what
    assert grads.keys() == truth_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, truth_grads[name]) < TOLERANCE[torch.float32], f"{what}: {name}"


@pytest.mark.parametrize("plan", ["no checkpointing", "checkpointed", "offloaded"])
def test_tiled_model_matches_the_untiled_one(plan, monkeypatch):
    model = apply_tigon(tiny_model("llama", num_hidden_layers=3).train())
    if plan != "no checkpointing":
        set_checkpointing(model, 1, offload=plan == "offloaded")
    batch = tiny_batch()
    truth = loss_and_grads(model, *batch)
    set_mlp_tiling(model, TILE)
    rows = []
    forward = gated_ops.gated_fwd
    monkeypatch.setattr(gated_ops, "gated_fwd", lambda gate, *args: rows.append(gate.shape[0]) or forward(gate, *args))
    _assert_matches(loss_and_grads(model, *batch), truth, plan)
    assert rows and max(rows) == TILE


def test_tiled_lora_matches_peft():
    """Under PEFT's LoRA, as tests/transformers/test_peft_lora.py: the loss and each adapter's
    gradient within 1e-5 of PEFT's fp32 ones, or as close to fp64 as those are (within 4x) where
    PEFT's fp32 gradient is ill-conditioned."""
    batch = dict(zip(("input_ids", "labels"), tiny_batch()))
    peft_loss, peft_grads, _ = step(lora_model("peft"), batch, seed=0)
    _, exact_grads, _ = step(lora_model("peft", dtype=torch.float64), batch, seed=0)
    model = lora_model("peft_then_patch")
    set_mlp_tiling(model, TILE)
    loss, grads, functions = step(model, batch, seed=0)
    assert "GatedMLPFunctionBackward" in functions
    assert abs(loss - peft_loss) <= 1e-5 * abs(peft_loss)
    assert grads.keys() == peft_grads.keys()
    for name, grad in grads.items():
        if relative_error(grad, peft_grads[name]) > 1e-5:
            assert_ill_conditioned(f"grad of {name}", grad, peft_grads[name], exact_grads[name])


def test_apply_tigon_sets_the_tile_and_unapply_removes_it():
    model = apply_tigon(tiny_model("llama", num_hidden_layers=2), mlp_tile_tokens="auto")
    assert [layer.mlp.tile_tokens for layer in model.model.layers] == ["auto", "auto"]
    unapply_tigon(model)
    assert not any(isinstance(layer.mlp, TigonGatedMLP) or "tile_tokens" in vars(layer.mlp) for layer in model.model.layers)


def test_auto_tiles_keep_one_intermediate_within_256_mib():
    assert gated_ops.auto_tile_rows(14336, 2) == 9216  # Llama-3-8B in bf16: [9216, 14336] is 252 MiB
    assert gated_ops.auto_tile_rows(8192, 2) == 16384  # Llama-3.2-1B: exactly 256 MiB
    assert gated_ops.auto_tile_rows(10**6, 4) == 1024  # never thinner than 1024 tokens


@pytest.mark.parametrize("tile_tokens", [0, 2.5, True, "whole"])
def test_bad_tile_is_refused_before_patching(tile_tokens):
    model = tiny_model("llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match=rf"mlp_tile_tokens must be a positive int, 'auto' or None, got {tile_tokens!r}"):
        apply_tigon(model, mlp_tile_tokens=tile_tokens)
    assert not isinstance(model.model.layers[0].mlp, TigonGatedMLP)


def test_a_model_without_tileable_mlps_is_refused_and_left_unpatched():
    model = tiny_model("llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MLP that tigon tiles"):
        apply_tigon(model, swiglu=False, mlp_tile_tokens=64)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
