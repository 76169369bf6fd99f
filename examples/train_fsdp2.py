"""Train a tigon-patched Llama (or Qwen3-MoE) on several processes: FSDP2, DDP or DeepSpeed ZeRO-3, under torchrun.

tigon asks nothing of the engine: patch the model (here ``apply_tigon_to_llama()`` before it is
built), then wrap it as usual. With ``--model qwen3_moe`` the decoder layers are mixture-of-experts
ones, whose experts run on tigon's fused kernel (FSDP2 shards the expert weights by expert). In training, the fused linear cross entropy is computed at
``lm_head``'s call, from its weight as the engine presents it there (unsharded by FSDP2, gathered
by ZeRO-3); tigon never gathers a weight itself.

For the multi-process losses to equal the one-process ones, the loop does what the Trainer does:

- the tokens that count (labels other than -100) are summed over the whole step, every micro-batch
  of every process, and passed to the model as ``num_items_in_batch``: each token then weighs the
  same wherever it lands, though processes hold different numbers of them;
- the loss is multiplied by the number of processes before backward, because the engines average
  the gradients over processes where the loss wants their sum;
- gradients are synchronised on a step's last micro-batch only.

Mixed precision (``--precision bf16``) is the engine's own: FSDP2's ``MixedPrecisionPolicy``
(bf16 compute, fp32 parameters and gradient reduction), DeepSpeed's ``bf16`` section, and
``torch.autocast`` for DDP and one process. The model is tiny and the data synthetic (sequences
count upwards from a random start after a prompt of -100 labels), so the script runs anywhere.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py                  # FSDP2; NCCL on GPUs, gloo on CPU
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --strategy ddp
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --strategy zero3 # examples/deepspeed_zero3.json
    python examples/train_fsdp2.py --strategy single --grad-accum 4       # the same steps in one process
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --model qwen3_moe
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --fp8 tensorwise # torchao float8, FP8 all-gathers
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tigon.transformers import (
    apply_tigon_to_llama,
    apply_tigon_to_qwen3_moe,
    set_checkpointing,
    unapply_tigon_to_llama,
    unapply_tigon_to_qwen3_moe,
)

STRATEGIES = ("fsdp2", "ddp", "zero3", "single")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
DEEPSPEED_CONFIG = Path(__file__).with_name("deepspeed_zero3.json")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="fsdp2")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--no-tigon", dest="tigon", action="store_false", help="plain Hugging Face, for comparison")
    parser.add_argument("--model", choices=("llama", "qwen3_moe"), default="llama",
                        help="qwen3_moe: every layer a MoE of 4 experts, top-2")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--tie-embeddings", action="store_true", help="lm_head shares the input embeddings' weight")
    parser.add_argument("--fp8", choices=FP8_RECIPES,
                        help="train every linear layer (lm_head included) in FP8 by this torchao float8 recipe; under "
                        "FSDP2 with tensorwise, the weights are all-gathered in FP8")
    parser.add_argument("--shard-lm-head", action="store_true",
                        help="FSDP2: lm_head is a unit of its own, resharded after its forward")
    parser.add_argument("--offload", action="store_true",
                        help="each layer's checkpointed input in host memory until its backward (long sequences)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per process per forward")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step on each process")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--deepspeed-config", type=Path, default=DEEPSPEED_CONFIG)
    parser.add_argument("--losses-out", type=Path,
                        help="rank 0 writes the per-step losses and gradient norms here (JSON)")
    return parser.parse_args(argv)


def init_distributed(strategy: str) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``; the process group (unless one is already there) is NCCL on
    GPUs, gloo on CPU."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if strategy == "single" and world_size > 1:
        raise SystemExit("--strategy single runs in one process: start it with python, not torchrun")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if strategy != "single" and not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # started with python: a group of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None
        )
    return rank, world_size, device


def build_model(args, device: torch.device):
    moe = args.model == "qwen3_moe"
    if args.tigon:
        # Before the model is built: its RMSNorm, SwiGLU MLP (or experts), RoPE and loss come from tigon.
        (apply_tigon_to_qwen3_moe if moe else apply_tigon_to_llama)()
    else:
        # Plain, even in a process where an earlier run patched the family.
        (unapply_tigon_to_qwen3_moe if moe else unapply_tigon_to_llama)()
    shape = dict(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq_len, tie_word_embeddings=args.tie_embeddings,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if moe:
        config = Qwen3MoeConfig(**shape, head_dim=args.hidden_size // 4, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=args.hidden_size)
    else:
        config = LlamaConfig(**shape)
    torch.manual_seed(0)  # the same weights in every process
    model = (Qwen3MoeForCausalLM if moe else LlamaForCausalLM)(config).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.offload:
        set_checkpointing(model, 0, offload=True)  # each rank offloads its own layers' inputs
    if args.fp8:
        to_float8(model, args)
    model.config.use_cache = False
    model.train()
    return model


def to_float8(model, args) -> None:
    """torchao's float8 training on every linear layer whose dimensions divide by 16, lm_head
    included (tigon's fused loss follows its recipe). FSDP2 then all-gathers tensorwise weights in
    FP8, their scales computed once per step for every layer (Engine.step)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(args.fp8)
    if args.strategy == "fsdp2" and args.fp8 == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)


