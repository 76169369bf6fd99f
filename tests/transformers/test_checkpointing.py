"""Gradient checkpointing fitted to a memory budget (tigon.transformers.checkpointing).

On the CPU: which layers a plan recomputes, that every plan gives the same losses and gradients,
and the planner's argument errors. On a GPU (the planner measures CUDA memory): a plan fitted
between the all-recomputed and the none-recomputed peaks keeps some layers and stays within the
budget in real training, probing leaves the weights, the optimizer and the random state as they
were, and training after probing matches training without it.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import loss_and_grads, tiny_batch, tiny_model
from utils import ON_GPU, TOLERANCE, relative_error

from tigon.transformers import apply_tigon, fit_checkpointing, measure_step_peak, set_checkpointing
from tigon.transformers.checkpointing import Mode, Probe, checkpointing_layers, choose_plan

N_LAYERS = 4


def test_set_checkpointing_recomputes_all_but_the_last_kept_layers():
    model = tiny_model("llama", num_hidden_layers=N_LAYERS).train()
    layers = checkpointing_layers(model)
    assert layers == list(model.model.layers)
    for kept in range(N_LAYERS + 1):
        set_checkpointing(model, kept)
        assert [layer.gradient_checkpointing for layer in layers] == [i < N_LAYERS - kept for i in range(N_LAYERS)]


@pytest.mark.parametrize("kept", [-1, N_LAYERS + 1])
def test_set_checkpointing_rejects_a_count_outside_the_layers(kept):
    model = tiny_model("llama", num_hidden_layers=N_LAYERS)
    with pytest.raises(ValueError, match=rf"kept must be in \[0, {N_LAYERS}\] \({N_LAYERS} checkpointing layers\), got {kept}"):
        set_checkpointing(model, kept)


def test_set_checkpointing_needs_checkpointing_layers():
    with pytest.raises(ValueError, match="Linear has no gradient-checkpointing layers"):
        set_checkpointing(torch.nn.Linear(2, 2), 0)


def test_set_checkpointing_sets_the_flags_of_the_modules_inside_each_layer():
    # tigon's MLP reads its own flag: under checkpointing it recomputes its projections in backward.
    model = apply_tigon(tiny_model("llama", num_hidden_layers=N_LAYERS).train())
    set_checkpointing(model, 1)
    assert [layer.mlp.gradient_checkpointing for layer in model.model.layers] == [True, True, True, False]


@pytest.mark.parametrize("patched", [False, True], ids=["hf", "tigon"])
def test_every_plan_gives_the_same_losses_and_gradients(patched):
    model = tiny_model("llama", num_hidden_layers=N_LAYERS).train()
    if patched:
        apply_tigon(model)
    input_ids, labels = tiny_batch()
    truth_loss, truth_grads = loss_and_grads(model, input_ids, labels)  # no checkpointing set up
    for kept in (0, 1, N_LAYERS):
        set_checkpointing(model, kept)
        loss, grads = loss_and_grads(model, input_ids, labels)
        assert torch.equal(loss, truth_loss), f"kept {kept}: loss {loss.item()} != {truth_loss.item()}"
        assert grads.keys() == truth_grads.keys() == {name for name, _ in model.named_parameters()}
        for name, grad in grads.items():
            if patched and kept < N_LAYERS:
                # A recomputed tigon MLP recomputes its projections slice by slice in backward: the same
                # products, summed in another order: fp32 rounding.
                assert relative_error(grad, truth_grads[name]) < TOLERANCE[torch.float32], f"kept {kept}: {name}"
            else:
                assert torch.equal(grad, truth_grads[name]), f"kept {kept}: {name}'s gradient differs"


def _fake_measure(peaks: dict[tuple[int, Mode], float], seconds: dict[Mode, float], calls: list):
    """``measure(kept, mode)`` over a table of peaks (missing: out of memory) and step times."""

    def measure(kept: int, mode: Mode) -> Probe:
        calls.append((kept, mode))
        return Probe(peaks.get((kept, mode), math.inf), seconds.get(mode, 1.0))

    return measure


ON_DEVICE, OFFLOADED = Mode(offload=False), Mode(offload=True)
TILED, TILED_OFFLOADED = Mode(False, "auto"), Mode(True, "auto")


def _linear_peaks(mode: Mode, base: float, per_kept: float, n: int = N_LAYERS) -> dict:
    return {(kept, mode): base + per_kept * kept for kept in range(n + 1)}


def test_choose_plan_keeps_offload_off_when_every_layer_fits_without_it():
    calls: list = []
    measure = _fake_measure(_linear_peaks(ON_DEVICE, 10, 1) | _linear_peaks(OFFLOADED, 5, 1), {}, calls)
    assert choose_plan(N_LAYERS, 20.0, 0.0, measure, [[ON_DEVICE, OFFLOADED]]) == (N_LAYERS, ON_DEVICE)
    assert {mode for _, mode in calls} == {ON_DEVICE}  # offload was never probed


@pytest.mark.parametrize("offloaded_seconds, expected", [(0.9, (3, OFFLOADED)), (1.1, (1, ON_DEVICE))])
def test_choose_plan_takes_the_faster_of_the_plans_that_fit(offloaded_seconds, expected):
    # Budget 12: on the device 10 + 1 per kept layer keeps 1 (2 would reach the headroom);
    # offloaded 7 + 1.5 per kept layer keeps 3.
    peaks = _linear_peaks(ON_DEVICE, 10, 1) | _linear_peaks(OFFLOADED, 7, 1.5)
    measure = _fake_measure(peaks, {ON_DEVICE: 1.0, OFFLOADED: offloaded_seconds}, [])
    assert choose_plan(N_LAYERS, 12.0, 0.5, measure, [[ON_DEVICE, OFFLOADED]]) == expected


def test_choose_plan_tiles_the_mlp_only_when_nothing_else_fits():
    peaks = _linear_peaks(ON_DEVICE, 30, 1) | _linear_peaks(OFFLOADED, 21, 1) | _linear_peaks(TILED_OFFLOADED, 15, 1)
    measure = _fake_measure(peaks, {}, [])
    groups = [[ON_DEVICE, OFFLOADED], [TILED, TILED_OFFLOADED]]
    assert choose_plan(N_LAYERS, 20.0, 0.0, measure, groups) == (N_LAYERS, TILED_OFFLOADED)
    assert choose_plan(N_LAYERS, 21.0, 0.0, measure, groups) == (0, OFFLOADED)
    assert choose_plan(N_LAYERS, 14.0, 0.0, measure, groups) is None


def test_fit_checkpointing_rejects_an_unknown_offload():
    with pytest.raises(ValueError, match="offload must be False, True or 'auto', got 'yes'"):
        fit_checkpointing(tiny_model("llama").train(), {}, 10.0, offload="yes")


@pytest.mark.skipif(ON_GPU, reason="the error of a model off the GPU")
def test_fit_checkpointing_needs_a_cuda_model():
    model = tiny_model("llama").train()
    with pytest.raises(ValueError, match="measure CUDA memory; the model is on cpu"):
        fit_checkpointing(model, {}, 10.0)
    with pytest.raises(ValueError, match="measure CUDA memory; the model is on cpu"):
        measure_step_peak(model, {})


@pytest.mark.parametrize("budget", [0.0, -1.0, float("inf"), float("nan")])
def test_fit_checkpointing_rejects_a_budget_that_is_not_a_positive_number(budget):
    with pytest.raises(ValueError, match=f"memory_budget_gib must be a positive number of GiB or None, got {budget}"):
        fit_checkpointing(tiny_model("llama").train(), {}, budget)


# GPU: a model whose layers' activations are large next to its weights, so plans differ by GiB-scale
# steps: 6 layers of width 1024 at batch 8 x 1024 tokens.
GPU_SHAPE = dict(num_hidden_layers=6, hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1024)


def _gpu_model(patched: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**GPU_SHAPE, attn_implementation="sdpa")).cuda().to(torch.bfloat16)
    if patched:
        apply_tigon(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def _gpu_batch(seed: int):
    tokens = torch.randint(0, GPU_SHAPE["vocab_size"], (8, 1024), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(seed))
    return {"input_ids": tokens, "labels": tokens}


def _train(model, optimizer, steps: int, batch=_gpu_batch) -> tuple[list[float], float]:
    """Losses of ``steps`` AdamW steps on fresh batches (``batch(seed)``), and the peak allocated
    memory (GiB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for step in range(steps):
        loss = model(**batch(100 + step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, torch.cuda.max_memory_allocated() / 2**30


@pytest.mark.skipif(not ON_GPU, reason="the planner measures CUDA memory")
@pytest.mark.parametrize("patched", [False, True], ids=["hf", "tigon"])
def test_a_budget_between_the_extremes_keeps_some_layers_and_holds_in_training(patched):
    model = _gpu_model(patched)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = _gpu_batch(0)
    set_checkpointing(model, 0)
    all_recomputed = measure_step_peak(model, batch, optimizer=optimizer)
    set_checkpointing(model, GPU_SHAPE["num_hidden_layers"])
    none_recomputed = measure_step_peak(model, batch, optimizer=optimizer)
    assert none_recomputed > all_recomputed + 1.0, (all_recomputed, none_recomputed)
    budget = (all_recomputed + none_recomputed) / 2
    weights = [p.detach().clone() for p in model.parameters()]
    rng = torch.cuda.get_rng_state()

    plan = fit_checkpointing(model, batch, budget, optimizer=optimizer)

    assert 0 < plan.kept < plan.n_layers, plan
    assert plan.peak_gib <= budget * 0.98, plan
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)), "probing moved a weight"
    assert not optimizer.state and optimizer.param_groups[0]["lr"] == 1e-4
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    kept = [not layer.gradient_checkpointing for layer in checkpointing_layers(model)]
    assert kept == [i >= plan.n_layers - plan.kept for i in range(plan.n_layers)]

    losses, peak = _train(model, optimizer, steps=3)
    # The error margin: training's peak is the probe's, within 1%.
    assert peak <= budget and abs(peak - plan.peak_gib) <= 0.01 * plan.peak_gib, (peak, plan)

    # The same training without probing (the plan set directly) gives the same losses.
    fresh = _gpu_model(patched)
    set_checkpointing(fresh, plan.kept)
    fresh_losses, _ = _train(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-4, fused=True), steps=3)
    # The first step sees the same weights: the same loss, bit for bit. Later steps differ by what two
    # identical bf16 runs differ by on a GPU (the embedding's backward accumulates with atomics).
    assert losses[0] == fresh_losses[0]
    assert losses == pytest.approx(fresh_losses, rel=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="the planner measures CUDA memory")
