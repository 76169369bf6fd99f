"""DTensors through tigon's functions: :func:`on_local_shards` decorates the entry points of
:mod:`tigon.functional` (the norms, the gates, RoPE) so that the kernel runs on each rank's local
shard wherever the op is local along the sharded dimensions, and nothing a tensor-parallel plan
keeps sharded is gathered. This module needs only torch, so that functional can import it.

Tensor parallelism hands a layer DTensors (``torch.distributed.tensor``) when its plan keeps
them: a sequence-parallel norm gets ``x`` sharded on the sequence with a replicated weight
(torch's ``SequenceParallel``), column-parallel projections kept as DTensors give gate, up, q and k
sharded on their last dimension. The kernels take plain tensors, so a decorated function runs on
the local tensors and wraps the results back with the input's placements, after checking that
this is exact:

- **norms** reduce over the last dimension: ``x`` may be replicated or sharded on any other
  dimension (sequence, batch), never on the last;
- **gates** (SwiGLU, GeGLU, ReLU²) are elementwise: any placement, the same for ``gate`` and
  ``up``;
- **RoPE** mixes each head's features and reads each position's angle: ``q``/``k`` may be sharded
  on the heads (and on the batch where the tables broadcast over it), never on positions or
  features.

Activations must not be ``Partial`` (a pending sum: the ops are not linear in it). Parameters
(the norm's weight and bias) and the rotary tables must be replicated: a weight sharded on the
hidden dimension is a norm over part of the features, refused with the placements named. Where
the activations are sharded, each rank's weight gradient sums only its own rows, so the local
weight is taken with a ``Partial`` gradient placement and DTensor sums it over the ranks; where
they are replicated, every rank computes the whole gradient (``Replicate``). A plain tensor next to
DTensors counts as replicated, except one that needs a gradient beside sharded activations, whose
gradient would silently hold one rank's rows: refused.

Plain tensors go straight to the function (one ``isinstance`` per argument).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

FunctionT = TypeVar("FunctionT", bound=Callable[..., Any])


class ShardingError(ValueError):
    """A DTensor placement that a tigon op cannot compute on local shards (a norm over a sharded
    hidden dimension, RoPE over sharded positions, a partial-sum activation...)."""


@dataclass(frozen=True)
class LocalRule:
    """How an op's arguments may be placed: ``activations`` (names) share one placement and may be
    sharded on the dimensions ``shardable(activation, arguments)`` returns; ``replicated`` (names)
    must be replicated. Every output takes the activations' placement."""

    what: str
    activations: tuple[str, ...]
    replicated: tuple[str, ...]
    shardable: Callable[[torch.Tensor, dict[str, Any]], range | set[int]]


def _all_but_last(x: torch.Tensor, arguments: dict[str, Any]) -> range:
    return range(x.dim() - 1)


def _every_dim(x: torch.Tensor, arguments: dict[str, Any]) -> range:
    return range(x.dim())


def _heads_or_broadcast_batch(q: torch.Tensor, arguments: dict[str, Any]) -> set[int]:
    """``[B, H, T, D]``: the heads, and the batch where the ``[B or 1, T, W]`` tables broadcast."""
    cos = arguments["cos"]
    return {0, 1} if cos.dim() == 2 or cos.shape[-3] == 1 else {1}


NORM = LocalRule("norm", ("x", "gate"), ("weight", "bias"), _all_but_last)
GATE = LocalRule("gate", ("gate", "up", "x"), (), _every_dim)
ROPE = LocalRule("RoPE", ("q", "k"), ("cos", "sin"), _heads_or_broadcast_batch)


def _describe(name: str, tensor: torch.Tensor) -> str:
    if isinstance(tensor, DTensor):
        return f"{name} {tuple(tensor.shape)} placed {tuple(tensor.placements)}"
    return f"{name} {tuple(tensor.shape)}, a plain tensor"