def sequence(index: int, seq_len: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence number ``index`` of the data: ``(input_ids, labels)``, each ``[seq_len]``. Tokens
    count upwards from a random start; a prompt of random length carries no labels (-100)."""
    generator = torch.Generator().manual_seed(index)
    start = torch.randint(0, vocab_size, (1,), generator=generator)
    input_ids = (start + torch.arange(seq_len)) % vocab_size
    labels = input_ids.clone()
    labels[: torch.randint(0, seq_len // 2, (1,), generator=generator)] = -100
    return input_ids, labels


def micro_batches(args, step: int, rank: int, world_size: int, device: torch.device):
    """This process's micro-batches of ``step``. A step covers ``micro_batch · grad_accum ·
    world_size`` sequences, the same ones whatever the number of processes."""
    per_step = args.micro_batch * args.grad_accum * world_size
    batches = []
    for micro in range(args.grad_accum):
        first = step * per_step + (micro * world_size + rank) * args.micro_batch
        pairs = [sequence(index, args.seq_len, args.vocab_size) for index in range(first, first + args.micro_batch)]
        batches.append(tuple(torch.stack(column).to(device) for column in zip(*pairs)))
    return batches


class Engine:
    """The strategy's engine, one micro-batch at a time: ``forward``, ``backward`` and ``step``
    (the optimizer steps on a step's last micro-batch; gradients are synchronised only then)."""

    def __init__(self, model, args, world_size: int, device: torch.device):
        self.strategy, self.max_grad_norm, bf16 = args.strategy, args.max_grad_norm, args.precision == "bf16"
        self.fp8_all_gather = args.strategy == "fsdp2" and args.fp8 == "tensorwise"
        # FSDP2's policy and DeepSpeed's bf16 section cast the parameters; DDP and one process autocast.
        autocast = bf16 and self.strategy in ("ddp", "single")
        self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
        if self.strategy == "zero3":
            self.model = _deepspeed_engine(model, args, world_size, bf16)
            return
        if self.strategy == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(device.type, (world_size,))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
                else MixedPrecisionPolicy()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            if args.shard_lm_head:
                if args.tie_embeddings:
                    raise SystemExit("--shard-lm-head: a tied lm_head shares its weight with the root's embeddings")
                fully_shard(model.lm_head, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
            fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: embeddings, final norm (and lm_head)
        elif self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def _no_sync(self, last: bool):
        return self.model.no_sync() if self.strategy == "ddp" and not last else contextlib.nullcontext()

    def forward(self, last: bool, **inputs):
        if self.strategy == "fsdp2":
            self.model.set_requires_gradient_sync(last)
        with self._no_sync(last), self.autocast():
            return self.model(**inputs)

    def backward(self, loss: torch.Tensor, last: bool):
        if self.strategy == "zero3":
            # DeepSpeed divides by the accumulation steps unless told not to: num_items_in_batch
            # already normalises the whole step.
            self.model.backward(loss, scale_wrt_gas=False)
        else:
            with self._no_sync(last):
                loss.backward()

    def step(self, last: bool) -> float | None:
        """The optimizer's step on the last micro-batch, after clipping the gradients to
        ``max_grad_norm``; returns their norm over the whole model (every shard) before clipping."""
        if self.strategy == "zero3":
            self.model.step()  # every micro-batch: DeepSpeed counts them and steps on the last
            return float(self.model.get_global_grad_norm()) if last else None
        if not last:
            return None
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.fp8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()  # FSDP2: a DTensor


def _deepspeed_engine(model, args, world_size: int, bf16: bool):
    import deepspeed

    config = json.loads(args.deepspeed_config.read_text())
    hidden = args.hidden_size
    # What "auto" stands for: the values a Trainer run fills in from its arguments and the model.
    auto = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world_size,
        "gradient_clipping": args.max_grad_norm,
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    for section in (config, config.get("zero_optimization", {})):
        section.update({key: auto[key] for key, value in section.items() if value == "auto" and key in auto})
    config.setdefault("bf16", {})["enabled"] = bf16
    # A torch optimizer: DeepSpeed's own Adam is a CUDA extension, and this keeps every strategy's
    # update the same.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train(args, rank: int, world_size: int, device: torch.device) -> dict:
    """Train for ``args.steps`` steps; returns every step's loss and gradient norm."""
    model = build_model(args, device)
    # The MoE layers' experts implementation ("tigon" once patched; transformers' "grouped_mm" else).
    experts = sorted({m.config._experts_implementation for m in model.modules() if hasattr(m, "is_transposed")})
    engine = Engine(model, args, world_size, device)
    losses, grad_norms = [], []
    for step_index in range(args.steps):
        batches = micro_batches(args, step_index, rank, world_size, device)
        # Position t predicts token t + 1: the first label of each sequence predicts nothing.
        num_items = sum((labels[:, 1:] != -100).sum() for _, labels in batches)
        if world_size > 1:
            dist.all_reduce(num_items)
        step_loss = torch.zeros((), device=device)
        for micro, (input_ids, labels) in enumerate(batches):
            last = micro == len(batches) - 1
            output = engine.forward(last, input_ids=input_ids, labels=labels, num_items_in_batch=num_items)
            engine.backward(output.loss * world_size, last)
            grad_norm = engine.step(last)
            step_loss += output.loss.detach().float()
        if world_size > 1:
            dist.all_reduce(step_loss)
        losses.append(step_loss.item())
        grad_norms.append(grad_norm)
        if rank == 0:
            print(f"step {step_index}: loss {losses[-1]:.6f}, gradient norm {grad_norm:.6f}"
                  + ("" if output.logits is None else " (logits built)"))
    return dict(fused_loss=output.logits is None, experts=experts, losses=losses, grad_norms=grad_norms)


def main(argv=None) -> None:
    args = parse_args(argv)
    owns_group = args.strategy != "single" and not dist.is_initialized()
    rank, world_size, device = init_distributed(args.strategy)
    record = train(args, rank, world_size, device)
    if rank == 0 and args.losses_out is not None:
        settings = dict(strategy=args.strategy, world_size=world_size, precision=args.precision, tigon=args.tigon)
        args.losses_out.write_text(json.dumps({**settings, **record}))
    if owns_group:
        # Once every process has let go of its engine (DDP's reducer, say, holds the group).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
