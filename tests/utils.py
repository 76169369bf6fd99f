"""What every test shares: the device, the tolerances per dtype and the error measure."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tigon.testing import TOLERANCE

ON_GPU = torch.cuda.is_available()


ROOT = Path(__file__).resolve().parents[1]


def launch_worker(worker: Path, *args: str, processes: int = 1) -> subprocess.Popen:
    """``python worker args`` from the checkout's root, under torchrun (standalone) when
    ``processes`` > 1, one intra-op thread per process; its output (stderr too) on the Popen's stdout."""
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    return subprocess.Popen(
        [*launcher, str(worker), *args], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_for(launches, timeout: float) -> None:
    """Wait for every launch of :func:`launch_worker`; a failed one fails the test with its output's end."""
    for launch in launches:
        output, _ = launch.communicate(timeout=timeout)
        assert launch.returncode == 0, f"{' '.join(launch.args)} failed:\n{output[-6000:]}"


def load_example(name: str):
    """``examples/<name>.py`` as a module, without putting ``examples/`` on ``sys.path`` (where its
    ``axolotl/`` and ``llamafactory/`` folders would pass for those packages in this process)."""
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module


def needs_trl_fused_head():
    """A skip mark for tests of TRL's fused LM head (TRL >= 1.16), which older TRLs do not have."""
    import pytest

    from tigon.trl import HAS_FUSED_HEAD

    return pytest.mark.skipif(not HAS_FUSED_HEAD, reason="the installed TRL has no fused LM head (TRL >= 1.16)")
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pick(cpu, gpu):
    """Small shapes for the interpreter, real ones on a GPU."""
    return gpu if ON_GPU else cpu


# Some gradients are ill-conditioned in fp32: rounding errors of order 1e-7 upstream move them by
# 1e-5 or more, so Hugging Face's own fp32 model computes them far from the exact (fp64) value, e.g.
# the decay parameters (A_log, dt_bias) of Gated DeltaNet's chunked recurrence (3-6e-4 off in
# Qwen3-Next), DeepSeek V4's hyper-connection head (up to 2e-5) and, on the H100, the embedding of
# GPT-OSS's tiny model (1e-3). Where a patched model's gradient is not within a test's tolerance of
# Hugging Face's fp32 one, the same weights are replayed in fp64: the gradient counts as
# ill-conditioned if Hugging Face's fp32 one is more than ILL_CONDITIONED_FROM (16 times fp32's
# unit roundoff) from the exact one, and the patched gradient must then be within ILL_CONDITIONED
# times fp32's reach of the exact one. fp32's reach is Hugging Face's fp32 distance, or, where a
# test measures it, the farthest that the exact gradient moves when every weight moves by one fp32
# rounding (FP32_MOVES fp64 replays, each weight times 1 ± 2^-24, the signs at random): Hugging
# Face's one rounding path is one sample of fp32's error and may land luckily close (Qwen3-Next's
# A_log: 5e-5 from fp64 on one CPU, where moving the weights alone moves the exact gradient by
# 2.5-5.3e-4). A wrong kernel is off by orders of magnitude more.
ILL_CONDITIONED_FROM, ILL_CONDITIONED = 1e-6, 4.0
FP32_MOVES = 3


def moved_by_fp32_rounding(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """fp64 copies of ``weights``, each entry moved by one fp32 unit roundoff (times ``1 ± 2^-24``,
    the sign drawn from ``seed``)."""
    moved, generators = {}, {}
    for name, weight in weights.items():
        # Drawn where the weight is: on the GPU's models (100M parameters for GLM-4.5V-MoE's) the
        # host would spend seconds per replay drawing and copying the signs.
        if weight.device not in generators:
            generators[weight.device] = torch.Generator(weight.device).manual_seed(seed)
        signs = torch.randint(0, 2, weight.shape, generator=generators[weight.device], device=weight.device) * 2 - 1
        moved[name] = weight.double() * (1 + 2.0**-24 * signs)
    return moved


def assert_ill_conditioned(
    what: str, grad: torch.Tensor, truth: torch.Tensor, exact: torch.Tensor, moved: list[torch.Tensor] = ()
) -> None:
    """``grad``, which is not within the test's tolerance of the fp32 ``truth``, passes only as an
    ill-conditioned gradient: ``truth`` more than ILL_CONDITIONED_FROM from the fp64 ``exact``, and
    ``grad`` at most ILL_CONDITIONED times as far from it as fp32 reaches: ``truth``'s distance, or
    the farthest of the fp64 gradients at ``moved`` weights (:func:`moved_by_fp32_rounding`)."""
    truth_error, error = relative_error(truth, exact), relative_error(grad, exact)
    reach = max([truth_error, *(relative_error(gradient, exact) for gradient in moved)])
    assert truth_error > ILL_CONDITIONED_FROM and error <= ILL_CONDITIONED * reach, (
        f"{what}: {relative_error(grad, truth):.3g} from the fp32 truth; from fp64 {error:.3g}, "
        f"the fp32 truth {truth_error:.3g}, fp32's reach {reach:.3g}"
    )


def relative_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Norm-wise relative error over the finite entries; non-finite entries must match exactly
    (NaN where the truth has NaN, the same infinity where it has one)."""
    # On the tensors' device: moving GPU-sized tensors to the host would cost more than the test.
    actual, truth = actual.detach().double(), truth.detach().double().to(actual.device)
    assert actual.shape == truth.shape, f"shape {tuple(actual.shape)} != {tuple(truth.shape)}"
    finite = torch.isfinite(truth)
    assert torch.equal(torch.isfinite(actual), finite), "finite entries differ from the truth's"
    assert torch.equal(actual[~finite].nan_to_num(), truth[~finite].nan_to_num()), "non-finite entries differ"
    actual, truth = actual[finite], truth[finite]
    scale = truth.norm().item()
    return (actual - truth).norm().item() / (scale if scale > 0 else 1.0)


def assert_close(actual: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype, what: str, factor: float = 1.0):
    """``factor`` widens the dtype's tolerance for quantities that pass through more roundings
    (a gradient reduced over many rows, a value recomputed from a rounded intermediate); each use
    says why."""
    if actual.dtype in (torch.float16, torch.bfloat16):
        # A 16-bit output can at best hold the truth rounded to its dtype; against the unrounded
        # truth it would be charged for what no 16-bit tensor can store (fp16 flushes values
        # below 6e-8, such as a softmax gradient averaged over thousands of tokens, to zero).
        truth = truth.to(actual.dtype)
    error = relative_error(actual, truth)
    limit = TOLERANCE[dtype] * factor
    assert error <= limit, f"{what}: relative error {error:.3g} > {limit:.3g} ({dtype})"


def assert_tensorwise_cast(data: torch.Tensor, scale: torch.Tensor, value: torch.Tensor, power_of_2: bool = False):
    """``data`` (FP8) and ``scale`` are torchao's tensorwise cast of ``value`` to ``data``'s
    dtype, byte for byte."""
    from tigon.testing import reference

    want_data, want_scale = reference.tensorwise_cast(value, data.dtype, power_of_2)
    assert data.shape == value.shape and torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(scale, want_scale)


def randn(*shape, dtype=torch.float32, requires_grad=False, scale=1.0):
    t = (torch.randn(*shape, device=DEVICE, dtype=torch.float32) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def leaf_copies(*tensors, dtype=torch.float64):
    """Detached copies that require grad: the fp64 copies feed the reference."""
    return [None if t is None else t.detach().to(dtype).requires_grad_(t.requires_grad) for t in tensors]


def hugging_face_state():
    """What tigon's patches change in Hugging Face's modeling modules: each module's names, and the
    ``forward`` and ``post_init`` of each family's head class; and PEFT's ``lora.Linear.forward``,
    ``ParamWrapper.forward`` (and ``lora.Linear4bit.forward`` with bitsandbytes)."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import ParamWrapper

    from tigon.transformers import FAMILIES, patching

    state = []
    for family in FAMILIES.values():
        module = patching.modeling_module(family)
        if module is None:  # a family newer than the installed transformers
            continue
        head = getattr(module, family.head) if family.head else None
        methods = {name: vars(head).get(name) for name in ("forward", "post_init")} if head else {}
        state.append((module, dict(vars(module)), head, methods))
    peft_layers = [LoraLinear, ParamWrapper]
    if importlib.util.find_spec("bitsandbytes") is not None:
        from peft.tuners.lora.bnb import Linear4bit

        peft_layers.append(Linear4bit)
    for layer in peft_layers:
        # PEFT's own forward, even if a test outside this fixture's reach patched it before.
        forward = vars(layer)["forward"]
        state.append((None, {}, layer, {"forward": getattr(forward, "tigon_wraps", forward)}))
    # tigon's own record of what it patched, which goes with the modules' state.
    records = {name: copy.deepcopy(vars(patching)[name]) for name in ("_MODULE_PATCHES", "_ORIGINAL_ROPES")}
    records["_PATCHED_MODELS"] = list(patching._PATCHED_MODELS)
    state.append((patching, records, None, {}))
    return state


def hugging_face_original():
    """:func:`hugging_face_state` as Hugging Face (and PEFT) wrote it, whatever tigon patched before,
    in a test or outside any test's fixture: tigon's classes by the classes they replace, tigon's
    rotary functions by the functions it recorded replacing, the head's methods unwrapped, and no
    patch on tigon's record."""
    from tigon.transformers import layers, patching

    tigon_ropes = list(layers.ROPE_FORMS.values())

    def original(module, name, value):
        if isinstance(value, type) and "tigon_replaces" in vars(value):
            return value.tigon_replaces
        if any(value is rope for rope in tigon_ropes):
            return patching._ORIGINAL_ROPES[module.__name__, name]
        return value

    state = []
    for module, names, head, methods in hugging_face_state():
        if module is patching:
            names = {name: type(record)() for name, record in names.items()}
        elif module is not None:
            names = {name: original(module, name, value) for name, value in names.items()}
        methods = {name: getattr(method, "tigon_wraps", method) for name, method in methods.items()}
        state.append((module, names, head, methods))
    return state


@contextlib.contextmanager
def hugging_face_as(state):
    """Inside the block, Hugging Face's modules as :func:`hugging_face_state` saw them in ``state``
    (an fp64 replay of the model as Hugging Face wrote it); after it, as they were before it."""
    current = hugging_face_state()
    restore_hugging_face(state)
    try:
        yield
    finally:
        restore_hugging_face(current)


def restore_hugging_face(state) -> None:
    """Put back the modules and head classes as :func:`hugging_face_state` (or
    :func:`hugging_face_original`) gives them."""
    from tigon.transformers import patching

    for module, names, head, methods in state:
        if module is patching:
            for name, record in names.items():
                vars(patching)[name].clear()
                vars(patching)[name].update(record)
        elif module is not None:
            vars(module).update(names)
        for name, method in methods.items():
            if method is not None:
                setattr(head, name, method)
            elif name in vars(head):
                delattr(head, name)


class MatmulFlops(TorchDispatchMode):
    """Counts ``2·m·n·k`` over every matmul run in the mode (all overloads, in-place and out=)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[-2:]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def graph_functions(tensor: torch.Tensor) -> set[str]:
    """The names of the autograd functions ``tensor`` comes from (which path a model took)."""
    names, seen, pending = set(), set(), [tensor.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return names
