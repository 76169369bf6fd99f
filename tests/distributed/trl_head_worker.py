"""Trains a tiny Llama through TRL's fused LM head (``add_fused_lm_head``), with tigon's kernel
behind it (``patch_trl``) or TRL's own, for a few SGD steps: in one process, or in each process of
a torchrun launch under FSDP2 or DeepSpeed ZeRO-3. Several runs share one launch (one process
group, one import of everything).

    python trl_head_worker.py RUNS.json OUT_DIR
    RUNS.json: {"name": {"strategy": "single" | "fsdp2" | "zero3", "loss": "mean" | "per_token",
                         "head": "tigon" | "trl", "tied": false, "lm_head_unit": false}, ...}

``lm_head_unit`` (FSDP2): ``lm_head`` is a unit of its own, not part of the root's.

Rank 0 writes ``OUT_DIR/<name>.pt``, a dict of per-step lists: ``losses`` (summed over every
micro-batch of every process), ``grads`` (each parameter's whole gradient, reduced over the
processes, before the step), ``grad_in_forward`` (tigon's mode after the step's backward),
``head_contexts`` (TRL's ``maybe_gather_lm_head_ctx`` calls, see :class:`HeadContexts`) and
``head_weight_between`` (under ZeRO-3, the status of lm_head's weight between forward and
backward); besides, ``params`` (every parameter after the last step) and ``head_functions`` (the
autograd nodes behind the first log-probs).

A step covers ``MICRO_BATCHES`` micro-batches: all of them, accumulated, in one process; one per
process in a launch of ``MICRO_BATCHES`` processes. Each loss is divided by the number of labelled
tokens of the whole step, and multiplied by the number of processes before backward (the engines
average the gradients over processes), so the step's gradient is the same either way.
"""

import contextlib
import gc
import json
import os
import sys
from pathlib import Path

import tigon  # noqa: F401  (first: without a GPU it switches on Triton's interpreter)

import torch
import torch.distributed as dist
import trl.trainer.utils as trl_utils
from run_example import without_deepspeed_shared_memory_op
from transformers import LlamaConfig, LlamaForCausalLM

import tigon.ops.fused_linear as fused_linear
from tigon.trl import patch_trl, unpatch_trl

VOCAB, HIDDEN, LAYERS = 301, 32, 2
# Chunks of 8 tokens: with a single chunk (any batch here, at the default budget) tigon keeps the
# logits for backward and never computes gradients in forward, whatever the loss.
fused_linear.DEFAULT_CHUNK_MEMORY_BYTES = 8 * VOCAB * 4
STEPS, MICRO_BATCHES, SEQUENCES = 3, 2, 2
# Micro-batch i holds sequences of SEQ_LENS[i] tokens: the processes hold different numbers of
# tokens, so a loss normalised per process instead of over the step would show.
SEQ_LENS = (12, 9)
LR = 0.5
ENTROPY_WEIGHT = 0.01


