"""Train a tigon-patched Llama with PyTorch Lightning: tigon applied in ``configure_model``.

``configure_model`` is Lightning's hook for building the model under the strategy: it runs once
the processes exist, before the model is wrapped (DDP, FSDP) or sharded, which is where
``apply_tigon(model)`` belongs. The patched model is then trained as any other: here with
gradient checkpointing, AdamW and gradient clipping, on a tiny Llama built from a config and on
synthetic data (sequences count upwards from a random start after a prompt of -100 labels), so
the script runs anywhere.

Strategies (``--strategy``):

- ``auto``: Lightning's choice, one device by default;
- ``ddp``: ``DDPStrategy``, gloo on CPU and NCCL on GPUs;
- ``fsdp``: ``FSDPStrategy`` (PyTorch's FSDP1, each decoder layer a unit); Lightning accepts it
  on GPUs only;
- ``fsdp2``: ``ModelParallelStrategy``, whose ``configure_model`` shards the model itself with
  FSDP2's ``fully_shard`` (each decoder layer, then the root); on CPU as on GPUs.

For several processes to give the one-process losses, each token weighs the same wherever it
lands: the tokens that count (labels other than -100) are summed over every process and passed
to the model as ``num_items_in_batch``, and the loss is multiplied by the number of processes
before backward, because the strategies average the gradients over processes where the loss wants
their sum. ``--batch-size`` is the whole step's, split over the processes.

    python examples/train_lightning.py                                # one process, CPU or GPU
    python examples/train_lightning.py --strategy ddp --devices 2     # Lightning starts the second process
    python examples/train_lightning.py --strategy fsdp2 --devices 2
    python examples/train_lightning.py --strategy fsdp --devices 2    # GPUs only
    python examples/train_lightning.py --hidden-size 1024 --layers 8 --seq-len 1024 --steps 200
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from tigon.transformers import apply_tigon

STRATEGIES = ("auto", "ddp", "fsdp", "fsdp2")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto")
    parser.add_argument("--devices", type=int, default=1, help="processes, one device each (CPU or GPU)")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"),
                        help="Lightning's precision (default: bf16-mixed on GPUs, 32-true on CPU)")
    parser.add_argument("--no-tigon", dest="tigon", action="store_false", help="plain Hugging Face, for comparison")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step, over every process")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--losses-out", type=Path,
                        help="rank 0 writes the per-step losses and gradient norms here (JSON)")
    args = parser.parse_args(argv)
    if args.batch_size % args.devices:
        parser.error(f"--batch-size {args.batch_size} must split evenly over --devices {args.devices}")
    if args.precision is None:
        args.precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    return args


class CountingSequences(torch.utils.data.Dataset):
    """``(input_ids, labels)``, each ``[seq_len]``: tokens count upwards (mod the vocabulary) from a
    random start; a prompt of random length carries no labels (-100), so processes hold different
    numbers of tokens that count."""

    def __init__(self, n_sequences: int, seq_len: int, vocab_size: int):
        self.n_sequences, self.seq_len, self.vocab_size = n_sequences, seq_len, vocab_size

    def __len__(self):
        return self.n_sequences

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        start = torch.randint(0, self.vocab_size, (1,), generator=generator)
        input_ids = (start + torch.arange(self.seq_len)) % self.vocab_size
        labels = input_ids.clone()
        labels[: torch.randint(0, self.seq_len // 2, (1,), generator=generator)] = -100
        return input_ids, labels


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM built, patched (and, under ``fsdp2``, sharded) in ``configure_model``.

    Records every step's loss (averaged over the step's tokens on every process) and gradient norm
    (over the whole model, before clipping) in ``losses`` and ``grad_norms``, and in ``fused_loss``
    whether the last loss was tigon's fused linear cross entropy (no logits built).
    """

    def __init__(self, config: LlamaConfig, data: CountingSequences, *, tigon: bool, batch_size: int, lr: float,
                 max_grad_norm: float):
        super().__init__()
        self.config, self.data, self.tigon = config, data, tigon
        self.batch_size, self.lr, self.max_grad_norm = batch_size, lr, max_grad_norm
        self.model: LlamaForCausalLM | None = None
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.fused_loss = False

    def configure_model(self):
        if self.model is not None:  # Lightning calls the hook again for each stage (fit, validate, ...)
            return
        torch.manual_seed(0)  # the same weights in every process
        model = LlamaForCausalLM(self.config)
        if self.tigon:
            # Before any wrapping: RMSNorm, SwiGLU MLP, RoPE and the loss become tigon's, and in
            # training the loss is computed from the hidden states without building the logits.
            apply_tigon(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)  # the root: embeddings, final norm and lm_head
        self.model = model

    def training_step(self, batch, batch_index):
        input_ids, labels = batch
        strategy, world_size = self.trainer.strategy, self.trainer.world_size
        # Position t predicts token t + 1: the first label of each sequence predicts nothing.
        num_items = strategy.reduce((labels[:, 1:] != -100).sum(), reduce_op="sum")
        output = self.model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items)
        self.losses.append(strategy.reduce(output.loss.detach().float(), reduce_op="sum").item())
        self.fused_loss = output.logits is None
        return output.loss * world_size

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Clip to ``max_grad_norm`` the norm over every shard: FSDP1's own ``clip_grad_norm_``
        under ``fsdp`` (its gradients are flat shards), PyTorch's elsewhere (under ``fsdp2`` the
        gradients are DTensors, whose norm is the whole model's)."""
        if isinstance(self.trainer.strategy, FSDPStrategy):
            norm = self.trainer.strategy.model.clip_grad_norm_(self.max_grad_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), self.max_grad_norm)
        self.grad_norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        """Each process's share of the shuffled sequences: the sampler's permutation is the same on
        every process, and process r takes every world_size-th sequence of it from the r-th, so a
        step covers the same ``batch_size`` sequences whatever the number of processes. (Lightning's
        own sampler, ``use_distributed_sampler``, is off: with one process it would not shuffle.)"""
        world_size = self.trainer.world_size
        sampler = torch.utils.data.DistributedSampler(
            self.data, num_replicas=world_size, rank=self.global_rank, shuffle=True, seed=0
        )
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size // world_size, sampler=sampler)


