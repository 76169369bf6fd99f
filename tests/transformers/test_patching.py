"""The patching API: its three levels, what it keeps, and its errors."""

import dataclasses
import gc
import importlib
import warnings
from copy import deepcopy

import pytest
import torch
import transformers

from tigon import UntestedVersionWarning
from tigon.transformers import (
    FAMILIES,
    AutoTigonForCausalLM,
    Norm,
    apply_tigon,
    apply_tigon_to_gemma,
    apply_tigon_to_llama,
    check_transformers_version,
    layers,
    patching,
    unapply_tigon,
    unapply_tigon_to_llama,
)
from tiny_models import tiny_batch, tiny_config, tiny_model
from utils import DEVICE, relative_error

llama_module = importlib.import_module(FAMILIES["llama"].module)


def first_loss(model):
    input_ids, labels = tiny_batch()
    model.train()
    return model(input_ids=input_ids, labels=labels).loss.detach()


def test_patch_before_build_and_instance_patch_agree():
    instance = apply_tigon_to_llama(model=tiny_model("llama"))
    apply_tigon_to_llama()
    built = tiny_model("llama")
    assert type(built.model.norm) is type(instance.model.norm)
    assert type(built.model.layers[0].mlp) is type(instance.model.layers[0].mlp)
    assert torch.equal(first_loss(built), first_loss(instance))


def test_instance_patch_keeps_parameters_and_checkpoint_format(tmp_path):
    model = tiny_model("llama")
    parameters = dict(model.named_parameters())
    apply_tigon(model)
    assert all(p is parameters[name] for name, p in model.named_parameters())
    model.save_pretrained(tmp_path)
    # A patched model saves a checkpoint that plain Hugging Face loads, under its own class.
    assert transformers.AutoConfig.from_pretrained(tmp_path).architectures == ["LlamaForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(p, parameters[name].cpu()) for name, p in reloaded.named_parameters())


def test_deep_copy_of_a_patched_model_is_patched():
    # As trainers copy a policy into a reference model.
    model = apply_tigon(tiny_model("llama"))
    copy = deepcopy(model)
    assert copy.forward.__self__ is copy and isinstance(copy.model.norm, layers.TigonRMSNorm)
    assert torch.equal(first_loss(copy), first_loss(model))


def test_patching_twice_changes_nothing_more():
    model = apply_tigon(tiny_model("llama"))
    norm_class, forward = type(model.model.norm), model.forward.tigon_wraps
    apply_tigon(model)
    apply_tigon_to_llama()
    apply_tigon_to_llama()
    assert type(model.model.norm) is norm_class and model.forward.tigon_wraps is forward
    assert llama_module.LlamaRMSNorm is norm_class
    assert llama_module.LlamaForCausalLM.forward.tigon_wraps is forward
    built = apply_tigon(tiny_model("llama"))
    # One idle hook on lm_head, however often the model and its module were patched.
    assert len(built.lm_head._forward_pre_hooks) == 1 and len(model.lm_head._forward_pre_hooks) == 1


def test_flags_switch_patches_off():
    model = apply_tigon(tiny_model("llama"), rope=False, swiglu=False, fused_linear_cross_entropy=False)
    assert isinstance(model.model.norm, layers.TigonRMSNorm)
    assert not isinstance(model.model.layers[0].mlp, layers.TigonMLP)
    assert llama_module.apply_rotary_pos_emb is not layers.apply_rotary_pos_emb
    assert not hasattr(model.forward, "tigon_wraps")


def test_auto_model_loads_and_patches(tmp_path):
    plain = tiny_model("llama")
    truth = first_loss(plain)
    plain.save_pretrained(tmp_path)
    model = AutoTigonForCausalLM.from_pretrained(tmp_path, swiglu=False).to(DEVICE)
    assert isinstance(model.model.norm, layers.TigonRMSNorm)
    assert not isinstance(model.model.layers[0].mlp, layers.TigonMLP)
    assert relative_error(first_loss(model), truth) <= 1e-5


def test_bf16_model():
    truth = first_loss(tiny_model("gemma2").to(torch.bfloat16))
    model = apply_tigon(tiny_model("gemma2").to(torch.bfloat16))
    loss = first_loss(model)
    assert loss.dtype == torch.float32
    # Hugging Face rounds each intermediate to bf16; tigon rounds once per kernel.
    assert relative_error(loss, truth) <= 1e-2


def test_peft_lora_model():
    peft = pytest.importorskip("peft")
    input_ids, labels = tiny_batch()
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], init_lora_weights=False
    )

    def lora_model():
        torch.manual_seed(0)
        return peft.get_peft_model(tiny_model("llama"), lora)

    def loss_and_lora_grads(model):
        model.train()
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    truth, truth_grads = loss_and_lora_grads(lora_model())
    model = apply_tigon(lora_model())
    assert isinstance(model.get_base_model().model.layers[0].mlp, layers.TigonMLP)
    loss, grads = loss_and_lora_grads(model)
    assert relative_error(loss, truth) <= 1e-5
    assert grads.keys() == truth_grads.keys() and grads
    for name, grad in truth_grads.items():
        assert relative_error(grads[name], grad) <= 1e-5, f"grad of {name}"


