"""Fine-tune a Llama with TRL's SFTTrainer, its layers and its loss computed by tigon's kernels.

The recipe: ``apply_tigon(model)`` (tigon's RMSNorm, SwiGLU MLP and RoPE), then ``patch_trl()``,
then build and run ``SFTTrainer`` as usual. SFTTrainer computes its loss, entropy and token
accuracy from per-token log-probs that TRL's fused LM head computes from the decoder's hidden
states and ``lm_head``'s weight, without building the logits; after ``patch_trl()`` that head is
tigon's ``fused_linear_logprobs``. The model is tiny and built from a config, the text is the
corpus that ships with tigon (one paragraph per example, packed into sequences), and the tokenizer
is a byte-level BPE learned from that corpus in memory, so nothing is downloaded: on CPU through
Triton's interpreter it runs in a minute or two, on a GPU in seconds. For a real checkpoint, load
it with ``AutoTigonForCausalLM.from_pretrained(path_or_id)`` (in place of ``apply_tigon``) and its
tokenizer with ``AutoTokenizer``.

    python examples/train_sft_trl.py                           # tiny, CPU or GPU
    python examples/train_sft_trl.py --no-tigon                # the same run, plain TRL and Hugging Face
    python examples/train_sft_trl.py --hidden-size 1024 --layers 8 --seq-len 1024 --steps 200
"""

from __future__ import annotations

import argparse
import tempfile
from importlib import resources

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, set_seed
from trl import SFTConfig, SFTTrainer

from tigon.transformers import apply_tigon
from tigon.trl import patch_trl


def corpus_paragraphs() -> list[str]:
    text = resources.files("tigon").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [paragraph.strip() for paragraph in text.split("\n\n") if paragraph.strip()]


def byte_level_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE learned from ``texts``: the 256 bytes, ``<pad>`` and ``<eos>``, and merges
    up to ``vocab_size`` tokens (fewer if the texts run out of pairs to merge)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bpe_trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, bpe_trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512, help="the tokenizer's, at most")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-tigon", action="store_true", help="leave the model as Hugging Face wrote it")
    parser.add_argument("--output-dir", default=None, help="checkpoints and logs (default: a temporary folder)")
    args = parser.parse_args()

    paragraphs = corpus_paragraphs()
    tokenizer = byte_level_tokenizer(paragraphs, args.vocab_size)
    # The last two paragraphs are held out for evaluation.
    train_dataset = Dataset.from_dict({"text": paragraphs[:-2]})
    eval_dataset = Dataset.from_dict({"text": paragraphs[-2:]})

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden_size // 64) * 2,
        num_key_value_heads=max(1, args.hidden_size // 64), max_position_embeddings=args.seq_len,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
    )
    # The same weights with and without --no-tigon.
    set_seed(args.seed)
    model = LlamaForCausalLM(config)
    if not args.no_tigon:
        apply_tigon(model)  # RMSNorm, SwiGLU MLP and RoPE
        patch_trl()  # the LM head of every TRL trainer built from now on
    n_parameters = sum(p.numel() for p in model.parameters())
    print(f"{n_parameters / 1e6:.2f}M parameters, a vocabulary of {len(tokenizer)}; "
          f"norm layer: {type(model.model.norm).__name__}")

    on_gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as scratch:
        sft_config = SFTConfig(
            output_dir=args.output_dir or scratch,
            dataset_text_field="text",
            max_length=args.seq_len,
            # Paragraphs are packed into sequences of max_length tokens (those longer are split), and each
            # batch is flattened into one row: position_ids restart at every paragraph, and attention stays
            # within it.
            packing=True,
            packing_strategy="bfd_split",
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.steps // 10),
            logging_steps=max(1, args.steps // 10),
            eval_strategy="no",
            save_strategy="no",
            bf16=on_gpu and torch.cuda.is_bf16_supported(),
            use_cpu=not on_gpu,
            seed=args.seed,
            dataloader_num_workers=0,
            report_to=[],
        )
        trainer = SFTTrainer(
            model=model,
            args=sft_config,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
        )
        train_output = trainer.train()
        eval_metrics = trainer.evaluate()
    first_loss = trainer.state.log_history[0]["loss"]
    print(f"first logged loss {first_loss:.6f}, train loss {train_output.training_loss:.6f}, "
          f"eval loss {eval_metrics['eval_loss']:.6f}")


if __name__ == "__main__":
    main()