def build_strategy(name: str, devices: int):
    if name == "fsdp":
        return FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return name


def main(argv=None) -> None:
    args = parse_args(argv)
    config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq_len, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    data = CountingSequences(args.steps * args.batch_size, args.seq_len, args.vocab_size)
    module = CausalLM(
        config, data, tigon=args.tigon, batch_size=args.batch_size, lr=args.lr, max_grad_norm=args.max_grad_norm
    )
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=args.devices,
        strategy=build_strategy(args.strategy, args.devices),
        precision=args.precision,
        max_steps=args.steps,
        gradient_clip_val=args.max_grad_norm,  # so that Lightning calls configure_gradient_clipping
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # CausalLM.train_dataloader shards the data itself
    )
    trainer.fit(module)
    if trainer.is_global_zero:
        print(f"norm layer: {type(module.model.model.norm).__name__}")
        for step, (loss, grad_norm) in enumerate(zip(module.losses, module.grad_norms)):
            print(f"step {step}: loss {loss:.6f}, gradient norm {grad_norm:.6f}")
        print("loss: " + ("tigon's fused linear cross entropy (no logits)" if module.fused_loss else "logits built"))
        if args.losses_out is not None:
            record = dict(
                strategy=args.strategy, world_size=trainer.world_size, precision=args.precision, tigon=args.tigon,
                norm_layer=type(module.model.model.norm).__name__, fused_loss=module.fused_loss,
                losses=module.losses, grad_norms=module.grad_norms,
            )
            args.losses_out.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
