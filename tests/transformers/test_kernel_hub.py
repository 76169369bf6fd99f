"""transformers' kernel hub served by tigon: the exported repository, the mapping, the swap.

The swap runs on the CPU too (tigon's kernel config registers the CPU, where the kernels run
through Triton's interpreter), so these tests run unchanged on both; the GPU run adds bf16 at the
GPU's sizes.
"""

import importlib

import kernels
import pytest
import torch
import transformers
from kernels_data import Backend, Metadata

from test_families import assert_bf16_as_close_to_fp32_as_plain, assert_replays
from tigon.cli import main as tigon_command
from tigon.transformers import FAMILIES, export_kernels, kernel_config, kernel_hub
from tiny_models import replay, tiny_model, train
from utils import DEVICE, ON_GPU, randn, relative_error

# transformers warns of every registered layer the config leaves alone (Llama's MLP activation).
pytestmark = pytest.mark.filterwarnings(r"ignore:\s*No kernel mapping found for layer:UserWarning")

TIGHT = 1e-5
MODULES = {model_type: importlib.import_module(family.module) for model_type, family in FAMILIES.items()}


def _hub_rows(name, rows_of):
    """``{(module, row name): (model_type, row)}`` for the rows whose class or function
    transformers registers for the hub as ``name``, each once however many families share it."""
    found = {}
    for model_type, family in sorted(FAMILIES.items()):
        for row in rows_of(family):
            if getattr(getattr(MODULES[model_type], row.name), "kernel_layer_name", None) == name:
                found.setdefault((family.module, row.name), (model_type, row))
    return found


HUB_RMS_NORMS = _hub_rows("RMSNorm", lambda family: [row for row in family.norms if row.kind == "rms"])
HUB_ROTARIES = _hub_rows("rotary_pos_emb", lambda family: family.ropes)
_ids = [name for _, name in HUB_RMS_NORMS], [f"{module.rpartition('_')[2]}.{name}" for module, name in HUB_ROTARIES]


@pytest.fixture(autouse=True)
def rotary_functions_restored():
    """kernelize swaps the forward of a family's one rotary function object, which every model of
    the family shares: each test leaves them with their own."""
    functions = [getattr(MODULES[model_type], row.name) for model_type, row in HUB_ROTARIES.values()]
    yield
    for function in functions:
        vars(function).pop("forward", None)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return export_kernels(tmp_path_factory.mktemp("kernels") / "tigon")


def test_hub_registers_the_layers_expected():
    # What transformers 5.17 registers, as the README describes it: a change here is a new reach.
    # The families with an RMSNorm, or a rotary function, of which none is registered:
    without_norm = {
        model_type for model_type, family in FAMILIES.items()
        if any(row.kind == "rms" for row in family.norms)
        and not any((family.module, row.name) in HUB_RMS_NORMS for row in family.norms)
    }
    without_rotary = {
        model_type for model_type, family in FAMILIES.items()
        if family.ropes and not any((family.module, row.name) in HUB_ROTARIES for row in family.ropes)
    }
    assert without_norm == {
        "gemma", "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "llama4", "mllama", "muse_glimmer",
        "pixtral", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next",
    }
    assert without_rotary == {
        "deepseek_v2", "deepseek_v4", "gemma4", "gemma4_text", "glm4", "glm4_moe", "glm4v", "glm4v_moe", "llama4",
        "mllama", "nemotron", "phi3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next",
    }