def test_unsupported_model_type_lists_the_supported():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)
    with pytest.raises(ValueError, match="does not support model_type 'gpt2'.*gemma.*llama.*qwen3_moe"):
        apply_tigon(transformers.GPT2LMHeadModel(config))


def test_unknown_flag_is_refused():
    with pytest.raises(TypeError, match="no flag 'sdpa'; the flags are rope, rms_norm, "):
        apply_tigon(tiny_model("gemma"), sdpa=False)


def test_misspelt_flag_names_the_closest(tmp_path):
    with pytest.raises(TypeError, match="no flag 'swigluu'; did you mean 'swiglu'"):
        apply_tigon(tiny_model("llama"), swigluu=False)
    tiny_model("llama").save_pretrained(tmp_path)
    # Refused before transformers sees it (it would take it for a config attribute).
    with pytest.raises(TypeError, match="'swigluu' is not a tigon flag; did you mean 'swiglu'"):
        AutoTigonForCausalLM.from_pretrained(tmp_path, swigluu=False)


@pytest.mark.parametrize("value", ["yes", 0, None])
def test_flag_that_is_not_a_bool_is_refused(value):
    with pytest.raises(TypeError, match=f"apply_tigon: rope must be True or False, got {value!r}"):
        apply_tigon(tiny_model("llama"), rope=value)
    with pytest.raises(TypeError, match="apply_tigon_to_llama: swiglu must be True or False"):
        apply_tigon_to_llama(swiglu=value)


def test_patcher_flags_are_keyword_only():
    with pytest.raises(TypeError, match="apply_tigon_to_llama takes keyword arguments only"):
        apply_tigon_to_llama(False)


def test_what_is_not_a_hugging_face_model_is_refused():
    with pytest.raises(TypeError, match="must be a Hugging Face PreTrainedModel .*got torch.nn.modules.linear.Linear"):
        apply_tigon(torch.nn.Linear(3, 3))


def test_model_of_another_family_is_refused():
    with pytest.raises(ValueError, match="model_type 'llama', not 'gemma'"):
        apply_tigon_to_gemma(model=tiny_model("llama"))


def test_both_losses_are_refused():
    with pytest.raises(ValueError, match="at most one of cross_entropy=True and fused_linear_cross_entropy=True"):
        apply_tigon_to_llama(cross_entropy=True)


def test_activation_the_kernel_does_not_compute_is_refused():
    refused = "LlamaMLP uses GELUActivation: patch with swiglu=False"
    model = tiny_model("llama", hidden_act="gelu")
    with pytest.raises(ValueError, match=refused):
        apply_tigon(model)
    # Refused as a whole: no layer was patched.
    assert not any(hasattr(type(module), "tigon_replaces") for module in model.modules())
    apply_tigon_to_llama()
    with pytest.raises(ValueError, match=refused):
        transformers.LlamaForCausalLM(tiny_config("llama", hidden_act="gelu"))


