"""tigon bench e2e --model qwen3_moe: tiny Qwen3-MoE models built as each setup builds them (the
experts' implementation, Liger's experts class), and Hugging Face's and tigon's training step
giving the same loss and gradients; the options the MoE model refuses."""

import math

import pytest
import torch

from tigon.bench import main
from tigon.bench.e2e import build_model, experts_in
from utils import DEVICE, ON_GPU, pick, relative_error

# Qwen3-MoE's layer at toy width: 8 experts of 32 with 2 per token, 4 heads of 16.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
DTYPE = pick(torch.float32, torch.bfloat16)


def _train_step(model):
    """The loss of one forward + backward on 16 seeded tokens, and the first layer's experts gradient."""
    tokens = torch.randint(0, TINY["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.item(), model.model.layers[0].mlp.experts.gate_up_proj.grad


def test_hf_and_tigon_train_the_same_model(hugging_face_modules_restored):
    hf = build_model("hf", 1, DEVICE, model="qwen3_moe", dtype=DTYPE, **TINY)
    assert experts_in(hf) == "Qwen3MoeExperts (grouped_mm)"
    hf_loss, hf_grad = _train_step(hf)
    patched = build_model("tigon", 1, DEVICE, model="qwen3_moe", dtype=DTYPE, **TINY)
    assert experts_in(patched).endswith("(tigon)"), experts_in(patched)
    loss, grad = _train_step(patched)
    assert math.isclose(loss, hf_loss, rel_tol=pick(1e-5, 1e-2)), (loss, hf_loss)
    assert relative_error(grad, hf_grad) < pick(1e-5, 2e-2)


def test_liger_runs_its_fused_experts(hugging_face_modules_restored):
    pytest.importorskip("liger_kernel")
    model = build_model("liger", 1, DEVICE, model="qwen3_moe", dtype=DTYPE, **TINY)
    assert experts_in(model) == "LigerExperts"
    # Liger's experts class, put in place of transformers', is initialised by the model as its own.
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
    if ON_GPU:  # Liger's norm kernels do not run in Triton's CPU interpreter
        assert math.isfinite(_train_step(model)[0])


def test_moe_model_refuses_qlora():
    with pytest.raises(SystemExit):
        main(["e2e", "--model", "qwen3_moe", "--qlora"])


def test_router_aux_loss_needs_experts():
    with pytest.raises(SystemExit):
        main(["e2e", "--router-aux-loss"])


@pytest.mark.skipif(ON_GPU, reason="without a GPU, the end-to-end benchmark refuses by name")
@pytest.mark.parametrize("option", ["--router-aux-loss", "--lora"])
def test_moe_options_parse_then_need_a_gpu(option, capsys):
    assert main(["e2e", "--model", "qwen3_moe", option]) == 1
    assert "tigon bench e2e trains on a GPU" in capsys.readouterr().out
