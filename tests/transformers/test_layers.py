"""The layers tigon puts into Hugging Face models that the family tests do not single out: the
SDPA attention run by chunks of the batch."""

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tigon.transformers import layers
from utils import DEVICE, relative_error

BATCH, Q_HEADS, KV_HEADS, SEQ, HEAD_DIM = 5, 4, 2, 12, 8
# What Hugging Face's sdpa function reads from the attention module.
ATTENTION = types.SimpleNamespace(num_key_value_groups=Q_HEADS // KV_HEADS, is_causal=True)


def attention_inputs(mask: str):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=generator).to(DEVICE).requires_grad_()
        for heads in (Q_HEADS, KV_HEADS, KV_HEADS)
    )
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if mask == "none":
        return q, k, v, None
    if mask == "shared":
        return q, k, v, causal[None, None].to(DEVICE)
    # Left padding: sequence b starts after b padded positions.
    padded = torch.arange(SEQ)[None, :] >= torch.arange(BATCH)[:, None]
    return q, k, v, (causal & padded[:, None, :])[:, None].to(DEVICE)


def counting_sdpa(monkeypatch) -> list:
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        calls.append(query.shape[0])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("mask", ["none", "shared", "per_sequence"])
def test_sdpa_by_chunks_matches_one_call(monkeypatch, mask):
    monkeypatch.setattr(layers, "ATTENTION_CHUNK_TOKENS", 2 * SEQ + 1)  # two sequences per chunk
    q, k, v, attention_mask = attention_inputs(mask)
    grad_out = torch.randn(BATCH, SEQ, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    expected = sdpa_attention_forward(ATTENTION, q, k, v, attention_mask)[0]
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    calls = counting_sdpa(monkeypatch)
    out, weights = layers.sdpa_attention_by_chunks(ATTENTION, q, k, v, attention_mask)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    assert calls == [2, 2, 1]
    assert weights is None and out.shape == expected.shape and out.is_contiguous()
    # Each sequence's attention is the same computation in either call.
    assert relative_error(out, expected) <= 1e-6
    for name, grad, expected_grad in zip("qkv", grads, expected_grads):
        assert relative_error(grad, expected_grad) <= 1e-6, f"d{name}"


def test_sdpa_without_gradients_is_one_call(monkeypatch):
    monkeypatch.setattr(layers, "ATTENTION_CHUNK_TOKENS", SEQ)
    q, k, v, attention_mask = attention_inputs("none")
    calls = counting_sdpa(monkeypatch)
    with torch.no_grad():
        layers.sdpa_attention_by_chunks(ATTENTION, q, k, v, attention_mask)
    layers.sdpa_attention_by_chunks(ATTENTION, q.detach(), k.detach(), v.detach(), attention_mask)
    assert calls == [BATCH, BATCH]


def test_sdpa_with_a_large_chunk_is_one_call(monkeypatch):
    monkeypatch.setattr(layers, "ATTENTION_CHUNK_TOKENS", BATCH * SEQ)
    calls = counting_sdpa(monkeypatch)
    layers.sdpa_attention_by_chunks(ATTENTION, *attention_inputs("none"))
    assert calls == [BATCH]


def test_other_attention_implementations_are_hugging_faces():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert layers.ATTENTION_FUNCTIONS["sdpa"] is layers.sdpa_attention_by_chunks
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    others = [key for key in ALL_ATTENTION_FUNCTIONS.valid_keys() if key != "sdpa"]
    assert others and all(layers.ATTENTION_FUNCTIONS[key] is ALL_ATTENTION_FUNCTIONS[key] for key in others)