def _grad_placements(activation_placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """A replicated parameter's gradient placement: ``Partial`` along each mesh dimension on which
    the activations are sharded (each rank's gradient covers its rows), else ``Replicate``."""
    return tuple(Partial() if placement.is_shard() else Replicate() for placement in activation_placements)


def _check(rule: LocalRule, function_name: str, arguments: dict[str, Any]) -> tuple[DTensor, list[str]]:
    """The activation whose placement every output takes, and the names of the replicated
    arguments present; raises :class:`ShardingError` where the local op would not be exact."""
    tensors = {name: value for name, value in arguments.items() if isinstance(value, torch.Tensor)}
    dtensors = {name: value for name, value in tensors.items() if isinstance(value, DTensor)}
    meshes = {value.device_mesh for value in dtensors.values()}
    if len(meshes) > 1:
        raise ShardingError(f"tigon's {function_name}: its DTensor arguments are on different device meshes")
    activations = [name for name in rule.activations if name in tensors]
    lead = next((name for name in activations if name in dtensors), None)
    if lead is None:
        described = ", ".join(_describe(name, value) for name, value in dtensors.items())
        raise ShardingError(
            f"tigon's {function_name} got DTensor {described} but its {' and '.join(activations)} plain: "
            "pass the activations as DTensors too, or everything local"
        )
    placements = dtensors[lead].placements
    sharded = any(placement.is_shard() for placement in placements)
    for name in activations:
        value = tensors[name]
        if not isinstance(value, DTensor) or value.placements != placements:
            raise ShardingError(
                f"tigon's {function_name} computes on local shards, so its {' and '.join(activations)} must be "
                f"placed alike: got {_describe(lead, dtensors[lead])} and {_describe(name, value)}"
            )
    for placement in placements:
        if placement.is_partial():
            raise ShardingError(
                f"tigon's {function_name} got {_describe(lead, dtensors[lead])}: a partial sum, which the "
                f"{rule.what} is not linear in; redistribute it to Replicate() or Shard() first"
            )
        if isinstance(placement, Shard):
            dim = placement.dim % dtensors[lead].dim()
            if dim not in rule.shardable(dtensors[lead], arguments):
                raise ShardingError(
                    f"tigon's {function_name} got {_describe(lead, dtensors[lead])}: the {rule.what} mixes "
                    f"values along dimension {dim}, so it cannot run on shards of it; shard another dimension "
                    "(sequence or batch for a norm, heads for RoPE) or replicate it"
                )
    replicated = [name for name in rule.replicated if name in tensors]
    for name in replicated:
        value = tensors[name]
        if isinstance(value, DTensor) and not all(placement.is_replicate() for placement in value.placements):
            raise ShardingError(
                f"tigon's {function_name} needs {name} replicated, got {_describe(name, value)}: the "
                f"{rule.what} of a shard of the features is not the {rule.what} of the whole; replicate {name} "
                "(e.g. torch's SequenceParallel for the norm) or keep the layer out of the plan"
            )
        if not isinstance(value, DTensor) and sharded and value.requires_grad:
            raise ShardingError(
                f"tigon's {function_name} got {_describe(lead, dtensors[lead])} but {_describe(name, value)} "
                f"that needs a gradient: each rank would hold only its rows' part of it; make {name} a "
                "replicated DTensor (torch's SequenceParallel does) so that the parts are summed"
            )
    return dtensors[lead], replicated


class _Wait(torch.autograd.Function):
    """The identity, waiting for a collective's result both ways: a DTensor's local shard left by a
    collective (a reduce-scatter's, before a sequence-parallel norm), and the gradient that
    ``DTensor.from_local``'s backward hands back, are ``AsyncCollectiveTensor`` s whose data the
    kernels cannot read yet. (Their own ``wait()`` returns a tensor cut from the autograd graph.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.wait() if isinstance(x, AsyncCollectiveTensor) else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.wait() if isinstance(grad, AsyncCollectiveTensor) else grad


def _to_local(value: Any, grad_placements: tuple[Placement, ...] | None = None) -> Any:
    if not isinstance(value, DTensor):
        return value
    local = value.to_local(grad_placements=grad_placements)
    return _Wait.apply(local) if isinstance(local, AsyncCollectiveTensor) else local


def on_local_shards(rule: LocalRule) -> Callable[[FunctionT], FunctionT]:
    """Decorate a tigon function so that DTensor arguments placed as ``rule`` allows run on their
    local shards (see the module's docstring); plain tensors pass straight through."""

    def decorate(function: FunctionT) -> FunctionT:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def local_function(*args: Any, **kwargs: Any) -> Any:
            if not any(isinstance(value, DTensor) for value in (*args, *kwargs.values())):
                return function(*args, **kwargs)
            call = signature.bind(*args, **kwargs)
            lead, replicated = _check(rule, function.__name__, call.arguments)
            grad_placements = _grad_placements(lead.placements)
            for name, value in call.arguments.items():
                call.arguments[name] = _to_local(value, grad_placements if name in replicated else None)
            result = function(*call.args, **call.kwargs)
            return _from_local(result, lead)

        return local_function  # type: ignore[return-value]

    return decorate


def _from_local(result: Any, like: DTensor) -> Any:
    """``result`` (a tensor, or a tuple of tensors and ``None``) as DTensors placed as ``like``."""
    if isinstance(result, tuple):
        return tuple(_from_local(value, like) for value in result)
    if not isinstance(result, torch.Tensor):
        return result
    if result.requires_grad:
        result = _Wait.apply(result)
    return DTensor.from_local(result, like.device_mesh, like.placements, run_check=False)

