"""The runs that tests/distributed/test_tensor_parallel.py compares, in one process or in each
process of a tensor-parallel launch; rank 0 saves their records to ``OUT`` (``torch.save``).

    python tensor_parallel_worker.py CHECKPOINT OUT reference
    torchrun --nproc-per-node N tensor_parallel_worker.py CHECKPOINT OUT CASE [CASE ...]

``reference``: the checkpoint's model in one process, plain Hugging Face (first, before tigon
patches anything in the process) and under ``apply_tigon``. The cases (examples/train_tp.py's
plans, patched after sharding):

- ``auto``: ``tp_plan="auto"``; ``auto-checkpointing``: the same under non-reentrant gradient
  checkpointing (where one process takes tigon's whole-MLP function); ``auto-cross-entropy``:
  tigon's cross entropy over the logits the plan gathers; ``auto-replicated-head``: lm_head's
  weight a replicated DTensor, which leaves the loss to the model;
- ``sequence-parallel``: torch's ``parallelize_module`` with sequence-parallel norms;
  ``sequence-parallel-patched-first``: the same plan applied to a model tigon patched before;
- ``refusals``: placements tigon's layers cannot compute on shards, each error's type and message;
- ``local-ops``: ``tigon.nn.SwiGLUMLP`` with its gate and up column-parallel DTensors, tigon's
  RoPE on q and k sharded by heads, ``tigon.nn.RMSNorm`` sequence-parallel, and
  ``tigon.functional``'s norms, gates and RoPE on DTensors, against the same on whole tensors.

A training record holds every step's loss, every parameter's whole gradient (a DTensor's gathered
with ``full_tensor()``), whether the loss was tigon's fused one (no logits returned), the patched
layers' classes and the warnings raised.
"""

import copy
import os
import sys
import warnings
from pathlib import Path

import tigon  # noqa: F401  (first: without a GPU it switches on Triton's interpreter)

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from transformers import AutoModelForCausalLM

from tigon.transformers import apply_tigon
from tigon.transformers.layers import apply_rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_tp  # noqa: E402

STEPS, BATCH, SEQ = 3, 2, 16
# Adam's eps at 1e-5: at its default 1e-8 the first update turns the fp32 rounding of gradient
# entries near zero into whole ±lr steps, and tigon and Hugging Face in one process already
# differ by 1e-5 on the third step's gradients (1e-6 with this eps).
ADAM_EPS = 1e-5
DEVICE = torch.device("cpu")


def train(model) -> dict:
    """``STEPS`` AdamW steps on the example's batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=ADAM_EPS)
    losses, grads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            output = model(**train_tp.batch(step, BATCH, SEQ, model.config.vocab_size, DEVICE))
            output.loss.backward()
            losses.append(output.loss.item())
            grads.append({
                name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for name, p in model.named_parameters()
            })
            optimizer.step()
            optimizer.zero_grad()
    return dict(
        losses=losses, grads=grads, fused_loss=output.logits is None,
        classes=sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Tigon")}),
        warnings=sorted({w.category.__name__ for w in caught if "tigon" in str(w.message)}),
    )


def reference(checkpoint: str) -> dict:
    records = {}
    for name in ("plain", "tigon"):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        if name == "tigon":
            apply_tigon(model)
        records[name] = train(model.train())
    return records


def build(checkpoint: str, case: str, tp: int):
    """The checkpoint's model sharded and patched as ``case`` says."""
    if case == "sequence-parallel-patched-first":
        model = apply_tigon(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32))
        model.config.use_cache = False
        return train_tp.parallelize_sequence(model, init_device_mesh("cpu", (tp,))).train()
    plan = "sequence-parallel" if case == "sequence-parallel" else "auto"
    model = train_tp.load_model(checkpoint, plan, tp, DEVICE, tigon=False)
    if case == "auto-checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if case == "auto-replicated-head":
        head = model.lm_head
        head.weight = torch.nn.Parameter(head.weight.redistribute(placements=[Replicate()]))
    if case == "auto-cross-entropy":
        return apply_tigon(model, cross_entropy=True, fused_linear_cross_entropy=False)
    return apply_tigon(model)