def build_model(tied: bool):
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(SEQ_LENS),
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)  # the same weights in every process
    model = LlamaForCausalLM(config).train()
    model.config.use_cache = False
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def micro_batch(step: int, index: int, loss_kind: str):
    """``(input_ids, labels, token_weights)`` of micro-batch ``index`` of ``step``. The mean's
    labels are all kept: on CPU TRL scores every position and zeroes the ignored ones' log-probs
    after the head, so one -100 label would make the mean's gradient differ between the head's
    rows, and tigon's head recompute. The per-token loss has prompts of -100 labels."""
    generator = torch.Generator().manual_seed(1000 * step + index)
    shape = (SEQUENCES, SEQ_LENS[index])
    input_ids = torch.randint(0, VOCAB, shape, generator=generator)
    labels = input_ids.clone()
    if loss_kind == "per_token":
        for row in range(SEQUENCES):
            labels[row, : torch.randint(1, SEQ_LENS[index] // 2, (1,), generator=generator)] = -100
    # One weight per scored position (the label shift drops one): negative ones too, as GRPO's
    # advantages.
    token_weights = torch.rand(shape[0], shape[1] - 1, generator=generator) * 3 - 1
    return input_ids, labels, token_weights


def head_functions(log_probs: torch.Tensor) -> list[str]:
    """The names of the autograd nodes that ``log_probs`` comes from."""
    names, seen, pending = set(), set(), [log_probs.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return sorted(names)


class HeadContexts:
    """Records each call of TRL's ``maybe_gather_lm_head_ctx`` (TRL's forward's, and the
    recomputing backward's of either head: all look it up in ``trl.trainer.utils``) as
    ``"forward:gather"``, ``"backward:whole"``, ...: where it ran, and whether it gathered a ZeRO-3
    weight or found the weight whole (a partitioned one would fail the head's shape check)."""

    def __init__(self):
        self.calls, self.original = [], trl_utils.maybe_gather_lm_head_ctx

    def __call__(self, *params):
        context = self.original(*params)
        phase = "forward" if torch._C._current_graph_task_id() == -1 else "backward"
        self.calls.append(f"{phase}:{'whole' if isinstance(context, contextlib.nullcontext) else 'gather'}")
        return context

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls

    def __enter__(self):
        trl_utils.maybe_gather_lm_head_ctx = self
        return self

    def __exit__(self, *exc):
        trl_utils.maybe_gather_lm_head_ctx = self.original
        return False


class Engine:
    """The strategy's wrapping: ``model`` to call, ``backward``, ``step``, and the whole gradients
    and parameters (collectives: every process calls them).

    Under ZeRO-3 (DeepSpeed 0.19) the model's forward discovers parameters read outside their
    module's forward, as TRL's forward reads lm_head's weight: DeepSpeed gathers the weight itself
    and makes it an external parameter of the root module, which partitions it after the forward
    (at the first step; later it stays whole) and gathers it again for its backward. TRL's
    ``maybe_gather_lm_head_ctx`` finds it whole both times. (Were the weight partitioned when its
    gradient is accumulated, after the head's backward has left TRL's context, autograd would fail
    on the shapes, with TRL's head as with tigon's: TRL relies on this discovery.)"""

    def __init__(self, model, run: dict, world_size: int):
        self.strategy, self.hf_deepspeed_config = run["strategy"], None
        if self.strategy == "zero3":
            self._deepspeed(model, world_size)
            return
        if self.strategy == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world_size,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            if run.get("lm_head_unit"):
                # Never called by TRL's forward, which reads its weight: a sharded DTensor that
                # TRL gathers with full_tensor(). In the root's unit, the root's forward unshards it.
                fully_shard(model.lm_head, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def _deepspeed(self, model, world_size: int):
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        config = {
            "zero_optimization": {
                "stage": 3,
                # Every matrix partitioned (lm_head's and the embeddings' included), the norms kept whole.
                "stage3_param_persistence_threshold": 10 * HIDDEN,
                "reduce_bucket_size": HIDDEN * HIDDEN,
                "stage3_prefetch_bucket_size": HIDDEN * HIDDEN,
            },
            "train_micro_batch_size_per_gpu": SEQUENCES,
            "gradient_accumulation_steps": 1,
            "train_batch_size": SEQUENCES * world_size,
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
        }
        # What a Trainer run holds: TRL's maybe_gather_lm_head_ctx gathers only while it lives.
        self.hf_deepspeed_config = HfDeepSpeedConfig(config)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        self.model, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def head_weight_status(self) -> str | None:
        """Under ZeRO-3, lm_head's weight's status: ``"AVAILABLE"`` (whole) or ``"NOT_AVAILABLE"``."""
        return self.model.module.lm_head.weight.ds_status.name if self.strategy == "zero3" else None

    def parameters(self):
        module = self.model.module if self.strategy == "zero3" else self.model
        return module.named_parameters()

    def backward(self, loss: torch.Tensor):
        if self.strategy == "zero3":
            self.model.backward(loss)
        else:
            loss.backward()

    def step(self):
        if self.strategy == "zero3":
            self.model.step()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def whole_grads(self) -> dict:
        if self.strategy == "zero3":
            from deepspeed.utils import safe_get_full_grad

            return {name: safe_get_full_grad(p).clone() for name, p in self.parameters()}
        return {name: _whole(p.grad) for name, p in self.parameters()}

    def whole_params(self) -> dict:
        if self.strategy == "zero3":
            from deepspeed.utils import safe_get_full_fp32_param

            return {name: safe_get_full_fp32_param(p).clone() for name, p in self.parameters()}
        return {name: _whole(p.detach()) for name, p in self.parameters()}

    def close(self):
        if self.hf_deepspeed_config is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).clone()


def loss_of(output, token_weights: torch.Tensor, loss_kind: str, num_items: torch.Tensor) -> torch.Tensor:
    if loss_kind == "mean":  # SFT's NLL, normalised over the step by num_items_in_batch
        return output.loss
    # GRPO-like: one weight per token and an entropy bonus (both zero where the label is -100).
    return (-(output.log_probs * token_weights).sum() - ENTROPY_WEIGHT * output.entropy.sum()) / num_items


def train(run: dict, rank: int, world_size: int) -> dict:
    patch_trl() if run["head"] == "tigon" else unpatch_trl()
    engine = Engine(build_model(run.get("tied", False)), run, world_size)
    indices = range(MICRO_BATCHES) if world_size == 1 else [rank]
    record = dict(losses=[], grads=[], grad_in_forward=[], head_contexts=[], head_weight_between=[])
    with HeadContexts() as head_contexts:
        for step in range(STEPS):
            batches = [micro_batch(step, index, run["loss"]) for index in indices]
            num_items = sum((labels[:, 1:] != -100).sum() for _, labels, _ in batches)
            if world_size > 1:
                dist.all_reduce(num_items)
            step_loss = torch.zeros(())
            for input_ids, labels, token_weights in batches:
                output = engine.model(
                    input_ids=input_ids, labels=labels, num_items_in_batch=num_items, fused_lm_head=True
                )
                if "head_functions" not in record:
                    record["head_functions"] = head_functions(output.log_probs)
                loss = loss_of(output, token_weights, run["loss"], num_items)
                head_weight_between = engine.head_weight_status()
                engine.backward(loss * world_size)
                step_loss += loss.detach()
            if world_size > 1:
                dist.all_reduce(step_loss)
            record["losses"].append(step_loss.item())
            record["grads"].append(engine.whole_grads())
            # None for TRL's own head, which has no such mode.
            record["grad_in_forward"].append(getattr(trl_utils._ChunkedLogProbFunction, "grad_in_forward", None))
            record["head_contexts"].append(head_contexts.take())
            record["head_weight_between"].append(head_weight_between)
            engine.step()
    record["params"] = engine.whole_params()
    engine.close()
    unpatch_trl()
    return record


def main():
    runs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    without_deepspeed_shared_memory_op()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        dist.init_process_group("gloo")
    for name, run in runs.items():
        record = train(run, rank, world_size)
        if rank == 0:
            torch.save(record, out / f"{name}.pt")
        gc.collect()  # let go of the engine (and its hooks on the group) before the next run
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
