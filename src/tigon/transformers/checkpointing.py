"""Gradient checkpointing chosen by a memory budget: recompute only the layers the budget forces.

Hugging Face's ``gradient_checkpointing_enable()`` recomputes every decoder layer in backward, the
price of fitting the largest batch. A model patched by tigon needs far less memory than the
unpatched one (no logits, smaller saved activations), so at the same budget it can keep some
layers' activations and skip their recomputation. :func:`fit_checkpointing` finds how many:

- It **measures** rather than models the memory: each candidate plan runs one probe step on the
  batch the user will train on (forward, backward and, when given, the optimizer's step with a
  learning rate of zero, so the weights do not change), and reads the step's peak from PyTorch's
  caching allocator (``torch.cuda.max_memory_allocated``). A probe that runs out of memory counts
  as over the budget.
- Layers are the model's :class:`transformers.modeling_layers.GradientCheckpointingLayer` modules
  (the decoder layers, and a vision tower's), in the order the model runs them. The **last** ``k``
  keep their activations, the others recompute: in backward the kept layers come first and are
  freed before any recomputation starts, so a recomputed layer never adds its activations on top
  of the kept ones. The peak grows with ``k``; a binary search over ``k`` finds the largest that
  fits: three probe steps when every layer fits (a warm-up, all recomputed, none), about
  ``log2(n)`` more otherwise. :func:`measure_step_peak` probes the plan a model has.
- Probes leave no trace: gradients are released, a fresh optimizer's state is cleared again (the
  first real step creates it as it would have), the learning rates are restored, and the random
  number generators are forked, so dropout draws in training are those of a run without probes.
  Checkpointing never changes the values computed: the losses are the same with any plan.

Error margin: a probe and a training step make the same allocations, so the measured peaks agree to
within a few MiB (``tigon bench e2e --budget`` reports both). Kept layers must stay below
``budget − headroom`` (2% of the budget by default) for what the probe cannot see: a batch of a
different shape, the allocator's fragmentation over a long run, memory other code allocates. The
budget counts allocated memory; the allocator reserves somewhat more (set
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` to keep that close).

With the Hugging Face ``Trainer``, call :func:`fit_checkpointing` before ``trainer.train()`` and
leave ``TrainingArguments(gradient_checkpointing=False)``: the trainer would otherwise re-enable
recomputation on every layer when training starts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from tigon.transformers.offload import ActivationOffloader, OffloadedCheckpoint

# Part of the budget kept free when layers keep their activations (see the module docstring).
HEADROOM_FRACTION = 0.02


@dataclass(frozen=True)
class CheckpointingPlan:
    """What :func:`fit_checkpointing` chose.

    Attributes:
        n_layers: the model's checkpointing layers.
        kept: how many of them, the last ones, keep their activations (are not recomputed).
        peak_gib: the measured peak of a training step with this plan (GiB, allocated memory).
        budget_gib: the budget it was fitted to.
        probes: the measured peak of each plan probed, by ``kept`` (``inf`` when out of memory).
    """

    n_layers: int
    kept: int
    peak_gib: float
    budget_gib: float
    probes: dict[int, float] = field(default_factory=dict)

    @property
    def recomputed(self) -> int:
        """The layers that recompute in backward, the first ``n_layers − kept``."""
        return self.n_layers - self.kept


def checkpointing_layers(model: torch.nn.Module) -> list[GradientCheckpointingLayer]:
    """The layers of ``model`` that Hugging Face's gradient checkpointing can recompute, in the
    order the model runs them (module registration order)."""
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def set_checkpointing(model: torch.nn.Module, kept: int, *, offload: bool = False) -> None:
    """Recompute every checkpointing layer of ``model`` in backward except the last ``kept``.

    With ``offload``, the recomputed layers keep their saved inputs in pinned host memory until
    their backward instead of on the device (:mod:`tigon.transformers.offload`; the gradients are
    unchanged). :func:`offload_host_bytes` tells the host memory that takes.

    Enables Hugging Face's non-reentrant gradient checkpointing first when the model has none set
    up (a model on which ``gradient_checkpointing_enable(...)`` was called keeps its function).
    """
    layers = checkpointing_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no gradient-checkpointing layers (GradientCheckpointingLayer)")
    if not 0 <= kept <= len(layers):
        raise ValueError(f"kept must be in [0, {len(layers)}] ({len(layers)} checkpointing layers), got {kept}")
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True or False, got {offload!r}")
    if not all(hasattr(layer, "_gradient_checkpointing_func") for layer in layers):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offloader = _offloader(model) if offload else None
    for index, layer in enumerate(layers):
        recomputed = index < len(layers) - kept
        checkpoint = layer._gradient_checkpointing_func
        if isinstance(checkpoint, OffloadedCheckpoint):
            checkpoint = checkpoint.checkpoint
        if offloader is not None and recomputed:
            checkpoint = OffloadedCheckpoint(checkpoint, offloader)
        # The layer's modules too: tigon's MLP reads its own flag, set by gradient_checkpointing_enable(),
        # and under checkpointing recomputes its projections in backward to save memory.
        for module in layer.modules():
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = recomputed
                module._gradient_checkpointing_func = checkpoint


def offload_host_bytes(model: torch.nn.Module) -> int:
    """The pinned host memory (bytes) that ``model``'s offloaded checkpoints hold: as much as their
    largest training step needed so far (0 before the first step, or without offload)."""
    offloader = getattr(model, "_tigon_offloader", None)
    return 0 if offloader is None else offloader.host_bytes


def _offloader(model: torch.nn.Module) -> ActivationOffloader:
    """``model``'s offloader, made on first use (its host buffers are kept across steps)."""
    if getattr(model, "_tigon_offloader", None) is None:
        model._tigon_offloader = ActivationOffloader()
    return model._tigon_offloader


