"""A tiny Llama checkpoint on disk, as the frameworks' trainers load one: random weights and a
word-level tokenizer, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    """2 layers of width 64, 4 heads over 2 KV heads; token ids 1, 2, 3 are bos, eos and pad."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )


def save_tiny_llama(directory: Path, words: list[str], *, prefix_bos: bool) -> None:
    """The tiny Llama (seed 0) and a whitespace word-level tokenizer over :data:`SPECIAL_TOKENS`
    and ``words``, which puts ``<s>`` before each text when ``prefix_bos``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if prefix_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(directory)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(len(vocab))).save_pretrained(directory)