def test_class_missing_in_transformers_is_left_unpatched_with_a_warning():
    renamed = dataclasses.replace(FAMILIES["llama"], norms=(Norm("LlamaRMSNormV2"),))
    flags = dict.fromkeys(patching.LAYER_FLAGS, True)
    warning = (
        f"'llama' models keep Hugging Face's norm class \\(LlamaRMSNormV2\\): transformers {transformers.__version__} "
        "has no LlamaRMSNormV2 in transformers.models.llama.modeling_llama .*pass rms_norm=False"
    )
    with pytest.warns(patching.MissingInTransformersWarning, match=warning):
        model = patching.apply_family(
            renamed, cross_entropy=False, fused_linear_cross_entropy=True, lora=True, model=tiny_model("llama"), **flags
        )
    # The rest of the row is patched.
    assert type(model.model.norm) is llama_module.LlamaRMSNorm
    assert isinstance(model.model.layers[0].mlp, layers.TigonMLP)
    assert hasattr(model.forward, "tigon_wraps")


def test_rotary_function_of_another_signature_is_left_unpatched_with_a_warning(monkeypatch):
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        raise AssertionError("not called: the test only patches")

    monkeypatch.setattr(llama_module, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    with pytest.warns(
        patching.MissingInTransformersWarning,
        match=r"rotary function \(apply_rotary_pos_emb\), as tigon's takes \(q, k, cos, sin, unsqueeze_dim\): "
        r".* declares .*apply_rotary_pos_emb\(q, k, cos, sin, position_ids, unsqueeze_dim\)",
    ):
        model = apply_tigon(tiny_model("llama"))
    assert llama_module.apply_rotary_pos_emb is apply_rotary_pos_emb
    assert isinstance(model.model.norm, layers.TigonRMSNorm)


def test_head_forward_without_labels_keeps_its_loss_with_a_warning(monkeypatch):
    def forward(self, input_ids=None):
        raise AssertionError("not called: the test only patches")

    monkeypatch.setattr(llama_module.LlamaForCausalLM, "forward", forward)
    with pytest.warns(
        patching.MissingInTransformersWarning,
        match=r"'llama' models keep Hugging Face's loss: .* declares .*forward\(self, input_ids=None\), without labels "
        r"or \*\*kwargs .*pass fused_linear_cross_entropy=False",
    ):
        model = apply_tigon(tiny_model("llama"))
    assert "forward" not in vars(model) and isinstance(model.model.norm, layers.TigonRMSNorm)


def test_family_newer_than_transformers_is_said_and_changes_nothing():
    newer = dataclasses.replace(FAMILIES["llama"], model_type="llama9", module="transformers.models.llama9.modeling_llama9")
    flags = dict.fromkeys(patching.LAYER_FLAGS, True)
    with pytest.warns(patching.MissingInTransformersWarning, match="'llama9' models .* has no transformers.models.llama9"):
        patching.apply_family(newer, cross_entropy=False, fused_linear_cross_entropy=True, lora=True, **flags)
    assert "llama9" not in patching._MODULE_PATCHES


@pytest.mark.parametrize("version, form", [("5.6.0", "glm"), ("5.16.2", "glm"), ("5.17.0", "glm4v"), ("5.24.0", "glm4v")])
def test_rotary_function_computed_otherwise_by_an_older_transformers_gets_its_form(version, form):
    # GLM-4V's apply_rotary_pos_emb took one angle per pair, as GLM-4's, up to 5.16.
    assert patching.rope_drop_in(FAMILIES["glm4v"].ropes[0], version) is layers.ROPE_FORMS[form]


@pytest.mark.parametrize("version", ["5.6.0", "5.17.0", "5.24.0", "5.24.1"])
def test_tested_transformers_versions_are_accepted_quietly(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.25.0", "5.25.0.dev0", "6.0.0"])
def test_transformers_newer_than_tested_is_used_with_a_warning(version):
    with pytest.warns(UntestedVersionWarning, match=f"tested with transformers 5.6 to 5.24, and transformers {version} is"):
        check_transformers_version(version)


@pytest.mark.parametrize("version", ["4.57.1", "5.5.4"])
def test_transformers_older_than_tested_is_refused(version):
    with pytest.raises(ImportError, match=f"needs transformers 5.6 or newer .*, but transformers {version} is installed"):
        check_transformers_version(version)


def model_state(model):
    """Each module's class and instance attributes (hooks included), and the model's parameters."""
    modules = {name: (type(m), set(vars(m)), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}
    return modules, {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_state(model, state):
    modules, parameters = model_state(model)
    assert modules == state[0]
    assert parameters.keys() == state[1].keys()
    assert all(torch.equal(p, state[1][name]) for name, p in parameters.items())


def test_unapply_restores_the_model():
    truth = first_loss(tiny_model("llama"))
    model = tiny_model("llama")
    before = model_state(model)
    apply_tigon(model)
    assert type(model.model.layers[0].self_attn).tigon_replaces is llama_module.LlamaAttention
    assert unapply_tigon(model) is model
    assert_same_state(model, before)
    assert torch.equal(first_loss(model), truth)


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_instance_patch_leaves_other_models_alone(model_type):
    # A model never patched, of the family of a patched one, stays Hugging Face's: in fp32 bit for
    # bit, and in fp64, which tigon's kernels refuse.
    module = importlib.import_module(FAMILIES[model_type].module)
    names = dict(vars(module))
    truth = first_loss(tiny_model(model_type))
    patched = apply_tigon(tiny_model(model_type))
    assert vars(module) == names
    assert torch.equal(first_loss(tiny_model(model_type)), truth)
    assert torch.isfinite(first_loss(tiny_model(model_type).double()))
    assert relative_error(first_loss(patched), truth) < 1e-5


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_instance_patch_calls_tigons_rotary_function_in_each_attention_layer(compiled):
    # Compiled too: dynamo reads a function's globals from the module they name, if they name one.
    model = apply_tigon(tiny_model("llama"))
    if compiled:
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="eager")
    tigon_rope, calls = layers.ROPE_FORMS["rotate_half"], []
    scope, _ = patching.rotary_globals(llama_module, (("apply_rotary_pos_emb", tigon_rope),))
    assert scope is not vars(llama_module) and scope["apply_rotary_pos_emb"] is tigon_rope
    try:
        scope["apply_rotary_pos_emb"] = lambda *args: calls.append(1) or tigon_rope(*args)
        first_loss(model)
    finally:
        scope["apply_rotary_pos_emb"] = tigon_rope
    assert len(calls) == len(model.model.layers)


def test_unapply_restores_peft_for_every_model():
    peft = pytest.importorskip("peft")
    from peft.tuners.lora.layer import Linear as LoraLinear

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_forward = LoraLinear.forward
    first = apply_tigon(peft.get_peft_model(tiny_model("llama"), lora))
    second = apply_tigon(peft.get_peft_model(tiny_model("llama"), lora))
    assert LoraLinear.forward.tigon_wraps is peft_forward
    unapply_tigon(first)
    assert LoraLinear.forward.tigon_wraps is peft_forward
    unapply_tigon(second)
    assert LoraLinear.forward is peft_forward
    assert not any(hasattr(type(m), "tigon_replaces") for m in second.modules())


def test_unapply_restores_the_experts_implementation():
    model = tiny_model("qwen3_moe")
    implementation = model.config._experts_implementation
    before = model_state(model)
    apply_tigon(model)
    assert model.config._experts_implementation == "tigon"
    unapply_tigon(model)
    assert model.config._experts_implementation == implementation
    assert_same_state(model, before)


def test_unapply_of_a_module_patch_restores_the_module():
    gc.collect()
    # A Llama built first: transformers caches a class attribute the first time one is built
    # (_can_set_experts_implementation_cached_value), which is not a patch.
    truth = first_loss(tiny_model("llama"))
    names, head_methods = dict(vars(llama_module)), dict(vars(llama_module.LlamaForCausalLM))
    apply_tigon_to_llama(lora=False)
    built = tiny_model("llama")
    assert isinstance(built.model.norm, layers.TigonRMSNorm)
    unapply_tigon_to_llama()
    assert {k: v for k, v in vars(llama_module).items() if k != "apply_rotary_pos_emb"} == {
        k: v for k, v in names.items() if k != "apply_rotary_pos_emb"
    }
    assert dict(vars(llama_module.LlamaForCausalLM)) == head_methods
    # The model built meanwhile keeps tigon until it is unapplied, then is Hugging Face's again.
    assert isinstance(built.model.norm, layers.TigonRMSNorm)
    unapply_tigon(built)
    assert vars(llama_module) == names
    assert type(built.model.norm) is llama_module.LlamaRMSNorm
    assert torch.equal(first_loss(built), truth)
    assert torch.equal(first_loss(tiny_model("llama")), truth)
