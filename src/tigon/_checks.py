"""Argument checks run once at the API boundary (functional and modules); kernels trust their inputs.

Every error names the argument, what it got and what was expected.
"""

from __future__ import annotations

import torch

from tigon.ops._launch import interpreting

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, value, *, dtypes=FLOAT_DTYPES, min_dim: int = 1, dim: int | None = None) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {value.dtype}; expected one of {_dtype_names(dtypes)}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(value.shape)}")
    if value.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(value.shape)}")
    if not value.is_cuda and not interpreting():
        raise ValueError(
            f"{name} is on {value.device}; tigon's kernels run on CUDA tensors "
            "(or on CPU tensors through Triton's interpreter, TRITON_INTERPRET=1)"
        )


def check_same_device(**tensors) -> None:
    devices = {t.device for t in tensors.values() if t is not None}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in tensors.items() if t is not None)
        raise ValueError(f"tensors must be on one device, got {where}")


def check_same_dtype(**tensors) -> None:
    present = {name: t for name, t in tensors.items() if t is not None}
    dtypes = {t.dtype for t in present.values()}
    if len(dtypes) > 1:
        what = ", ".join(f"{name} {t.dtype}" for name, t in present.items())
        raise TypeError(f"tensors must share one dtype, got {what}")


def check_shape(name: str, value: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({meaning}), got {tuple(value.shape)}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")


def check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def check_constant(name: str, value, why: str, fix: str | None = None) -> None:
    """Refuse a tensor that requires grad (with grad mode on) where tigon takes a constant: no
    gradient would reach it, and the caller learns that at the call, not from a missing gradient."""
    if isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
        fix = fix or f"pass {name}.detach()"
        raise ValueError(f"{name} requires grad, but {why}; tigon computes no gradient for it: {fix}")


def check_numbers(**values) -> None:
    """Options read as plain numbers (``eps``, ``temperature``, ``beta``...), whichever of them
    came as a tensor: see :func:`check_constant`."""
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            check_constant(name, value, "it is read as a plain number", f"pass a float or {name}.detach()")


def check_head(prefix: str, input, weight, bias=None, input_dim: int | None = None) -> None:
    """Hidden states ``{prefix}input [..., H]`` and an LM head ``{prefix}weight [V, H]`` (and
    ``{prefix}bias [V]``) of one dtype."""
    check_tensor(f"{prefix}input", input, dim=input_dim)
    check_tensor(f"{prefix}weight", weight, dim=2)
    hidden = input.shape[-1]
    if weight.shape[1] != hidden:
        raise ValueError(
            f"{prefix}weight must have shape (V, {hidden}) (the hidden size of {prefix}input), "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None:
        check_tensor(f"{prefix}bias", bias, dim=1)
        check_shape(f"{prefix}bias", bias, (weight.shape[0],), f"the rows of {prefix}weight")
    check_same_dtype(**{f"{prefix}input": input, f"{prefix}weight": weight, f"{prefix}bias": bias})


def check_input_weight_order(input, weight, target_name: str, target) -> None:
    """Name the likely swap when ``(weight, input)`` came where tigon takes ``(input, weight, ...)``
    (Liger's losses take ``(lin_weight, _input, target)``): the shapes fit with the two exchanged
    (``target`` matching the leading dimensions of what came as ``weight``), not as given."""
    tensors = (input, weight, target)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or input.dim() != 2 or weight.dim() < 1:
        return
    fits_given = tuple(target.shape) == tuple(input.shape[:-1]) and weight.dim() == 2
    fits_swapped = tuple(target.shape) == tuple(weight.shape[:-1]) and weight.shape[-1] == input.shape[-1]
    if fits_swapped and not fits_given:
        raise ValueError(
            f"input {tuple(input.shape)} and weight {tuple(weight.shape)} look swapped: {target_name} "
            f"{tuple(target.shape)} matches the leading dimensions of weight, not of input. Did you pass "
            f"(weight, input)? tigon takes (input, weight, {target_name}), input [..., H] and weight [V, H]"
        )


def vocab_sharded_head(input, weight, bias, target, process_group, target_name: str = "target"):
    """``(input, weight, bias, target, group, reduce_grad_input)`` as local tensors when the LM head
    is sharded along the vocabulary, else ``None``: ``weight`` a DTensor placed ``(Shard(0),)`` on
    a 1-D mesh (``bias`` ``None`` or placed alike; ``input`` and ``target`` plain tensors, the same
    on every rank, or DTensors placed ``Replicate()``), or ``weight`` this rank's plain shard
    ``[V_r, H]`` with ``process_group``. A DTensor ``input``'s gradient is left ``Partial`` (the
    sum over the ranks, reduced where its placement asks), a plain one's is all-reduced by the op
    (``reduce_grad_input``)."""
    if not torch.distributed.is_available():
        if process_group is not None:
            raise ValueError("process_group was given, but this PyTorch has no torch.distributed")
        return None
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    named = {"input": input, "weight": weight, "bias": bias, target_name: target}
    if not isinstance(weight, DTensor):
        for name, value in named.items():
            if isinstance(value, DTensor):
                raise TypeError(
                    f"{name} is a DTensor but weight is not: a vocabulary-parallel head takes weight as a DTensor "
                    "placed (Shard(0),), or plain local tensors with process_group"
                )
        if process_group is None:
            return None
        return input, weight, bias, target, process_group, True
    if process_group is not None:
        raise ValueError("process_group must be None when weight is a DTensor: its device mesh gives the group")
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"weight is a DTensor placed {tuple(weight.placements)} on a {mesh.ndim}-D mesh; expected (Shard(0),) "
            "on a 1-D mesh (the vocabulary sharded over the ranks): gather it (full_tensor()) or redistribute it"
        )
    if bias is not None:
        if not (isinstance(bias, DTensor) and bias.device_mesh == mesh and tuple(bias.placements) == (Shard(0),)):
            got = f"a DTensor placed {tuple(bias.placements)}" if isinstance(bias, DTensor) else "a plain tensor"
            raise ValueError(f"bias must be None or a DTensor placed (Shard(0),) on weight's mesh, as weight; got {got}")
        bias = bias.to_local()
    reduce_grad_input = True
    for name in ("input", target_name):
        value = named[name]
        if not isinstance(value, DTensor):
            continue
        if value.device_mesh != mesh or not all(isinstance(p, Replicate) for p in value.placements):
            raise ValueError(
                f"{name} is a DTensor placed {tuple(value.placements)}; expected a plain tensor or a DTensor placed "
                "(Replicate(),) on weight's mesh (every rank holds every token)"
            )
        if name == "input":
            value = value.to_local(grad_placements=[Partial()])
            reduce_grad_input = False
        else:
            value = value.to_local()
        named[name] = value
    return named["input"], weight.to_local(), bias, named[target_name], mesh.get_group(), reduce_grad_input
