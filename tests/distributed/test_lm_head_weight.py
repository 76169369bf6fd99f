"""The fused loss uses lm_head's weight during lm_head's call, where a sharding engine presents it
whole, in one process: an engine stand-in swaps the whole weight in with a pre-hook ahead of
tigon's (as FSDP2 does) and swaps an empty one back after the forward (as FSDP2 does for a unit
resharded after its forward, and ZeRO-3 for every module)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tigon.transformers import apply_tigon
from utils import DEVICE, relative_error


def tiny_llama():
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(DEVICE).train()


def loss_and_head_grad(model, head_weight, input_ids):
    output = model(input_ids=input_ids, labels=input_ids)
    output.loss.backward()
    return output, head_weight.grad


def test_loss_uses_the_weight_the_engine_presents_inside_lm_head():
    input_ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    plain = tiny_llama()
    truth, truth_grad = loss_and_head_grad(plain, plain.lm_head.weight, input_ids)

    # Only the loss path: the layers' patches would change Hugging Face's modules for later tests.
    model = apply_tigon(tiny_llama(), rope=False, rms_norm=False, swiglu=False)
    head = model.lm_head
    whole, empty = head.weight, torch.nn.Parameter(torch.empty(0, device=DEVICE))

    def unshard(module, args):
        module.weight = whole

    def reshard(module, args, output):
        module.weight = empty

    head.register_forward_pre_hook(unshard, prepend=True)
    head.register_forward_hook(reshard)
    reshard(head, None, None)

    output, grad = loss_and_head_grad(model, whole, input_ids)
    assert output.logits is None
    assert head.weight is empty, "the stand-in engine did not run"
    assert relative_error(output.loss, truth.loss) <= 1e-5
    assert relative_error(grad, truth_grad) <= 1e-5
