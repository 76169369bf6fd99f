"""Train a tigon-patched Llama with tensor parallelism under torchrun (Hugging Face's own plan, or torch's with sequence-parallel norms), or a Qwen3-MoE with expert parallelism.

Two ways to shard the model over ``--tp`` processes, then ``apply_tigon(model)`` on the result:

- ``--plan auto``: ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``
  (``tp_plan="auto"`` where ``DistributedConfig`` takes no plan), transformers' DTensor plan: q, k, v,
  gate and up column-parallel (each rank holds some heads and some of the MLP's columns), o and
  down row-parallel, activations between layers replicated. tigon's RoPE then rotates the rank's
  heads, its SwiGLU the rank's columns, its RMSNorm the replicated activations.
- ``--plan sequence-parallel``: ``parallelize_module``, torchtitan's layout for a Hugging Face
  Llama (:func:`parallelize_sequence`): the same column and row split, and between them the
  residual stream sharded on the sequence, so each rank's norms see ``[B, T/tp, H]`` (a DTensor
  ``Shard(1)``, which tigon's RMSNorm computes locally and whose weight gradient DTensor sums).

The loss: both plans shard lm_head along the vocabulary, and tigon's fused loss computes on that
shard: each rank the logits of its slice of the vocabulary, chunk by chunk, a few statistics per
token combined across ranks; no rank builds the whole logits or gathers the weight.

``--ep`` instead spreads a mixture-of-experts model's experts over all the processes:
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=WORLD_SIZE,
enable_expert_parallel=True), experts_implementation="tigon")`` (``"grouped_mm"``, transformers'
own, with ``--no-tigon``), then ``apply_tigon(model)`` for the norms, RoPE and the loss. Each rank
holds ``E/WORLD_SIZE`` experts and runs every token through them on tigon's kernel; transformers
sends the tokens and sums the ranks' outputs. Nothing else is sharded. transformers 5.17 builds one
mesh for either parallelism, so ``--ep`` takes neither ``--tp`` nor ``--plan``.

Tensor-parallel ranks see the same batch: the data here is synthetic and identical everywhere.
The model is a tiny random Llama (a tiny random Qwen3-MoE with ``--ep``) by default (each rank
saves the same seed-0 weights to its own temporary directory and loads them as a checkpoint), or
``--model`` (a directory or Hub id).

    torchrun --nproc-per-node 2 examples/train_tp.py --tp 2                      # tp_plan="auto"
    torchrun --nproc-per-node 4 examples/train_tp.py --tp 4 --plan sequence-parallel
    torchrun --nproc-per-node 2 examples/train_tp.py --tp 2 --no-tigon           # plain, to compare
    torchrun --nproc-per-node 2 examples/train_tp.py --ep                        # expert parallel

NCCL on GPUs, gloo on CPU (where tigon's kernels run through Triton's interpreter: slow, but the
same numbers).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedConfig, Qwen3MoeConfig
from transformers.distributed import DistributedConfig

from tigon.transformers import apply_tigon

PLANS = ("auto", "sequence-parallel")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, choices=(2, 4), help="tensor-parallel size (= processes; default 2)")
    parser.add_argument("--plan", choices=PLANS, help="the tensor-parallel plan (default auto)")
    parser.add_argument("--ep", action="store_true",
                        help="expert parallel over every process, in place of tensor parallelism")
    parser.add_argument("--model", help="a checkpoint directory or Hub id (default: a tiny random Llama, "
                                        "or Qwen3-MoE with --ep)")
    parser.add_argument("--no-tigon", dest="tigon", action="store_false", help="plain Hugging Face, for comparison")
    parser.add_argument("--seq-len", type=int, default=32, help="a multiple of --tp for sequence parallelism")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    if args.ep and (args.tp is not None or args.plan is not None):
        parser.error(
            "--ep spreads the experts over every process on transformers' one device mesh, which 5.17 gives to "
            "either expert or tensor parallelism: drop --tp and --plan, or --ep"
        )
    if not args.ep:
        args.tp, args.plan = args.tp or 2, args.plan or "auto"
    return args


def init_distributed(tp: int) -> torch.device:
    """This rank's device; the process group (unless one is already there) is NCCL on GPUs, gloo
    on CPU, of ``tp`` processes."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size != tp:
        raise SystemExit(f"--tp {tp} needs {tp} processes (torchrun --nproc-per-node {tp}), got {world_size}")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def close_distributed() -> None:
    """Destroy the process group once nothing holds it: a DTensor's device mesh keeps the group
    alive past ``destroy_process_group``, and a gloo group first freed while Python shuts down
    aborts the process ("terminate called without an active exception"), at random. So the
    models, optimizers and DTensors must be dropped before this call, which collects them (they
    sit in reference cycles) and waits for every rank."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def tiny_llama_config(vocab_size: int = 128) -> LlamaConfig:
    """2 layers of width 64, 4 heads (and 4 KV heads: column-parallel q, k, v need heads divisible
    by the tensor-parallel size)."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def tiny_qwen3_moe_config(vocab_size: int = 128) -> Qwen3MoeConfig:
    """2 layers of width 64, every MLP sparse: 8 experts (so 2, 4 or 8 ranks hold some each) of
    width 64, top-2."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def save_tiny(directory: str, config: PreTrainedConfig) -> str:
    """A causal LM of ``config`` with seed-0 weights, saved to ``directory`` (the same weights from
    every rank; before the process group exists, or only rank 0 writes)."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def save_tiny_llama(directory: str) -> str:
    return save_tiny(directory, tiny_llama_config())