def fit_checkpointing(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    memory_budget_gib: float | None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    headroom_gib: float | None = None,
    loss_fn: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
) -> CheckpointingPlan:
    """Set ``model``'s gradient checkpointing to recompute as few layers as fit ``memory_budget_gib``.

    Args:
        model: a Hugging Face model on a CUDA device, in training mode, patched or not.
        batch: a training batch of the shape training will use, as the model takes it
            (``input_ids``, ``labels``, ...). Its loss is ``model(**batch).loss`` unless ``loss_fn``.
        memory_budget_gib: the peak of a whole training step, in GiB of allocated memory; ``None``
            for the step's own peak with every layer recomputed, measured in the same probing (no
            more memory than full checkpointing, with as little recomputation as fits in it).
        optimizer: the optimizer training will step, so that its state and its step's memory count.
            A fresh one's state is cleared again after probing; one with state keeps it unchanged
            (its step is not probed then: the state already counts, a step's temporaries do not).
        headroom_gib: kept free when any layer keeps its activations; 2% of the budget by default.
        loss_fn: ``loss_fn(model, batch)`` → scalar loss, for models whose output has no ``loss``.

    Returns the :class:`CheckpointingPlan`, already applied to ``model``. Raises ``ValueError`` when
    the step exceeds the budget even with every layer recomputed.
    """
    if memory_budget_gib is not None and (not math.isfinite(memory_budget_gib) or memory_budget_gib <= 0):
        raise ValueError(f"memory_budget_gib must be a positive number of GiB or None, got {memory_budget_gib}")
    _check_probe_args(model)
    n_layers = len(checkpointing_layers(model))
    probes: dict[int, float] = {}
    with _probing(model, batch, optimizer, loss_fn) as probe:

        def peak_with(kept: int) -> float:
            set_checkpointing(model, kept)
            probes[kept] = probe()
            return probes[kept]

        peak_with(0)  # creates the optimizer's state as the first step would; later probes see it
        if memory_budget_gib is None:
            memory_budget_gib = peak_with(0)
        elif peak_with(0) > memory_budget_gib:
            set_checkpointing(model, 0)
            raise ValueError(
                f"a training step needs {probes[0]:.2f} GiB with all {n_layers} layers recomputed, "
                f"over memory_budget_gib = {memory_budget_gib:.2f}"
            )
        headroom = HEADROOM_FRACTION * memory_budget_gib if headroom_gib is None else headroom_gib

        def fits(kept: int) -> bool:
            return peak_with(kept) <= memory_budget_gib - headroom

        # The largest kept in [0, n_layers] that fits (kept = 0 stands even inside the headroom).
        low, high = 0, n_layers + 1
        if fits(n_layers):
            low = n_layers
        else:
            high = n_layers
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if fits(middle) else (low, middle)
    set_checkpointing(model, low)
    return CheckpointingPlan(n_layers, low, probes[low], memory_budget_gib, dict(sorted(probes.items())))


def measure_step_peak(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
) -> float:
    """The peak allocated memory (GiB) of a training step of ``model`` on ``batch`` as its
    checkpointing stands, probed as :func:`fit_checkpointing` probes (arguments as there)."""
    _check_probe_args(model)
    with _probing(model, batch, optimizer, loss_fn) as probe:
        probe()  # the first step creates the optimizer's state (and warms up kernels)
        return probe()


def _check_probe_args(model) -> None:
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"tigon's checkpointing plans measure CUDA memory; the model is on {device}")
    if not model.training:
        raise ValueError("tigon's checkpointing plans probe training steps: call model.train() first")


@contextlib.contextmanager
def _probing(model, batch, optimizer, loss_fn):
    """A function running one probe step and returning its peak (GiB), inside a forked random state
    and, for a fresh ``optimizer``, learning rates of zero (a zero step leaves AdamW's, Adam's and
    SGD's weights as they are: ``w · (1 − 0·λ) − 0·u``), restored afterwards with the state the
    probes created dropped. A resumed optimizer (one with state) is not stepped: its state must not
    move, and it already counts."""
    stepped = optimizer if optimizer is not None and not optimizer.state else None
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device]):
        if stepped is None:
            yield lambda: _probe_peak(model, batch, optimizer, None, loss_fn)
            return
        rates = [group["lr"] for group in stepped.param_groups]
        for group in stepped.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
        try:
            yield lambda: _probe_peak(model, batch, optimizer, stepped, loss_fn)
        finally:
            for group, rate in zip(stepped.param_groups, rates):
                group["lr"] = rate
            stepped.state.clear()


def _probe_peak(model, batch, optimizer, stepped, loss_fn) -> float:
    """The peak allocated memory (GiB) of one training step on ``batch``, with ``stepped``'s step
    when given; ``inf`` out of memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        loss = loss_fn(model, batch) if loss_fn is not None else model(**batch).loss
        if loss is None:
            raise ValueError("the model returned no loss for this batch: give it labels, or pass loss_fn")
        loss.backward()
        del loss
        if stepped is not None:
            stepped.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        return math.inf
    finally:
        model.zero_grad(set_to_none=True)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