def test_export_writes_a_noarch_build_per_backend(tmp_path):
    assert tigon_command(["export-kernels", str(tmp_path)]) == 0
    files = {str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file()}
    builds = [f"build/torch-{backend}" for backend in kernel_hub.BACKENDS]
    assert files == {"README.md"} | {
        f"{build}/{name}" for build in builds for name in ("metadata.json", "tigon/__init__.py", "tigon/layers.py")
    }
    for backend, build in zip(kernel_hub.BACKENDS, builds):
        metadata = Metadata.read_from_file(tmp_path / build / "metadata.json")
        assert (str(metadata.name), metadata.version, metadata.license) == ("tigon", 1, "Apache-2.0")
        assert metadata.python_depends == [] and metadata.id.startswith(f"_tigon_{backend}_")
        assert metadata.backend.backend_type == Backend.from_str(backend)
        assert (tmp_path / build / "tigon/layers.py").read_text() == (tmp_path / builds[0] / "tigon/layers.py").read_text()
    # Exporting again over an export changes nothing.
    contents = {name: (tmp_path / name).read_bytes() for name in files}
    export_kernels(tmp_path)
    assert contents == {name: (tmp_path / name).read_bytes() for name in files}


def test_kernels_loads_the_exported_layers(repo):
    module = kernels.get_local_kernel(repo)
    loaded = next(kernel for kernel in kernels.get_loaded_kernels() if kernel.module is module)
    assert loaded.metadata.backend.backend_type == (Backend.CUDA if ON_GPU else Backend.CPU)
    for layer in kernel_hub.HUB_LAYERS.values():
        assert getattr(module.layers, layer) is getattr(kernel_hub, layer)
        assert kernels.LocalLayerRepository(repo_path=repo, layer_name=layer).load() is getattr(kernel_hub, layer)


def test_kernel_config_maps_the_hub_names(repo, tmp_path, monkeypatch):
    config = kernel_config(repo)
    assert isinstance(config, transformers.KernelConfig) and config.use_local_kernel
    assert config.kernel_mapping == {"RMSNorm": f"{repo}:RMSNorm", "rotary_pos_emb": f"{repo}:ApplyRotaryPosEmb"}
    # Without a path, a repository exported into tigon's cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_config().repo_path.parent == tmp_path / "tigon"
    with pytest.raises(FileNotFoundError, match="tigon export-kernels"):
        kernel_config(tmp_path / "missing")