def parallelize_sequence(model, mesh: DeviceMesh):
    """Shard a Hugging Face Llama-shaped model (``model.layers[i].self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``)
    torchtitan's way: column-parallel q, k, v, gate and up, row-parallel o and down whose outputs
    are reduce-scattered over the sequence, and the norms sequence-parallel in between (their input
    ``[B, T/tp, H]``, their weight replicated); the embedding's output is sequence-sharded too, and
    lm_head column-parallel (vocabulary-sharded) over the gathered sequence.

    The decoder then sees a shard of the sequence, so the forward must be given the full
    ``position_ids``; attention builds no mask of its own (SDPA's causal mode, no padding mask).
    """
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            # Attention and the MLP mix positions and features: they take the whole sequence.
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    return model


def auto_plan(tp: int) -> dict:
    """``from_pretrained``'s arguments for transformers' own plan over ``tp`` ranks: a
    ``DistributedConfig`` where it takes the plan (transformers 5.17 deprecates ``tp_plan=``), else
    ``tp_plan="auto"``."""
    if "tp_plan" in {field.name for field in dataclasses.fields(DistributedConfig)}:
        return dict(distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp))
    return dict(tp_plan="auto", tp_size=tp)


def load_model(path: str, plan: str, tp: int, device: torch.device, tigon: bool = True):
    """The checkpoint at ``path`` sharded by ``plan`` over ``tp`` ranks, in fp32, patched by tigon
    unless ``tigon`` is false."""
    if plan == "auto":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **auto_plan(tp))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        parallelize_sequence(model, init_device_mesh(device.type, (tp,)))
    if tigon:
        apply_tigon(model)  # after sharding: tigon's layers compute on what the plan gives them
    model.config.use_cache = False
    return model.train()


def load_expert_parallel(path: str, world_size: int, tigon: bool = True):
    """The mixture-of-experts checkpoint at ``path`` with its experts spread over ``world_size``
    ranks by transformers' expert parallelism, in fp32: the experts on tigon's kernel and the model
    patched by tigon, or on transformers' ``grouped_mm`` unless ``tigon``."""
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="tigon" if tigon else "grouped_mm",
        distributed_config=DistributedConfig(tp_size=world_size, enable_expert_parallel=True),
    )
    if tigon:
        apply_tigon(model)  # the norms, RoPE and the fused loss; the experts are tigon's already
    model.config.use_cache = False
    return model.train()


def batch(step: int, size: int, seq_len: int, vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Step ``step``'s inputs, the same on every rank: random tokens, the first quarter of each
    sequence a prompt (labels -100), and the full ``position_ids``."""
    generator = torch.Generator().manual_seed(step)
    input_ids = torch.randint(3, vocab_size, (size, seq_len), generator=generator)
    labels = input_ids.clone()
    labels[:, : seq_len // 4] = -100
    position_ids = torch.arange(seq_len).expand(size, -1)
    return {name: tensor.to(device) for name, tensor in
            dict(input_ids=input_ids, labels=labels, position_ids=position_ids).items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.ep and world_size < 2:
        raise SystemExit("--ep needs 2 or more processes (torchrun --nproc-per-node N)")
    with tempfile.TemporaryDirectory() as directory:
        # Saved before the process group exists: within one, save_pretrained writes on rank 0 only.
        path = args.model or save_tiny(directory, tiny_qwen3_moe_config() if args.ep else tiny_llama_config())
        device = init_distributed(world_size if args.ep else args.tp)
        if args.ep:
            model = load_expert_parallel(path, world_size, tigon=args.tigon)
        else:
            model = load_model(path, args.plan, args.tp, device, tigon=args.tigon)
    rank = dist.get_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        loss = model(**batch(step, args.batch, args.seq_len, model.config.vocab_size, device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}")
    del model, optimizer, loss
    close_distributed()


if __name__ == "__main__":
    main()
