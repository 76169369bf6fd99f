"""Train a Llama with the Hugging Face Trainer, its layers and loss replaced by tigon's kernels.

One line does it: ``apply_tigon_to_llama()`` before the model is built. The model here is tiny and
built from a config, and the data is synthetic (each sequence counts upwards from a random start,
so the loss falls quickly), so the script runs anywhere: on CPU through Triton's interpreter in a
minute or two, on a GPU in seconds. For a real checkpoint, load it with
``AutoTigonForCausalLM.from_pretrained(path_or_id)`` instead.

    python examples/train_hf_trainer.py                        # tiny, CPU or GPU
    python examples/train_hf_trainer.py --hidden-size 1024 --layers 8 --seq-len 1024 --steps 200
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from tigon.transformers import apply_tigon_to_llama


class CountingDataset(torch.utils.data.Dataset):
    """Sequences ``s, s+1, s+2, ...`` (mod the vocabulary) from a random start ``s``."""

    def __init__(self, n_sequences: int, seq_len: int, vocab_size: int, seed: int = 0):
        starts = torch.randint(0, vocab_size, (n_sequences, 1), generator=torch.Generator().manual_seed(seed))
        self.input_ids = (starts + torch.arange(seq_len)) % vocab_size

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, index):
        # The model shifts the labels itself: position t is trained to predict token t + 1.
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output-dir", default=None, help="checkpoints and logs (default: a temporary folder)")
    args = parser.parse_args()

    # Before the model is built: its RMSNorm, SwiGLU MLP, RoPE and loss come from tigon, and the
    # loss is computed from the hidden states without ever materialising the logits.
    apply_tigon_to_llama()

    config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden_size // 64) * 2,
        num_key_value_heads=max(1, args.hidden_size // 64), max_position_embeddings=args.seq_len,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    n_parameters = sum(p.numel() for p in model.parameters())
    print(f"{n_parameters / 1e6:.2f}M parameters; norm layer: {type(model.model.norm).__name__}")

    on_gpu = torch.cuda.is_available()
    n_sequences = args.steps * args.batch_size * args.grad_accum
    with tempfile.TemporaryDirectory() as scratch:
        training_args = TrainingArguments(
            output_dir=args.output_dir or scratch,
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
            dataloader_num_workers=0,
            report_to=[],
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=CountingDataset(n_sequences, args.seq_len, args.vocab_size),
            eval_dataset=CountingDataset(4 * args.batch_size, args.seq_len, args.vocab_size, seed=1),
        )
        trainer.train()
        # Evaluation runs the model in eval mode: the original forward, logits and all.
        print(trainer.evaluate())


if __name__ == "__main__":
    main()
