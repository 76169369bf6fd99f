"""The runs tests/distributed/test_autotp.py compares, in every process of one launch: a tiny Llama
trained by DeepSpeed with its AutoTP tensor parallelism over all the processes (gloo), plain Hugging
Face first, then patched by tigon (``apply_tigon`` before ``deepspeed.initialize``, which shards
the linear layers). Rank 0 writes ``OUT`` (``torch.save``): per run, every step's loss, whether the
loss was tigon's fused one, the head's class, and each rank's parameter gradients of the first step.

    torchrun --nproc-per-node 2 autotp_worker.py OUT
"""

import gc
import sys

import tigon  # noqa: F401  (first: without a GPU it switches on Triton's interpreter)

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from run_example import without_deepspeed_shared_memory_op
from tigon.transformers import apply_tigon

STEPS, BATCH, SEQ, VOCAB = 3, 2, 16, 128


def train(patched: bool, world_size: int) -> dict:
    import deepspeed

    torch.manual_seed(0)
    # 4 heads and 4 KV heads, so that each of 2 or 4 ranks holds whole ones.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if patched:
        apply_tigon(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
        "tensor_parallel": {"autotp_size": world_size}, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    })
    generator = torch.Generator().manual_seed(1)  # every rank the same batches: TP splits the model
    record = {"losses": [], "head": type(engine.module.lm_head).__name__}
    for step in range(STEPS):
        input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
        labels = input_ids.clone()
        labels[:, :4] = -100
        output = engine(input_ids=input_ids, labels=labels)
        engine.backward(output.loss)
        if step == 0:
            record["grads"] = {name: p.grad.clone() for name, p in engine.module.named_parameters()
                               if p.grad is not None}
        engine.step()
        record["losses"].append(output.loss.item())
        record["fused_loss"] = output.logits is None
    return record


def main() -> None:
    out = sys.argv[1]
    without_deepspeed_shared_memory_op()
    import deepspeed

    deepspeed.init_distributed("gloo")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    records = {name: train(name == "tigon", world_size) for name in ("plain", "tigon")}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {name: record.pop("grads") for name, record in records.items()})
    if rank == 0:
        torch.save({"runs": records, "grads_by_rank": gathered}, out)
    gc.collect()  # the engines hold the group
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
