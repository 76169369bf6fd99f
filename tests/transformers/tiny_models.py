"""Tiny models of every supported family, fixed data, and a short AdamW run that records what the
tests compare: per-step losses, every parameter's gradient at each step, and eval logits."""

from __future__ import annotations

import dataclasses

import torch
import transformers

from utils import DEVICE, pick

# On the GPU, larger: a real vocabulary (the loss runs over several chunks) and longer sequences.
VOCAB = pick(cpu=160, gpu=32000)
BATCH, SEQ = pick(cpu=(2, 16), gpu=(4, 512))
STEPS = 3
# Adam's first update moves every weight by about ±lr: 1e-3 is a large but realistic step for
# these widths (1e-2 would move the GPU model's weights by half their initial scale at once).
LR = 1e-3

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=pick(cpu=32, gpu=1024), intermediate_size=pick(cpu=64, gpu=2816),
    num_hidden_layers=2, num_attention_heads=pick(cpu=4, gpu=8), num_key_value_heads=pick(cpu=2, gpu=4),
    max_position_embeddings=pick(cpu=256, gpu=1024),
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
_HEAD_DIM = _COMMON["hidden_size"] // _COMMON["num_attention_heads"]
# output_router_logits puts the router's load-balancing loss into the training loss.
_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
# A small softcap, so that the tiny model's logits are really capped.
_GEMMA2 = dict(head_dim=_HEAD_DIM, final_logit_softcapping=0.5, sliding_window=8)

# model_type -> (config class, causal LM class, options beyond _COMMON)
TINY = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(num_local_experts=4, **_MOE)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=_HEAD_DIM)),
    # Layer 0 dense (its MLP is patched), layer 1 sparse (its experts are not).
    "qwen3_moe": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
        dict(head_dim=_HEAD_DIM, num_experts=4, moe_intermediate_size=32, mlp_only_layers=[0], **_MOE),
    ),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(head_dim=_HEAD_DIM)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, _GEMMA2),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, _GEMMA2),
    # Partial rotary: only half of each head's features rotate.
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(partial_rotary_factor=0.5)),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, dict(logits_scaling=4.0)),
}


def tiny_config(model_type: str, **options):
    config_class, _, family_options = TINY[model_type]
    return config_class(**{**_COMMON, **family_options, **options})


def tiny_model(model_type: str, seed: int = 0, **options):
    """A freshly initialised fp32 model; the same ``seed`` gives the same weights, patched or not
    (tigon's layers keep Hugging Face's initialisation)."""
    _, model_class, _ = TINY[model_type]
    torch.manual_seed(seed)
    return model_class(tiny_config(model_type, **options)).to(DEVICE)


def tiny_batch(seed: int = 0):
    """``(input_ids, labels)`` of ``[BATCH, SEQ]``; some labels are -100 (prompt and padding)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100
    labels[1, -3:] = -100
    return input_ids.to(DEVICE), labels.to(DEVICE)


def loss_and_grads(model, input_ids, labels):
    """One forward and backward: the loss and each parameter's gradient (those that got one), by name;
    the gradients are then cleared."""
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@dataclasses.dataclass
class Run:
    """What a run records: before each step, the weights and the loss and gradients they give;
    after the last, the weights and their eval logits."""

    weights: list[dict[str, torch.Tensor]]
    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor]]
    eval_logits: torch.Tensor


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _load_weights(model, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])


def _text_batch():
    input_ids, labels = tiny_batch()
    return dict(input_ids=input_ids, labels=labels)


def _loss_and_grads(model, batch):
    model.train()
    output = model(**batch)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), grads


def _eval_logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**{name: value for name, value in batch.items() if name != "labels"}).logits


def train(model, batch=None) -> Run:
    """``STEPS`` AdamW steps on one fixed batch (model inputs with ``labels``; by default
    :func:`tiny_batch`'s), then an eval forward on it."""
    batch = batch or _text_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    run = Run([], [], [], None)
    for _ in range(STEPS):
        run.weights.append(_weights(model))
        loss, grads = _loss_and_grads(model, batch)
        run.losses.append(loss)
        run.grads.append(grads)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    run.weights.append(_weights(model))
    run.eval_logits = _eval_logits(model, batch)
    return run


def replay(model, reference: Run, batch=None) -> Run:
    """``model`` given ``reference``'s weights before each of its steps (cast to ``model``'s
    dtype): each step's loss and gradients; then, given its final weights, the eval logits. Both
    models are then compared on the same weights at every step, free of how far two independently
    trained runs drift apart."""
    batch = batch or _text_batch()
    run = Run(reference.weights, [], [], None)
    for weights in reference.weights[:-1]:
        _load_weights(model, weights)
        loss, grads = _loss_and_grads(model, batch)
        run.losses.append(loss)
        run.grads.append(grads)
        model.zero_grad(set_to_none=True)
    _load_weights(model, reference.weights[-1])
    run.eval_logits = _eval_logits(model, batch)
    return run
