"""tigon on a model trained in FP8 by torchao (``convert_to_float8_training``): either order
(tigon patched before the conversion, or after), each of torchao's recipes, under gradient
checkpointing, and with PEFT LoRA over the converted layers.

What must hold: every FP8 matmul of torchao's own run still runs (``torch._scaled_mm`` is counted
per training step: the decoder's linears are torchao's ``Float8Linear`` layers, whose operands
tigon's kernels cast where torchao's would be (tensorwise, not compiled), and the converted
``lm_head``'s three matmuls are the fused loss's, in FP8 by the head's recipe: the head's own
forward, whose logits would be dropped, does not run); and the losses of a few AdamW steps equal
torchao's alone within the noise of FP8 rounding (the fused loss's chunked scaling and bf16 logits
against torchao's whole-tensor scaling and fp32 upcast).
"""

import pytest
import torch

pytest.importorskip("torchao.float8")
from peft import LoraConfig, get_peft_model  # noqa: E402
from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8 import float8_linear, float8_scaling_utils  # noqa: E402
from torchao.float8.config import ScalingType  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402

from torch._dynamo.utils import counters  # noqa: E402

from tigon.ops import gated  # noqa: E402
from tigon.transformers import apply_tigon, float8, layers  # noqa: E402
from tiny_models import tiny_batch, tiny_model  # noqa: E402
from utils import DEVICE  # noqa: E402

STEPS = 3
# FP8 rounding moves the losses by ~1e-4 relative here; 2e-3 stays far below a lost FP8 matmul
# (a bf16 head moves them by about as much) and far above bf16's own noise.
LOSS_TOLERANCE = 2e-3


def float8_model(order: str, recipe: str, lora: bool = False):
    """The tiny Llama in bf16 under non-reentrant checkpointing, converted by torchao's ``recipe``,
    patched by tigon before (``"tigon_first"``) or after (``"float8_first"``) or not (``"torchao"``)."""
    model = tiny_model("llama").to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if order == "tigon_first":
        apply_tigon(model)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    if order == "float8_first":
        apply_tigon(model)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    return model.train()