def refusals(checkpoint: str, tp: int) -> dict:
    """Each refused placement's ``(error type, message)``, from a patched model's layers."""
    mesh = init_device_mesh("cpu", (tp,))
    model = apply_tigon(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32))
    hidden = model.config.hidden_size
    x = torch.randn(BATCH, SEQ, hidden, requires_grad=True)
    norm = model.model.norm
    attempts = {
        # The norm's input sharded on the hidden dimension (a "sequence" dimension of -1).
        "hidden-sharded input": lambda: parallelize_module(norm, mesh, SequenceParallel(sequence_dim=-1))(
            x.narrow(-1, 0, hidden // tp)
        ),
        "hidden-sharded weight": lambda: distribute_module(
            model.model.layers[0].input_layernorm, mesh,
            lambda name, module, mesh: module.register_parameter(
                "weight", torch.nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))
            ),
        )(DTensor.from_local(x, mesh, [Replicate()])),
        "partial input": lambda: model.model.layers[1].input_layernorm(DTensor.from_local(x, mesh, [Partial()])),
        # q and k [B, H, T, D] sharded on the positions, whose angles the tables hold whole.
        "position-sharded rope": lambda: apply_rotary_pos_emb(
            DTensor.from_local(torch.randn(BATCH, 4, SEQ // tp, 16), mesh, [Shard(2)]),
            DTensor.from_local(torch.randn(BATCH, 4, SEQ // tp, 16), mesh, [Shard(2)]),
            torch.randn(BATCH, SEQ, 16), torch.randn(BATCH, SEQ, 16),
        ),
    }
    errors = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except Exception as error:  # noqa: BLE001  (the test names the type it expects)
            errors[name] = (type(error).__name__, str(error))
        else:
            errors[name] = None
    return errors


def _relative(actual: torch.Tensor, truth: torch.Tensor) -> float:
    actual = actual.full_tensor() if isinstance(actual, DTensor) else actual
    return ((actual - truth).norm() / truth.norm()).item()


def local_ops(tp: int) -> dict:
    """tigon's functions and modules on DTensors they compute locally, against the same on whole
    tensors: each case's largest relative error over the output and every input's gradient."""
    mesh = init_device_mesh("cpu", (tp,))
    torch.manual_seed(0)  # the same tensors on every rank
    errors = {}

    # tigon.nn.SwiGLUMLP with gate and up column-parallel, kept as DTensors: SwiGLU on their columns.
    x = torch.randn(BATCH, SEQ, 32, requires_grad=True)
    grad_out = torch.randn(BATCH, SEQ, 32)
    whole = tigon.nn.SwiGLUMLP(32, 16 * tp)
    truth = whole(x)
    truth_grads = torch.autograd.grad(truth, (x, *whole.parameters()), grad_out)
    mlp = copy.deepcopy(whole)
    parallelize_module(mlp, mesh, {
        "gate_proj": ColwiseParallel(use_local_output=False), "up_proj": ColwiseParallel(use_local_output=False),
        "down_proj": RowwiseParallel(),
    })
    x_whole = x.detach().requires_grad_()
    out = mlp(x_whole)
    out.backward(grad_out)
    grads = (x_whole.grad, *(p.grad for p in mlp.parameters()))
    errors["swiglu_mlp"] = max(_relative(out, truth), *(_relative(g, t) for g, t in zip(grads, truth_grads)))

    # RoPE on q and k [B, H, T, D] sharded by heads, the tables whole.
    q, k = (torch.randn(BATCH, 2 * tp, SEQ, 16, requires_grad=True) for _ in range(2))
    cos, sin = torch.randn(BATCH, SEQ, 16), torch.randn(BATCH, SEQ, 16)
    grads_out = [torch.randn(BATCH, 2 * tp, SEQ, 16) for _ in range(2)]
    truth = apply_rotary_pos_emb(q, k, cos, sin)
    truth_grads = torch.autograd.grad(truth, (q, k), grads_out)
    shards = [distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in (q, k)]
    out = apply_rotary_pos_emb(*shards, cos, sin)
    torch.autograd.backward(out, [distribute_tensor(g, mesh, [Shard(1)]) for g in grads_out])
    errors["rope"] = max(
        *(_relative(o, t) for o, t in zip(out, truth)), *(_relative(s.grad, g) for s, g in zip(shards, truth_grads))
    )

    # tigon.nn.RMSNorm, sequence-parallel: x [B, T/tp, H] on each rank, the weight replicated.
    x = torch.randn(BATCH, SEQ, 32, requires_grad=True)
    grad_out = torch.randn(BATCH, SEQ, 32)
    whole = tigon.nn.RMSNorm(32)
    torch.nn.init.normal_(whole.weight)
    truth = whole(x)
    truth_grads = torch.autograd.grad(truth, (x, whole.weight), grad_out)
    norm = parallelize_module(tigon.nn.RMSNorm(32), mesh, SequenceParallel())
    with torch.no_grad():
        norm.weight.copy_(distribute_tensor(whole.weight.detach(), mesh, [Replicate()]))
    x_local = x.detach().chunk(tp, dim=1)[dist.get_rank()].requires_grad_()
    out = norm(x_local)
    out.backward(distribute_tensor(grad_out, mesh, [Shard(1)]))
    x_grad = DTensor.from_local(x_local.grad, mesh, [Shard(1)])
    errors["rms_norm"] = max(
        _relative(out, truth), _relative(x_grad, truth_grads[0]), _relative(norm.weight.grad, truth_grads[1])
    )
    errors.update(functional_ops(mesh))
    return errors


def _whole_and_sharded(function, inputs: dict, placements: dict) -> float:
    """The largest relative error of ``function`` on DTensors (``inputs`` distributed as
    ``placements`` says, the rest plain) over its output and every input's gradient, against the
    same call on the whole tensors."""
    outputs = function(**inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads_out = [torch.randn_like(output) for output in outputs]
    leaves = {name: value for name, value in inputs.items() if isinstance(value, torch.Tensor) and value.requires_grad}
    truth_grads = torch.autograd.grad(outputs, tuple(leaves.values()), grads_out)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    distributed = {
        name: distribute_tensor(value.detach(), mesh, placements[name]).requires_grad_(value.requires_grad)
        if name in placements else value
        for name, value in inputs.items()
    }
    sharded = function(**distributed)
    sharded = sharded if isinstance(sharded, tuple) else (sharded,)
    torch.autograd.backward(sharded, [distribute_tensor(g, mesh, o.placements) for g, o in zip(grads_out, sharded)])
    return max(
        *(_relative(o, t) for o, t in zip(sharded, outputs)),
        *(_relative(distributed[name].grad, truth) for name, truth in zip(leaves, truth_grads)),
    )


def functional_ops(mesh) -> dict:
    """tigon.functional's norms, gates and RoPE called on DTensors (as a tensor-parallel plan keeps
    them), against the same calls on whole tensors."""
    tp = mesh.size()
    sequence, replicated, columns, heads = [Shard(1)], [Replicate()], [Shard(-1)], [Shard(1)]

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    gates = {}
    for name in ("swiglu", "geglu"):
        gates[name] = _whole_and_sharded(
            getattr(tigon.functional, name), dict(gate=leaf(BATCH, SEQ, 16 * tp), up=leaf(BATCH, SEQ, 16 * tp)),
            dict(gate=columns, up=columns),
        )
    gates["relu2"] = _whole_and_sharded(tigon.functional.relu2, dict(x=leaf(BATCH, SEQ, 16 * tp)), dict(x=columns))
    norm_inputs = dict(x=leaf(BATCH, SEQ, 32), weight=leaf(32))
    return {
        "functional_rms_norm": max(
            _whole_and_sharded(tigon.functional.rms_norm, norm_inputs, dict(x=sequence, weight=replicated)),
            _whole_and_sharded(tigon.functional.rms_norm, norm_inputs, dict(x=replicated, weight=replicated)),
        ),
        "functional_layer_norm": _whole_and_sharded(
            tigon.functional.layer_norm, dict(**norm_inputs, bias=leaf(32)),
            dict(x=sequence, weight=replicated, bias=replicated),
        ),
        "functional_gates": max(gates.values()),
        "functional_rope": _whole_and_sharded(
            tigon.functional.rope,
            dict(q=leaf(BATCH, 2 * tp, SEQ, 16), k=leaf(BATCH, 2 * tp, SEQ, 16),
                 cos=torch.randn(BATCH, SEQ, 16), sin=torch.randn(BATCH, SEQ, 16)),
            dict(q=heads, k=heads),
        ),
    }


def main():
    checkpoint, out, cases = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    if cases == ["reference"]:
        torch.save(reference(checkpoint), out)
        return
    train_tp.init_distributed(int(os.environ["WORLD_SIZE"]))
    records = {}
    for case in cases:
        if case == "refusals":
            records[case] = refusals(checkpoint, dist.get_world_size())
            continue
        if case == "local-ops":
            records[case] = local_ops(dist.get_world_size())
            continue
        records[case] = train(build(checkpoint, case, dist.get_world_size()))
    if dist.get_rank() == 0:
        torch.save(records, out)
    train_tp.close_distributed()


if __name__ == "__main__":
    main()
