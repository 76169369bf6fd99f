"""tigon as transformers' experts implementation "tigon": the MoE families' experts by the fused
kernel, through apply_tigon or set on the config, computing what transformers' grouped_mm does."""

import functools
import inspect

import pytest
import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers.integrations.moe import use_experts_implementation

from tigon.transformers import FAMILIES, apply_tigon, apply_tigon_to_mixtral, moe, patching
from tiny_family_models import tiny_family_batch, tiny_family_model
from tiny_models import TINY, tiny_batch, tiny_model
from utils import assert_ill_conditioned, graph_functions, hugging_face_as, hugging_face_original, relative_error

# fp32: the loss and every gradient within TIGHT of transformers' grouped_mm (a gradient that is
# zero, as an expert no token chose, compared absolutely).
TIGHT = 1e-5
KERNEL = "MoEExpertsFunctionBackward"  # the node of tigon's experts in the autograd graph
# Gemma 4's MoE block (off in the tiny family model): the tanh-GELU experts, "geglu".
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
# model_type -> options of its tiny model: SiLU experts ([E, 2I, H], a router without bias), GPT-OSS's
# (transposed, interleaved, biased, clamped SwiGLU) and Gemma 4's.
FAMILY_OPTIONS = {"qwen3_moe": {}, "mixtral": {}, "gpt_oss": {}, "deepseek_v3": {}, "gemma4_text": GEMMA4_MOE}
# GPT-OSS's pre-activations in the tiny model never reach its clamp (limit 7): a small limit and
# another alpha, set on the experts of both models, make them count (and must be the module's).
EXPERTS_ATTRIBUTES = {"gpt_oss": dict(alpha=1.5, limit=0.05)}


def build(model_type, **options):
    """A fresh fp32 model of the family with its seed-0 weights."""
    return tiny_model(model_type, **options) if model_type in TINY else tiny_family_model(model_type, **options)


def batch_of(model_type):
    if model_type in TINY:
        input_ids, labels = tiny_batch()
        return dict(input_ids=input_ids, labels=labels)
    return tiny_family_batch(model_type)


def loss_and_grads(model, batch):
    """One training step's loss, its graph's functions and the gradient of every parameter that gets one."""
    model.train()
    loss = model(**batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), graph_functions(loss), grads


def assert_matches(run, truth, exact=None):
    """Loss and gradients within TIGHT of the truth's; with ``exact`` (→ an fp64 step's gradients),
    an ill-conditioned gradient may instead be as close to fp64's as the truth's is (the families'
    rule, utils.assert_ill_conditioned)."""
    (loss, _, grads), (truth_loss, _, truth_grads) = run, truth
    assert relative_error(loss, truth_loss) <= TIGHT, "loss"
    assert grads.keys() == truth_grads.keys() and grads
    for name, grad in truth_grads.items():
        error = relative_error(grads[name], grad)
        if error <= TIGHT:
            continue
        assert exact is not None, f"grad of {name}: {error:.3g}"
        assert_ill_conditioned(f"grad of {name}", grads[name], grad, exact()[name])


def experts_modules(model):
    return [module for module in model.modules() if hasattr(module, "is_transposed")]


def set_experts(model, model_type, implementation=None):
    """``model`` with its experts' family attributes (EXPERTS_ATTRIBUTES) and, if given, their
    ``experts_implementation``."""
    for experts in experts_modules(model):
        if implementation is not None:
            experts.config._experts_implementation = implementation
        for name, value in EXPERTS_ATTRIBUTES.get(model_type, {}).items():
            setattr(experts, name, value)
    return model


def experts_implementations(model):
    return {experts.config._experts_implementation for experts in experts_modules(model)}


@pytest.mark.parametrize("model_type", sorted(FAMILY_OPTIONS))
def test_patched_experts_match_eager(model_type):
    """Both models patched alike but for the experts, which the truth runs through transformers'
    eager loop (one fp32 matmul per expert, its reference): the comparison is of the experts alone
    (the families' tests compare the rest with Hugging Face's, by their own rules on the GPU).
    On the H100 the fp32 eager loop itself is 1e-3 from fp64 in GPT-OSS's embedding gradient (7e-4
    for the kernel): such a gradient is compared with an fp64 step's by the families' rule."""
    options = FAMILY_OPTIONS[model_type]
    unpatched = hugging_face_original()

    @functools.cache
    def exact():
        with hugging_face_as(unpatched):
            model = set_experts(build(model_type, **options).double(), model_type, "eager")
            return loss_and_grads(model, batch)[2]

    plain = build(model_type, **options)
    patched = build(model_type, **options)
    patched.load_state_dict(plain.state_dict())
    batch = batch_of(model_type)
    apply_tigon(plain, experts=False)
    assert experts_implementations(plain) == {"grouped_mm"}
    set_experts(plain, model_type, "eager")
    apply_tigon(patched)
    assert experts_implementations(patched) == {"tigon"}
    set_experts(patched, model_type)
    truth, run = loss_and_grads(plain, batch), loss_and_grads(patched, batch)
    assert KERNEL in run[1] and KERNEL not in truth[1]
    # The routing weights carry the loss's gradient back into the router.
    routers = [name for name in truth[2] if ".router." in name or ".gate.weight" in name]
    assert routers and all(truth[2][name].norm() > 0 for name in routers)
    assert_matches(run, truth, exact)