def test_a_budget_below_the_all_recomputed_peak_is_refused():
    model = _gpu_model(patched=True)
    message = (r"needs more than memory_budget_gib = 0\.10 even with all 6 layers recomputed: inputs on the device: "
               r"[\d.]+ GiB; inputs on the device, MLP tiles of auto tokens: [\d.]+ GiB$")
    with pytest.raises(ValueError, match=message):
        fit_checkpointing(model, _gpu_batch(0), 0.1)
    assert all(layer.gradient_checkpointing for layer in checkpointing_layers(model))


@pytest.mark.skipif(not ON_GPU, reason="the planner measures CUDA memory")
def test_no_budget_fits_the_all_recomputed_peak():
    """``None``: the budget is the step's own peak with every layer recomputed, measured in the same
    probing, so that plan always fits (a budget measured apart can come out a few bytes under it)."""
    model = _gpu_model(patched=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    plan = fit_checkpointing(model, _gpu_batch(0), None, optimizer=optimizer)
    assert plan.budget_gib == plan.probes[0]
    assert plan.peak_gib <= plan.budget_gib
    assert all(peak > plan.budget_gib * 0.98 for kept, peak in plan.probes.items() if kept > plan.kept), plan


@pytest.mark.skipif(not ON_GPU, reason="the planner measures CUDA memory")
def test_offload_auto_fits_a_budget_below_the_all_recomputed_peak_and_holds_in_training():
    """On a model whose layer inputs are most of a step's memory: many narrow layers, long rows, a
    small vocabulary (24 inputs of 32 MiB; one layer's recomputation holds about ten such tensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=4096, attn_implementation="sdpa")

    def model_and_optimizer():
        torch.manual_seed(0)
        model = apply_tigon(LlamaForCausalLM(config).cuda().to(torch.bfloat16).train())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def batch(seed):
        tokens = torch.randint(0, config.vocab_size, (2, 16384), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(seed))
        return {"input_ids": tokens, "labels": tokens}

    model, optimizer = model_and_optimizer()
    set_checkpointing(model, 0)
    on_device = measure_step_peak(model, batch(0), optimizer=optimizer)
    set_checkpointing(model, 0, offload=True)
    offloaded = measure_step_peak(model, batch(0), optimizer=optimizer)
    layer_input = 2 * 16384 * config.hidden_size * 2 / 2**30
    # At least half the inputs leave the device (all but the one recomputing and the one fetched).
    assert offloaded < on_device - 12 * layer_input, (offloaded, on_device)
    budget = (offloaded + on_device) / 2
    plan = fit_checkpointing(model, batch(0), budget, optimizer=optimizer, offload="auto")
    assert plan.offload and plan.host_gib > 0 and plan.peak_gib <= budget, plan
    assert plan.mlp_tile_tokens is None  # it fitted untiled

    losses, peak = _train(model, optimizer, 3, batch)
    assert peak <= budget, (peak, plan)
    del model, optimizer
    fresh, fresh_optimizer = model_and_optimizer()
    set_checkpointing(fresh, plan.kept)
    fresh_losses, _ = _train(fresh, fresh_optimizer, 3, batch)
    # The same first loss as the plan without offload, bit for bit (same weights, same batch).
    assert losses[0] == fresh_losses[0]
    assert losses == pytest.approx(fresh_losses, rel=1e-3)