def train(model, calls) -> tuple[list[float], list[int]]:
    """``STEPS`` AdamW steps on the tiny batch: each step's loss and its ``_scaled_mm`` calls."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    input_ids, labels = tiny_batch()
    losses, per_step = [], []
    for _ in range(STEPS):
        before = len(calls)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        per_step.append(len(calls) - before)
    return losses, per_step


def input_types(projections) -> list[str]:
    """The type names of the inputs ``projections`` are called with, appended as they run."""
    types = []
    for projection in projections:
        projection.register_forward_pre_hook(lambda module, args: types.append(type(args[0]).__name__))
    return types


def torchao_casts(monkeypatch, width: int | None, roles: tuple[str, ...]) -> list[str]:
    """The roles of torchao's dynamic casts of tensors ``width`` wide (any, with ``None``) in one
    of ``roles``, appended as they run."""
    casts = []

    def recorded_cast(hp_tensor, *args, gemm_input_role, **kwargs):
        if width in (None, hp_tensor.shape[-1]) and gemm_input_role.value in roles:
            casts.append(gemm_input_role.value)
        return hp_tensor_to_float8_dynamic(hp_tensor, *args, gemm_input_role=gemm_input_role, **kwargs)

    # torchao's linear and tigon's down projection (which imports it where it casts).
    monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", recorded_cast)
    monkeypatch.setattr(float8_scaling_utils, "hp_tensor_to_float8_dynamic", recorded_cast)
    return casts


# Each recipe once, the orders alternating (either order gives the same model: a test of both
# orders is one of each recipe's).
@pytest.mark.parametrize(("recipe", "order"), [
    ("tensorwise", "tigon_first"), ("rowwise", "float8_first"), ("rowwise_with_gw_hp", "tigon_first"),
    ("rowwise", "tigon_first"),
])
def test_every_fp8_matmul_is_kept_and_the_losses_match_torchao(recipe, order, scaled_mm_calls):
    torchao_losses, torchao_calls = train(float8_model("torchao", recipe), scaled_mm_calls)
    model = float8_model(order, recipe)
    projection_inputs = input_types(
        p for layer in model.model.layers for p in (layer.self_attn.q_proj, layer.mlp.gate_proj, layer.mlp.down_proj))
    losses, calls = train(model, scaled_mm_calls)
    # Every linear is torchao's Float8Linear, with tigon's forward (either order).
    assert {type(module).__name__ for module in model.modules() if isinstance(module, float8_linear.Float8Linear)} == {
        "TigonFloat8Linear"}
    # The norms and the gate cast the projections' inputs where their recipe scales them per tensor.
    assert set(projection_inputs) == {"Float8TrainingTensor" if recipe == "tensorwise" else "Tensor"}
    # The head's three matmuls are the fused loss's (one chunk here): the head's own forward, whose
    # logits are dropped, does not run.
    assert calls == torchao_calls, (calls, torchao_calls)
    for ours, theirs in zip(losses, torchao_losses):
        assert abs(ours - theirs) <= LOSS_TOLERANCE * abs(theirs), (losses, torchao_losses)


def test_lora_over_float8_layers_keeps_their_fp8_matmuls(scaled_mm_calls):
    torchao_losses, torchao_calls = train(float8_model("torchao", "rowwise", lora=True), scaled_mm_calls)
    losses, calls = train(float8_model("float8_first", "rowwise", lora=True), scaled_mm_calls)
    # The frozen head: the fused loss skips its weight gradient's matmul, which torchao computes
    # anyway.
    assert calls == [count - 1 for count in torchao_calls], (calls, torchao_calls)
    for ours, theirs in zip(losses, torchao_losses):
        assert abs(ours - theirs) <= LOSS_TOLERANCE * abs(theirs)


def test_the_gate_casts_the_down_projections_input_and_the_projections_gradients(monkeypatch):
    # With one scale per tensor (tensorwise), the gate's kernels cast to FP8 themselves what
    # torchao would cast next to them: their product (the down projection's input) and their
    # gradients (the gate and up projections' output gradients). torchao takes those as cast, and
    # they are the same bytes as its own casts, so the losses are the same, bit for bit. (A
    # rowwise recipe, scaled per row and per column, stays torchao's to cast: the recipes' test.)
    # tigon's casts of the linears' operands are off: torchao casts what the gate leaves.
    monkeypatch.setattr(float8, "tigon_casts_apply", lambda linear, x: False)
    casts = torchao_casts(monkeypatch, tiny_model("llama").config.intermediate_size, ("input", "grad_output"))
    model = float8_model("float8_first", "tensorwise")
    inputs = input_types(layer.mlp.down_proj for layer in model.model.layers)
    losses, _ = train(model, [])
    assert set(inputs) == {"Float8TrainingTensor"}
    assert casts == []
    monkeypatch.setattr(layers.TigonMLP, "_float8_casts", staticmethod(lambda *args: (None, None)))
    unfused_losses, _ = train(float8_model("float8_first", "tensorwise"), [])
    # Unfused, torchao casts the down projection's input (in forward, and again in backward) and
    # both projections' output gradients (twice each: one copy per matmul).
    assert sorted(set(casts)) == ["grad_output", "input"]
    assert losses == unfused_losses


def test_the_norms_cast_their_outputs_for_the_projections_that_read_them(monkeypatch):
    # Tensorwise, a decoder layer's two norms cast their outputs to FP8 in their kernels, once for
    # all the projections that read them (q, k, v; gate, up): the bytes torchao casts from the
    # 16-bit output (tests/ops/test_rms_norm.py), and torchao casts none of them. A projection of
    # another kind (a LoRA adapter's) leaves its norm's output in 16 bits. (The recipes' test
    # sees the casts in the other order.) tigon's casts of the linears' other operands are off:
    # torchao casts them, and the output projection's input is counted.
    monkeypatch.setattr(float8, "tigon_casts_apply", lambda linear, x: False)
    casts = torchao_casts(monkeypatch, tiny_model("llama").config.hidden_size, ("input",))
    model = float8_model("float8_first", "tensorwise")
    inputs = input_types(
        p for layer in model.model.layers for p in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj))
    losses, _ = train(model, [])
    assert set(inputs) == {"Float8TrainingTensor"}
    # Of width H, torchao casts only the output projection's input, once a layer in forward and once
    # in its backward, in each of the forward's two runs (checkpointing recomputes it).
    assert len(casts) == 3 * STEPS * len(model.model.layers)
    lora_model = float8_model("float8_first", "tensorwise", lora=True)
    lora_inputs = input_types(
        p for layer in lora_model.base_model.model.model.layers for p in (layer.self_attn.k_proj, layer.mlp.up_proj))
    train(lora_model, [])
    # q and v carry adapters: their norm's output stays 16-bit; the MLP's is cast.
    assert set(zip(lora_inputs[::2], lora_inputs[1::2])) == {("Tensor", "Float8TrainingTensor")}
    monkeypatch.setattr(layers.TigonRMSNorm, "_float8_output_cast", lambda norm, x: None)
    unfused_losses, _ = train(float8_model("float8_first", "tensorwise"), [])
    for ours, theirs in zip(losses, unfused_losses):
        assert abs(ours - theirs) <= LOSS_TOLERANCE * abs(theirs), (losses, unfused_losses)


@pytest.mark.parametrize("lora", [False, True])
def test_tigon_casts_the_linears_operands_to_torchaos_bits(monkeypatch, scaled_mm_calls, lora):
    # Not compiled and tensorwise, every Float8Linear casts its operands by tigon's kernels (torchao
    # casts none), in the same bytes and scales as torchao's casts, through the same FP8 matmuls:
    # the losses are torchao's own, bit for bit. (The recipes' test sees the other order's layers
    # take tigon's forward.) Under LoRA, a frozen base layer skips its weight gradient's matmul,
    # which torchao computes and drops.
    casts = torchao_casts(monkeypatch, None, ("input", "weight", "grad_output"))
    losses, calls = train(float8_model("float8_first", "tensorwise", lora), scaled_mm_calls)
    assert casts == []
    monkeypatch.setattr(float8, "tigon_casts_apply", lambda linear, x: False)
    torchaos_losses, torchaos_calls = train(float8_model("float8_first", "tensorwise", lora), scaled_mm_calls)
    assert casts
    assert losses == torchaos_losses
    fewer = all(ours < theirs for ours, theirs in zip(calls, torchaos_calls))
    assert fewer if lora else calls == torchaos_calls, (calls, torchaos_calls)


def test_a_heads_own_forward_is_kept_and_skipped_in_training():
    # A forward set on the head itself (a hook's, such as accelerate's) is not run for the logits
    # tigon's loss drops, and is the head's again afterwards: evaluation calls it.
    model = float8_model("float8_first", "tensorwise")
    calls = []
    class_forward = model.lm_head.forward

    def hooked_forward(input):
        calls.append(input.shape)
        return class_forward(input)

    model.lm_head.forward = hooked_forward
    train(model, [])
    assert model.lm_head.forward is hooked_forward and not calls
    input_ids, _ = tiny_batch()
    model.eval()(input_ids=input_ids)
    assert len(calls) == 1


def test_a_head_of_another_float8_config_is_refused():
    model = tiny_model("llama").to(torch.bfloat16)
    apply_tigon(model)
    config = Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=torch.float8_e4m3fn))
    convert_to_float8_training(model, config=config)
    input_ids, labels = tiny_batch()
    with pytest.raises(ValueError, match="none of the recipes tigon's fused loss computes in FP8"):
        model(input_ids=input_ids, labels=labels)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_compiled_decoder_layers_train_as_eager_ones(monkeypatch, recipe):
    # torch.compile over each decoder layer, as torchtitan trains FP8 (torchao's casts are fused
    # only so), in one graph per layer. Its trace refuses a backward that writes into a view made
    # inside a custom Function, as torchao's outputs are: compiled, the gate's inputs are copied
    # first, and its backward still writes the gradients over them (rowwise). Where the gate casts
    # its gradients to FP8 (tensorwise), they are new tensors and nothing is copied. aot_eager
    # runs the traced graphs without Inductor's code generation: the same math as eager.
    eager_losses, _ = train(float8_model("tigon_first", recipe), [])
    launches = []
    launch_bwd = gated._launch_bwd

    def recording_launch(dout, gate, up, d_gate, d_up, *args, output="store", **kwargs):
        launches.append("fp8" if output != "store" else "in place" if d_gate is gate and d_up is up else "new")
        return launch_bwd(dout, gate, up, d_gate, d_up, *args, output=output, **kwargs)

    monkeypatch.setattr(gated, "_launch_bwd", recording_launch)
    torch._dynamo.reset()
    counters.clear()
    model = float8_model("tigon_first", recipe)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    losses, _ = train(model, [])
    assert losses == pytest.approx(eager_losses, rel=1e-4)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert set(launches) == {"fp8" if recipe == "tensorwise" else "in place"}, launches


def test_the_gate_casts_for_one_fp8_dtype_and_one_scale_only():
    # The gate casts an operand of a Float8Linear only where both matmuls taking it want one FP8
    # dtype with one dynamic scale for the whole tensor (tensorwise).
    def converted(config):
        return convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False)), config=config)[0]

    tensorwise = converted(Float8LinearConfig.from_recipe_name("tensorwise"))
    assert float8.float8_cast(tensorwise, "input").dtype == torch.float8_e4m3fn
    assert float8.float8_cast(tensorwise, "grad_output").dtype == torch.float8_e5m2
    rowwise = converted(Float8LinearConfig.from_recipe_name("rowwise"))
    assert float8.float8_cast(rowwise, "input") is None and float8.float8_cast(rowwise, "grad_output") is None
    # The weight gradient's matmul in high precision: its operands are not cast at all.
    high_precision_grad_weight = converted(Float8LinearConfig(
        cast_config_input_for_grad_weight=CastConfig(scaling_type=ScalingType.DISABLED),
        cast_config_grad_output_for_grad_weight=CastConfig(scaling_type=ScalingType.DISABLED),
    ))
    assert float8.float8_cast(high_precision_grad_weight, "input") is None
    assert float8.float8_cast(high_precision_grad_weight, "grad_output") is None
    assert float8.float8_cast(torch.nn.Linear(32, 32), "input") is None


@pytest.mark.parametrize(("recipe", "cast_input", "tigon_casts"), [
    ("tensorwise", True, True), ("tensorwise", False, True), ("tensorwise", True, False),
    ("rowwise", False, False), ("rowwise_with_gw_hp", False, False),
])
def test_the_down_projection_computes_its_weight_gradient_first_to_torchaos_bits(
    monkeypatch, recipe, cast_input, tigon_casts,
):
    # The down projection's backward computes the weight gradient before the input's (whose
    # tensor is the widest of the MLP's backward), from the same casts as torchao's (a tensorwise
    # output gradient cast once for both), made by tigon's kernels (tensorwise, not compiled) or
    # by torchao's: the gradients are torchao's own, bit for bit, whether the input arrives cast
    # to FP8 (the gate's product, tensorwise) or in 16 bits.
    if not tigon_casts:
        monkeypatch.setattr(float8, "tigon_casts_apply", lambda linear, x: False)
    linear = convert_to_float8_training(
        torch.nn.Sequential(torch.nn.Linear(96, 48, bias=False)), config=Float8LinearConfig.from_recipe_name(recipe),
    )[0].to(DEVICE, torch.bfloat16)
    # Every size a multiple of 16, as the GPU's FP8 matmuls want.
    x = torch.randn(2, 40, 96, dtype=torch.bfloat16, device=DEVICE)
    grad_output = torch.randn(2, 40, 48, dtype=torch.bfloat16, device=DEVICE)
    matmuls = []
    scaled_mm = torch._scaled_mm

    def recorded_scaled_mm(a, b, *args, **kwargs):
        matmuls.append((tuple(a.shape), tuple(b.shape)))
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recorded_scaled_mm)

    def gradients(projection):
        linear.weight.grad = None
        x_leaf = x.clone().requires_grad_()
        if cast_input:
            x_in = hp_tensor_to_float8_dynamic(x_leaf, torch.float8_e4m3fn, linear.linear_mm_config)
        else:
            x_in = x_leaf
        output = projection(linear, x_in)
        output.backward(grad_output)
        return output, x_leaf.grad, linear.weight.grad

    theirs = gradients(lambda module, x_in: module(x_in))
    del matmuls[:]
    casts = torchao_casts(monkeypatch, None, ("input", "weight", "grad_output"))
    ours = gradients(float8.float8_down_projection)
    assert bool(casts) != tigon_casts, casts
    for mine, torchaos in zip(ours, theirs):
        assert torch.equal(mine, torchaos)
    # Forward; then the weight gradient ([out, tokens] @ [tokens, in], in bf16 where the recipe
    # says so), then the input's.
    weight_gradient = [] if recipe == "rowwise_with_gw_hp" else [((48, 80), (80, 96))]
    assert matmuls == [((80, 96), (96, 48)), *weight_gradient, ((80, 48), (48, 96))], matmuls
    # A hooked projection (an FSDP2 shard's) is called as a module, its hooks and all.
    calls = []
    linear.register_forward_pre_hook(lambda module, args: calls.append(module))
    assert torch.equal(gradients(float8.float8_down_projection)[2], theirs[2]) and calls == [linear]