# Experts classes of the table's modules that the kernel does not compute: DeepSeek V4's gate
# clamps gate and up before SiLU.
NOT_COMPUTED = {"DeepseekV4Experts"}


def test_every_experts_class_is_in_the_table_with_a_gate_the_kernel_computes():
    for family in FAMILIES.values():
        module = patching.modeling_module(family)
        if module is None:  # a family newer than the installed transformers
            continue
        # use_experts_implementation gives the classes it decorates an _apply_gate.
        decorated = {
            name for name, value in vars(module).items()
            if isinstance(value, type) and value.__module__ == module.__name__ and hasattr(value, "_apply_gate")
        }
        # Each row's class under its name in this transformers: the current one or a former one.
        names = [next(name for name in (row.name, *row.former_names) if hasattr(module, name)) for row in family.experts]
        assert set(names) == decorated - NOT_COMPUTED, family.model_type
        for name in names:
            gate = getattr(module, name)._apply_gate
            assert gate is moe._default_apply_gate or moe._qualified_name(gate) in moe.CLAMPED_GATES, name


# transformers 5.6 takes at load only its own experts implementations; 5.7 and newer also those
# registered, as importing tigon.transformers registers "tigon".
@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.7"),
    reason=f"transformers {transformers.__version__} loads no registered experts implementation",
)
def test_experts_implementation_loaded_by_name(tmp_path):
    plain = build("qwen3_moe")
    batch = batch_of("qwen3_moe")
    truth = loss_and_grads(plain, batch)
    plain.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="tigon")
    loaded.to(next(plain.parameters()).device)
    assert experts_implementations(loaded) == {"tigon"}
    run = loss_and_grads(loaded, batch)
    assert KERNEL in run[1]
    assert_matches(run, truth)


def test_experts_implementation_set_on_a_built_model_config():
    batch = batch_of("qwen3_moe")
    truth = loss_and_grads(build("qwen3_moe"), batch)
    model = build("qwen3_moe")
    model.config._experts_implementation = "tigon"
    run = loss_and_grads(model, batch)
    assert KERNEL in run[1]
    assert_matches(run, truth)


def test_experts_flag_off_keeps_grouped_mm():
    model = apply_tigon(build("qwen3_moe"), experts=False)
    assert experts_implementations(model) == {"grouped_mm"}
    assert KERNEL not in loss_and_grads(model, batch_of("qwen3_moe"))[1]


def test_models_built_after_the_module_is_patched_use_tigon():
    truth = loss_and_grads(build("mixtral"), batch_of("mixtral"))
    apply_tigon_to_mixtral(experts=False)
    assert experts_implementations(build("mixtral")) == {"grouped_mm"}
    apply_tigon_to_mixtral()
    model = build("mixtral")
    assert experts_implementations(model) == {"tigon"}
    run = loss_and_grads(model, batch_of("mixtral"))
    assert KERNEL in run[1]
    assert_matches(run, truth)


