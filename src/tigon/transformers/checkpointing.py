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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from tigon.transformers.layers import TigonGatedMLP, set_mlp_tiling
from tigon.transformers.offload import ActivationOffloader, HostMemoryError, OffloadedCheckpoint

# Part of the budget kept free when layers keep their activations (see the module docstring).
HEADROOM_FRACTION = 0.02


@dataclass(frozen=True)
class Probe:
    """One probe step: its peak allocated device memory and host memory in offloaded checkpoints
    (GiB; ``inf`` device memory when out of memory), and its time (seconds)."""

    peak_gib: float
    seconds: float
    host_gib: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Mode:
    """How the recomputed layers run: their inputs offloaded to host memory or not, and the MLP's
    sequence tile (see :func:`tigon.transformers.set_mlp_tiling`)."""

    offload: bool = False
    mlp_tile_tokens: int | str | None = None


@dataclass(frozen=True)
class CheckpointingPlan:
    """What :func:`fit_checkpointing` chose.

    Attributes:
        n_layers: the model's checkpointing layers.
        kept: how many of them, the last ones, keep their activations (are not recomputed).
        peak_gib: the measured peak of a training step with this plan (GiB, allocated memory).
        budget_gib: the budget it was fitted to.
        probes: the measured peak of each plan probed without offload, by ``kept`` (``inf`` when
            out of memory), at the plan's MLP tile.
        offload: whether the recomputed layers' inputs wait in pinned host memory.
        host_gib: the pinned host memory the plan holds (GiB; 0 without offload).
        mlp_tile_tokens: the MLP's sequence tile the plan set (``None``: the model's own, untouched).
        step_seconds: the measured time of a probe step with this plan.
        offloaded_probes: as ``probes``, for the plans probed with offload.
    """

    n_layers: int
    kept: int
    peak_gib: float
    budget_gib: float
    probes: dict[int, float] = field(default_factory=dict)
    offload: bool = False
    host_gib: float = 0.0
    mlp_tile_tokens: int | str | None = None
    step_seconds: float = math.nan
    offloaded_probes: dict[int, float] = field(default_factory=dict)

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
    offload: bool | str = False,
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
        offload: whether the recomputed layers' inputs wait in pinned host memory
            (:mod:`tigon.transformers.offload`): ``False``, ``True``, or ``"auto"``, which searches
            both and keeps the faster plan that fits (offload off when every layer's activations fit
            without it).

    When no plan fits with every layer recomputed, a model whose patched MLPs are not tiled yet is
    searched again with ``mlp_tile_tokens="auto"`` (:func:`tigon.transformers.set_mlp_tiling`),
    which the plan then keeps.

    Returns the :class:`CheckpointingPlan`, already applied to ``model``; its ``host_gib`` is the
    pinned host memory the plan holds. Raises ``ValueError`` when the step exceeds the budget even
    with every layer recomputed (and offloaded, and the MLP tiled, as allowed), saying why,
    host memory included.
    """
    if memory_budget_gib is not None and (not math.isfinite(memory_budget_gib) or memory_budget_gib <= 0):
        raise ValueError(f"memory_budget_gib must be a positive number of GiB or None, got {memory_budget_gib}")
    if not (isinstance(offload, bool) or offload == "auto"):
        raise ValueError(f"offload must be False, True or 'auto', got {offload!r}")
    _check_probe_args(model)
    n_layers = len(checkpointing_layers(model))
    tile = _mlp_tile(model)
    offloads = {False: [False], True: [True], "auto": [False, True]}[offload]
    groups = [[Mode(off, tile) for off in offloads]]
    if tile is None and _has_tileable_mlp(model):
        groups.append([Mode(off, "auto") for off in offloads])
    results: dict[tuple[int, Mode], Probe] = {}
    with _probing(model, batch, optimizer, loss_fn) as probe:

        def measure(kept: int, mode: Mode) -> Probe:
            if (kept, mode) not in results:
                _set_mode(model, kept, mode)
                results[kept, mode] = probe()
            return results[kept, mode]

        _set_mode(model, 0, groups[0][0])
        probe()  # creates the optimizer's state as the first step would; later probes see it
        if memory_budget_gib is None:
            memory_budget_gib = measure(0, groups[0][0]).peak_gib
        headroom = HEADROOM_FRACTION * memory_budget_gib if headroom_gib is None else headroom_gib
        choice = choose_plan(n_layers, memory_budget_gib, headroom, measure, groups)
    if choice is None:
        _set_mode(model, 0, groups[0][0])
        tried = "; ".join(
            f"{_describe(mode)}: {probe.peak_gib:.2f} GiB" + (f" ({probe.error})" if probe.error else "")
            for (kept, mode), probe in results.items() if kept == 0
        )
        raise ValueError(
            f"a training step needs more than memory_budget_gib = {memory_budget_gib:.2f} even with all {n_layers} "
            f"layers recomputed: {tried}"
        )
    kept, mode = choice
    _set_mode(model, kept, mode)
    chosen = results[kept, mode]
    offloader = getattr(model, "_tigon_offloader", None)
    if offloader is not None:
        offloader.keep_free(int(chosen.host_gib * 2**30) if mode.offload else 0)

    def peaks(offloaded: bool) -> dict[int, float]:
        return {
            k: probe.peak_gib for (k, m), probe in sorted(results.items(), key=lambda item: item[0][0])
            if m.offload == offloaded and m.mlp_tile_tokens == mode.mlp_tile_tokens
        }

    return CheckpointingPlan(
        n_layers, kept, chosen.peak_gib, memory_budget_gib, peaks(False), offload=mode.offload,
        host_gib=chosen.host_gib if mode.offload else 0.0,
        mlp_tile_tokens=mode.mlp_tile_tokens if mode.mlp_tile_tokens != tile else None,
        step_seconds=chosen.seconds, offloaded_probes=peaks(True),
    )


def choose_plan(
    n_layers: int, budget_gib: float, headroom_gib: float, measure: Callable[[int, Mode], Probe],
    groups: list[list[Mode]],
) -> tuple[int, Mode] | None:
    """The plan ``(kept, mode)`` that :func:`fit_checkpointing` picks, given ``measure(kept, mode)``.

    For each mode of the first group of ``groups`` in which any mode fits ``budget_gib`` with every
    layer recomputed: the largest ``kept`` whose peak stays within ``budget − headroom`` (a binary
    search; ``kept = 0`` stands even inside the headroom). Among those plans, the one whose probe
    step was fastest; a mode that keeps every layer ends the search (nothing recomputes: no later
    mode can be faster). ``None`` when nothing fits.
    """
    for group in groups:
        fitted: list[tuple[int, Mode]] = []
        for mode in group:
            if measure(0, mode).peak_gib > budget_gib:
                continue

            def fits(kept: int, mode: Mode = mode) -> bool:
                return measure(kept, mode).peak_gib <= budget_gib - headroom_gib

            low, high = 0, n_layers + 1
            if fits(n_layers):
                low = n_layers
            else:
                high = n_layers
                while high - low > 1:
                    middle = (low + high) // 2
                    low, high = (middle, high) if fits(middle) else (low, middle)
            fitted.append((low, mode))
            if low == n_layers:
                break
        if fitted:
            return min(fitted, key=lambda plan: measure(*plan).seconds)
    return None


def _describe(mode: Mode) -> str:
    offload = "offloaded" if mode.offload else "on the device"
    tile = "" if mode.mlp_tile_tokens is None else f", MLP tiles of {mode.mlp_tile_tokens} tokens"
    return f"inputs {offload}{tile}"


def _set_mode(model: torch.nn.Module, kept: int, mode: Mode) -> None:
    set_checkpointing(model, kept, offload=mode.offload)
    if _has_tileable_mlp(model):
        set_mlp_tiling(model, mode.mlp_tile_tokens)


def _has_tileable_mlp(model: torch.nn.Module) -> bool:
    return any(isinstance(module, TigonGatedMLP) for module in model.modules())


def _mlp_tile(model: torch.nn.Module) -> int | str | None:
    """The sequence tile of ``model``'s patched MLPs (``None`` when untiled or unpatched)."""
    return next((module.tile_tokens for module in model.modules() if isinstance(module, TigonGatedMLP)), None)


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
        return probe().peak_gib


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


def _probe_peak(model, batch, optimizer, stepped, loss_fn) -> Probe:
    """One training step on ``batch``, with ``stepped``'s step when given: its peak allocated
    memory (``inf`` out of memory, device or host), time and offloaded host memory."""
    offloader = getattr(model, "_tigon_offloader", None)
    if offloader is not None:
        offloader.reset_peak()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        loss = loss_fn(model, batch) if loss_fn is not None else model(**batch).loss
        if loss is None:
            raise ValueError("the model returned no loss for this batch: give it labels, or pass loss_fn")
        loss.backward()
        del loss
        if stepped is not None:
            stepped.step()
        torch.cuda.synchronize()
        host_gib = 0.0 if offloader is None else offloader.peak_in_use / 2**30
        return Probe(torch.cuda.max_memory_allocated() / 2**30, time.perf_counter() - start, host_gib)
    except (torch.OutOfMemoryError, HostMemoryError) as error:
        reason = str(error) if isinstance(error, HostMemoryError) else "out of device memory"
        return Probe(math.inf, math.inf, error=reason)
    finally:
        model.zero_grad(set_to_none=True)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