@pytest.mark.parametrize("model_type, row", HUB_RMS_NORMS.values(), ids=_ids[0])
def test_rms_norm_layer_equals_hugging_face(model_type, row):
    norm_class = getattr(MODULES[model_type], row.name)
    norm = norm_class(48, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(randn(48))
    x = randn(3, 5, 48, requires_grad=True)
    outputs, grads = [], []
    for forward in (norm_class.forward, kernel_hub.RMSNorm.forward):
        output = forward(norm, x)
        outputs.append(output)
        grads.append(torch.autograd.grad(output, (x, norm.weight), torch.ones_like(output)))
    assert relative_error(outputs[1], outputs[0]) <= TIGHT
    for grad, truth, name in zip(grads[1], grads[0], ("x", "weight")):
        assert relative_error(grad, truth) <= TIGHT, f"grad of {name}"


@pytest.mark.parametrize("model_type, row", HUB_ROTARIES.values(), ids=_ids[1])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_rotary_layer_equals_hugging_face(model_type, row, unsqueeze_dim):
    function = getattr(MODULES[model_type], row.name)
    # q, k: [B, H, T, D] (unsqueeze_dim=1) or [B, T, H, D] (2), with 4 query and 2 key heads.
    q_shape, k_shape = ((2, 4, 6, 16), (2, 2, 6, 16)) if unsqueeze_dim == 1 else ((2, 6, 4, 16), (2, 6, 2, 16))
    q, k = randn(*q_shape, requires_grad=True), randn(*k_shape, requires_grad=True)
    angles = torch.rand(2, 6, 8, device=DEVICE) * 6.28
    # The table as the family's rotary embedding builds it: GPT-OSS's one angle per pair.
    angles = angles if row.form == "half_table" else torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    results = []
    for forward in (type(function).forward, kernel_hub.ApplyRotaryPosEmb.forward):
        q_rot, k_rot = forward(function, q, k, cos, sin, unsqueeze_dim)
        grads = torch.autograd.grad((q_rot, k_rot), (q, k), (torch.ones_like(q_rot), torch.ones_like(k_rot) * 2))
        results.append((q_rot, k_rot, *grads))
    for actual, truth, name in zip(results[1], results[0], ("q_rot", "k_rot", "grad of q", "grad of k")):
        assert relative_error(actual, truth) <= TIGHT, name


class DoublingRMSNorm(MODULES["llama"].LlamaRMSNorm):
    """A model's RMSNorm of a family tigon does not know (registered as "RMSNorm" too)."""

    def forward(self, hidden_states):
        return 2 * super().forward(hidden_states)


def test_layers_of_other_models_keep_their_own_forward(repo):
    model = tiny_model("llama")
    model.model.norm.__class__ = DoublingRMSNorm
    with pytest.warns(UserWarning, match="DoublingRMSNorm belong to no family"):
        model.set_use_kernels(True, kernel_config=kernel_config(repo))
    x = randn(2, 3, model.config.hidden_size)
    assert model.model.norm.forward.__func__ is kernel_hub.RMSNorm.forward
    assert torch.equal(model.model.norm(x), DoublingRMSNorm.forward(model.model.norm, x))

    @transformers.integrations.use_kernel_forward_from_hub("rotary_pos_emb")
    def other_rotary(q, k, cos, sin, unsqueeze_dim=1):
        return k, q

    q, k = randn(1, 2, 3, 4), randn(1, 1, 3, 4)
    q_out, k_out = kernel_hub.ApplyRotaryPosEmb.forward(other_rotary, q, k, None, None)
    assert q_out is k and k_out is q


def assert_kernelized(model):
    """Every RMSNorm and rotary function ``model`` registers for the hub runs tigon's forward."""
    norms = [m for m in model.modules() if getattr(type(m), "kernel_layer_name", None) == "RMSNorm"]
    rotaries = [f for m in model.modules() for f in getattr(m, "_kernel_funcs", {}).values()]
    assert norms and rotaries
    assert all(norm.forward.__func__ is kernel_hub.RMSNorm.forward for norm in norms)
    assert all(rotary.forward.__func__ is kernel_hub.ApplyRotaryPosEmb.forward for rotary in rotaries)


def test_config_keeps_the_names_a_model_registers(repo):
    # Gemma registers its rotary function but no RMSNorm: a plain KernelConfig naming both raises.
    model = tiny_model("gemma")
    model.set_use_kernels(True, kernel_config=kernel_config(repo))
    assert model.kernel_config.kernel_mapping.keys() == {"rotary_pos_emb"}
    function = getattr(MODULES["gemma"], FAMILIES["gemma"].ropes[0].name)
    assert function.forward.__func__ is kernel_hub.ApplyRotaryPosEmb.forward


@pytest.mark.parametrize("entry", ["set_use_kernels", "from_pretrained"])
def test_kernelized_model_trains_like_hugging_face(entry, repo, tmp_path):
    truth = train(tiny_model("llama"))
    if entry == "set_use_kernels":
        model = tiny_model("llama")
        model.set_use_kernels(True, kernel_config=kernel_config(repo))
    else:
        tiny_model("llama").save_pretrained(tmp_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, kernel_config=kernel_config(repo))
        # Kernelized in eval mode on the CPU: replay's model.train() kernelizes again, on DEVICE.
        model.to(DEVICE)
    assert_kernelized(model)
    run = replay(model, truth)
    assert_kernelized(model)  # after train() and eval() each kernelized again
    assert_replays(run, truth)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device: bf16 through the compiled kernels at the GPU's sizes")
def test_kernelized_bf16_as_close_to_fp32_as_plain(repo):
    truth = train(tiny_model("llama"))
    plain = replay(tiny_model("llama").to(torch.bfloat16), truth)
    model = tiny_model("llama").to(torch.bfloat16)
    model.set_use_kernels(True, kernel_config=kernel_config(repo))
    assert_kernelized(model)
    assert_bf16_as_close_to_fp32_as_plain(replay(model, truth), plain, truth)