def test_gradient_checkpointing():
    batch = batch_of("qwen3_moe")
    truth = loss_and_grads(build("qwen3_moe"), batch)
    model = apply_tigon(build("qwen3_moe"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    run = loss_and_grads(model, batch)
    assert KERNEL in run[1]
    assert_matches(run, truth)


def test_peft_lora_on_attention_with_frozen_experts():
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    def lora_model():
        model = build("qwen3_moe")
        torch.manual_seed(1)
        return peft.get_peft_model(model, lora)

    batch = batch_of("qwen3_moe")
    truth = loss_and_grads(lora_model(), batch)
    model = apply_tigon(lora_model())
    assert experts_implementations(model) == {"tigon"}
    run = loss_and_grads(model, batch)
    assert KERNEL in run[1]
    # Only the adapters train; their gradient reaches them through the frozen experts.
    assert run[2] and all("lora_" in name for name in run[2])
    assert_matches(run, truth)


def test_activation_the_kernel_does_not_compute_is_refused_before_patching():
    model = build("qwen3_moe", hidden_act="gelu")
    with pytest.raises(ValueError, match="cannot compute Qwen3MoeExperts: its act_fn is GELUActivation.*experts=False"):
        apply_tigon(model, swiglu=False)
    # Refused as a whole: no layer was patched, the experts keep grouped_mm.
    assert not any(hasattr(type(module), "tigon_replaces") for module in model.modules())
    assert experts_implementations(model) == {"grouped_mm"}


@use_experts_implementation(has_gate=False)
class UngatedExperts(nn.Module):
    """NemotronH's kind: ``down(act(up(x)))``, no gate."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = 4
        self.up_proj = nn.Parameter(torch.randn(4, 16, 8))
        self.down_proj = nn.Parameter(torch.randn(4, 8, 16))
        self.act_fn = nn.ReLU()


def test_experts_the_kernel_does_not_compute_are_refused_at_forward():
    hidden_states, top_k_index, top_k_weights = torch.randn(3, 8), torch.tensor([[0, 1]] * 3), torch.ones(3, 2)
    config = transformers.PretrainedConfig(experts_implementation="tigon")
    with pytest.raises(ValueError, match="cannot compute UngatedExperts: its experts have no gate"):
        UngatedExperts(config)(hidden_states, top_k_index, top_k_weights)


# transformers 5.7 and newer declare the gate's columns (is_concatenated); 5.6 leaves them to the
# gate, which test_patched_experts_match_eager runs both kinds of (Mixtral's and GPT-OSS's).
DECLARES_LAYOUT = "is_concatenated" in inspect.signature(use_experts_implementation).parameters


@pytest.mark.skipif(not DECLARES_LAYOUT, reason=f"transformers {transformers.__version__} declares no column layout")
def test_experts_declaring_columns_their_gate_does_not_read_are_refused_at_forward():
    @use_experts_implementation(is_concatenated=False)
    class MislabelledExperts(nn.Module):
        """transformers' default gate over [gate | up] columns, declared interleaved."""

        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
            self.down_proj = nn.Parameter(torch.randn(4, 8, 8))
            self.act_fn = nn.SiLU()

    hidden_states, top_k_index, top_k_weights = torch.randn(3, 8), torch.tensor([[0, 1]] * 3), torch.ones(3, 2)
    config = transformers.PretrainedConfig(experts_implementation="tigon")
    with pytest.raises(ValueError, match="reads concatenated gate and up columns, but it declares is_concatenated=False"):
        MislabelledExperts(config)(hidden_states, top_k_index, top_k_weights)


@pytest.mark.skipif(
    patching.modeling_module(FAMILIES["deepseek_v4"]) is None,
    reason=f"transformers {transformers.__version__} has no DeepSeek V4",
)
def test_experts_with_a_gate_of_their_own_are_refused_at_forward():
    hidden_states, top_k_index, top_k_weights = torch.randn(3, 8), torch.tensor([[0, 1]] * 3), torch.ones(3, 2)
    # DeepSeek V4's clamps gate and up in its own _apply_gate.
    config = transformers.DeepseekV4Config(
        hidden_size=8, intermediate_size=4, num_local_experts=4, experts_implementation="tigon"
    )
    experts = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts(config)
    with pytest.raises(ValueError, match=r"cannot compute DeepseekV4Experts: its gate is its own \(DeepseekV4Experts"):
        experts(hidden_states, top_k_index, top_k_weights)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_sentinel_slots_are_dropped(model_type):
    """Under expert parallelism transformers' router hook gives a rank's experts forward the slots
    of other ranks' experts as id E (the module's number of experts) with weight 0: tigon drops
    them, as transformers' grouped_mm does (the output and every gradient within TIGHT), and
    refuses ids past E."""
    model = set_experts(build(model_type, **FAMILY_OPTIONS[model_type]), model_type)
    experts = experts_modules(model)[0]
    # As transformers' expert-parallel plan marks each experts module (5.24 and newer: its
    # grouped_mm drops the sentinel slots only then; older ones always).
    experts._is_expert_parallel = True
    n_experts = experts.gate_up_proj.shape[0]
    generator = torch.Generator().manual_seed(3)
    hidden_size = model.config.hidden_size
    hidden_states = torch.randn(29, hidden_size, generator=generator).to(experts.gate_up_proj.device)
    top_k_index = torch.rand(29, n_experts, generator=generator).argsort(dim=-1)[:, :2]
    dropped = torch.rand(top_k_index.shape, generator=generator) < 0.5
    dropped[0] = True  # a token with no slot on this rank
    top_k_index = top_k_index.masked_fill(dropped, n_experts).to(hidden_states.device)
    top_k_weights = torch.rand(top_k_index.shape, generator=generator).masked_fill(dropped, 0.0)

    def run(implementation):
        experts.config._experts_implementation = implementation
        experts.zero_grad(set_to_none=True)
        inputs = dict(hidden_states=hidden_states.clone(), top_k_weights=top_k_weights.to(hidden_states.device))
        inputs = {name: tensor.requires_grad_() for name, tensor in inputs.items()}
        output = experts(inputs["hidden_states"], top_k_index, inputs["top_k_weights"])
        output.backward(torch.randn(output.shape, generator=torch.Generator().manual_seed(4)).to(output.device))
        grads = {name: tensor.grad for name, tensor in (*inputs.items(), *experts.named_parameters())}
        return output.detach(), graph_functions(output), grads

    (output, functions, grads), (truth, _, truth_grads) = run(moe.IMPLEMENTATION), run("grouped_mm")
    assert KERNEL in functions
    assert not output[0].any() and not grads["hidden_states"][0].any()
    assert relative_error(output, truth) <= TIGHT
    assert grads.keys() == truth_grads.keys()
    for name, grad in truth_grads.items():
        assert relative_error(grads[name], grad) <= TIGHT, name
    experts.config._experts_implementation = moe.IMPLEMENTATION
    past_the_sentinel = top_k_index.masked_fill(dropped, n_experts + 1)
    match = rf"top_k_index must hold expert ids in \[0, {n_experts}\].*got ids from 0 to {n_experts + 1}"
    with pytest.raises(ValueError, match=match):
        experts(hidden_states, past_the_sentinel, top_k_weights.to(hidden_states.device))


@pytest.mark.parametrize("route", ["apply_tigon", "experts_implementation"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_peft_lora_on_the_stacked_experts_trains_as_peft_alone(model_type, route, monkeypatch):
    # PEFT 0.21's target_parameters: LoRA on the experts' stacked weights ([E, out, in], or GPT-OSS's
    # transposed [E, in, out]), applied by a parametrization that hands the experts W + s·B·A while
    # they run: a baddbmm per forward (one more when it is registered, as a check), and the full
    # weight gradient in backward. tigon hands its kernel the factors instead: through its patch of
    # PEFT's ParamWrapper (apply_tigon) nothing merges them; with only experts_implementation="tigon"
    # PEFT's registration check still does, but the step does not use it.
    import peft
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import layer

    if Version(peft.__version__) < Version("0.21"):
        pytest.skip(f"LoRA on stacked experts is checked with PEFT 0.21 and later, not {peft.__version__}")
    merges = []
    factors_forward = layer._LoraFactorsProxy.forward
    monkeypatch.setattr(layer._LoraFactorsProxy, "forward", lambda self, W: merges.append(W) or factors_forward(self, W))

    def step(tigon: bool):
        model = build(model_type)
        if tigon and route == "apply_tigon":
            apply_tigon(model)
        elif tigon:
            moe.register()
            model.set_experts_implementation(moe.IMPLEMENTATION)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        merges.clear()
        return loss_and_grads(get_peft_model(model, config), batch_of(model_type)), len(merges)

    (truth, truth_merges), (run, run_merges) = step(tigon=False), step(tigon=True)
    n_layers = sum(1 for module in experts_modules(build(model_type)))
    assert truth_merges == 4 * n_layers  # two weights a layer, each merged twice
    assert run_merges == (0 if route == "apply_tigon" else 2 * n_layers)
    assert KERNEL in run[1] and KERNEL not in truth[1]
    assert "BaddbmmBackward0" in truth[1] and "BaddbmmBackward0" not in run[1]
    for factor in ("lora_A", "lora_B"):
        assert any(".mlp.experts." in name and factor in name for name in run[2])
    assert_matches(run, truth)


def test_peft_lora_on_the_experts_disabled_runs_the_base_experts():
    # PEFT's disable_adapter(): tigon's ParamWrapper patch hands nothing over, PEFT's own forward
    # runs the experts (still on tigon's kernel) without the adapters.
    import peft
    from peft import LoraConfig, get_peft_model

    if Version(peft.__version__) < Version("0.21"):
        pytest.skip(f"LoRA on stacked experts is checked with PEFT 0.21 and later, not {peft.__version__}")
    batch = batch_of("qwen3_moe")
    model = apply_tigon(build("qwen3_moe"))
    base_loss = model(**batch).loss.detach()
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = get_peft_model(model, config)
    with peft_model.disable_adapter():
        loss = peft_model(**batch).loss.detach()
    assert relative_error(loss, base_loss) <= TIGHT
    assert relative_error(peft_model(**batch).loss.detach(), base_loss) > 1e-4  # the adapters, enabled again
