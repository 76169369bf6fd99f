"""tigon as transformers' experts implementation ``"tigon"``: MoE experts by one fused kernel.

transformers (5.6 and newer) runs the experts of a mixture-of-experts layer through the class
decorator ``use_experts_implementation``: the decorated class's ``forward(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k])`` calls the function that ``ALL_EXPERTS_FUNCTIONS`` holds under the
module's ``config._experts_implementation`` (``"grouped_mm"`` by default). Importing
:mod:`tigon.transformers` registers :func:`experts_forward` there as ``"tigon"`` (:func:`register`),
which computes the experts by :func:`tigon.functional.moe_experts`; then::

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="tigon")
    model.set_experts_implementation("tigon")             # or on a model already built

(transformers 5.7 and newer; 5.6 takes only its own implementations by name, and gets tigon's by
``apply_tigon`` or ``model.config._experts_implementation = "tigon"``),

and :func:`~tigon.transformers.apply_tigon` sets it on the models of every family whose row of
the table lists its experts class (:class:`~tigon.transformers.families.Experts`; flag
``experts``, on by default).

The kernel reads the module as transformers' ``grouped_mm`` does: ``gate_up_proj`` and
``down_proj`` (and, with ``has_bias``, ``gate_up_proj_bias`` and ``down_proj_bias``) in the layout
the decorator declares (``is_transposed``; from transformers 5.7 also ``is_concatenated``, which
5.6 leaves to the gate), and the gate of the class's ``_apply_gate``, which it computes exactly for:

- transformers' default gate, ``act_fn(gate) · up`` over ``[gate | up]`` columns, with a SiLU
  (``"swiglu"``) or tanh-GELU (``"geglu"``) ``act_fn``;
- GPT-OSS's clamped SwiGLU over interleaved ``[g0, u0, g1, u1, …]`` columns, with the module's
  ``alpha`` and ``limit``: the gate of the table's ``Mlp(layout="experts")`` rows, as Hugging Face
  wrote it or as :class:`~tigon.transformers.layers.TigonClampedSwiGLUExperts` replaces it.

Anything else is refused with a ``ValueError`` saying what (:func:`experts_kernel`): experts
without a gate (``has_gate=False``), another activation, a class's own ``_apply_gate`` (DeepSeek
V4's clamps gate and up), a gate reading other columns than ``is_concatenated`` declares. There
is no silent fallback to ``grouped_mm``: a model asked to run tigon's experts runs them or says
why not. ``apply_tigon`` checks every experts module before it changes anything (``experts=False``
keeps the model's own implementation); set directly on a config, the first forward raises.

**LoRA on the experts** (PEFT 0.21's ``LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])``, one ``ParamWrapper`` per weight, nested): while the experts run, PEFT
parametrizes each targeted weight so that reading it gives ``W + scaling · lhs @ rhs``, a
``baddbmm`` that writes a merged copy of every expert's weight (registering it evaluates it once
more, as a check), and whose backward needs the full weight gradient. tigon hands the kernel the
base weights and the factors instead, as ``gate_up_lora``/``down_lora``: it adds ``s·(x Aᵀ) Bᵀ``
inside the grouped matmuls and computes only the factors' gradients. Two ways in:

- with tigon's PEFT patch (:func:`~tigon.transformers.apply_tigon`), PEFT's ``ParamWrapper.forward``
  calls the experts directly with the adapters of the whole chain (:func:`peft_adapters`,
  :func:`handing_adapters`): no parametrization is registered or evaluated;
- without it, the experts find PEFT's parametrization, and where it keeps the factors (one active
  adapter: its ``_LoraFactorsProxy``) read them without evaluating it (:func:`peft_expert_adapter`).

Anything else (several adapters, a base weight in FP8, which PEFT merges as a delta, merged or
disabled adapters) runs as PEFT runs it: the kernel gets the merged weight, as ``grouped_mm`` does.

Inputs as ``grouped_mm`` takes them: ``hidden_states`` in another dtype than the weights (under
autocast) is cast to theirs and the output cast back; the routing weights may be of any float
dtype and get their gradient.

**Expert parallelism** (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N,
enable_expert_parallel=True))``, the family's ``base_model_ep_plan``): transformers shards the
experts' weights by expert (DTensors ``Shard(0)``, ``E/N`` experts a rank) and runs every token
through every rank. Its router hook (``ep_router``) remaps the ids of the rank's own experts to
``[0, E/N)`` and sets the other slots to the sentinel ``E/N`` with weight 0; its experts hook
(``moe_tp_experts``) hands the forward the rank's local weights as plain tensors and sums the
ranks' outputs after it (an all-reduce; in backward, one of the input's and one of the routing
weights' gradients). Here the kernel computes the local experts only: the sentinel slots are
dropped (:mod:`tigon.ops.moe`: no FLOPs, no gradient), so nothing is gathered and each rank does
its share of the work. The same hook under tensor parallelism (``tp_plan="auto"``: every expert's
intermediate features sharded, ``gate_up_proj`` as ``[gate | up]`` of the rank's features) gives
the kernel consistent local weights too. Weights that reach the forward as DTensors (a plan
without transformers' experts hook) are refused.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from tigon import functional as F
from tigon.transformers import layers
from tigon.transformers.families import FAMILIES

IMPLEMENTATION = "tigon"
# The gates an experts module's act_fn may select under transformers' default gate.
ACTIVATION_GATES = ("swiglu", "geglu")


def _qualified_name(function) -> str:
    return f"{function.__module__}.{function.__qualname__}"


# GPT-OSS's clamped SwiGLU over interleaved columns, by the qualified name of the `_apply_gate`
# computing it: the experts classes whose gate the table replaces, and tigon's replacement.
CLAMPED_GATES = frozenset(
    (
        _qualified_name(layers.MLP_LAYOUTS["experts"]._apply_gate),
        *(
            f"{family.module}.{row.name}._apply_gate"
            for family in FAMILIES.values() for row in family.mlps if row.layout == "experts"
        ),
    )
)


def experts_kernel(experts) -> dict:
    """The options of :func:`tigon.functional.moe_experts` (``gate``, ``interleaved``, ``alpha``,
    ``limit``) that compute ``experts``, a module of a class decorated with transformers'
    ``use_experts_implementation``, exactly; a ``ValueError`` saying why where none does."""
    experts_class = type(experts)
    name = getattr(experts_class, "tigon_replaces", experts_class).__name__

    def refuse(reason):
        return ValueError(
            f"tigon's experts kernel (experts_implementation={IMPLEMENTATION!r}) cannot compute {name}: {reason}; "
            f"patch with experts=False, or use another experts_implementation"
        )

    if not experts.has_gate:
        raise refuse("its experts have no gate (has_gate=False)")
    apply_gate = experts_class._apply_gate
    if apply_gate is _default_apply_gate:
        activation = getattr(experts, "act_fn", None)
        gate = next((gate for gate in ACTIVATION_GATES if layers.gate_computes(gate, activation)), None)
        if gate is None:
            computed = "; ".join(f"{' / '.join(layers.GATE_ACTIVATIONS[gate])} ({gate})" for gate in ACTIVATION_GATES)
            raise refuse(f"its act_fn is {type(activation).__name__}, where the kernel computes {computed}")
        kernel = dict(gate=gate, interleaved=False)
    elif _qualified_name(apply_gate) in CLAMPED_GATES:
        kernel = dict(gate="swiglu_clamped", interleaved=True, alpha=experts.alpha, limit=experts.limit)
    else:
        raise refuse(
            f"its gate is its own ({apply_gate.__qualname__}), where the kernel computes transformers' default "
            f"act_fn(gate) * up and GPT-OSS's clamped SwiGLU"
        )
    # transformers declares the columns' layout (is_concatenated) from 5.7 on, for kernels that read
    # the weights without the gate; up to 5.6 the gate alone says which columns it reads.
    declared = getattr(experts, "is_concatenated", None)
    if declared is not None and declared == kernel["interleaved"]:
        columns = "interleaved" if kernel["interleaved"] else "concatenated"
        raise refuse(f"its gate reads {columns} gate and up columns, but it declares is_concatenated={declared}")
    return kernel


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward (``self``, a ``use_experts_implementation`` module) by
    :func:`tigon.functional.moe_experts`: ``hidden_states [T, H]``, ``top_k_index [T, k]`` expert
    ids in ``[0, E]`` (``E``, the module's number of experts, is expert parallelism's sentinel: a
    slot of another rank's experts, dropped: ``allow_dropped``) and ``top_k_weights [T, k]``
    routing weights → ``[T, H]`` in ``hidden_states``' dtype."""
    kernel = experts_kernel(self)
    transposed = bool(self.is_transposed)
    handed = getattr(self, "tigon_adapters", None)
    (gate_up_proj, gate_up_lora), (down_proj, down_lora) = (
        (getattr(self, name), handed.get(name)) if handed is not None else peft_expert_adapter(self, name, transposed)
        for name in ("gate_up_proj", "down_proj")
    )
    weights = dict(
        gate_up_proj=gate_up_proj, down_proj=down_proj,
        gate_up_proj_bias=self.gate_up_proj_bias if self.has_bias else None,
        down_proj_bias=self.down_proj_bias if self.has_bias else None,
    )
    _refuse_dtensors(self, dict(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights,
                                **weights))
    output = F.moe_experts(
        hidden_states.to(gate_up_proj.dtype), top_k_index, top_k_weights, gate_up_proj, down_proj,
        gate_up_bias=weights["gate_up_proj_bias"], down_bias=weights["down_proj_bias"], transposed=transposed,
        allow_dropped=True, gate_up_lora=gate_up_lora, down_lora=down_lora, **kernel,
    )
    return output.to(hidden_states.dtype)


def peft_expert_adapter(experts, name: str, transposed: bool) -> tuple:
    """``(weight, adapter)`` of the experts' weight ``name``: under a PEFT LoRA parametrization that
    keeps the factors (the module docstring), the base weight and ``(lora_a [E, r, in], lora_b [E,
    out, r], scaling)``; else the weight as reading it gives, and ``None``."""
    if not parametrize.is_parametrized(experts, name):
        return getattr(experts, name), None
    chain = experts.parametrizations[name]
    peft_lora = sys.modules.get("peft.tuners.lora.layer")
    factors = getattr(peft_lora, "_LoraFactorsProxy", None)
    if len(chain) != 1 or factors is None or type(chain[0]) is not factors:
        return getattr(experts, name), None
    proxy = chain[0]
    return chain.original, _kernel_adapter(proxy.lhs, proxy.rhs, proxy.scaling, transposed)


def _kernel_adapter(lhs, rhs, scaling, transposed: bool) -> tuple:
    """PEFT's delta ``scaling · lhs @ rhs``, in the weight's own layout (``[E, out, in]`` = B·A, or
    transposed ``[E, in, out]`` = Aᵀ·Bᵀ), as the kernel's ``(lora_a [E, r, in], lora_b [E, out, r],
    scaling)``."""
    lora_a, lora_b = (lhs.mT, rhs.mT) if transposed else (rhs, lhs)
    return lora_a, lora_b, float(scaling)


# PEFT's parameter dtypes whose delta it folds with the factors (others, FP8, it merges as a delta).
_FACTOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def peft_adapters(wrapper) -> dict | None:
    """The adapters of PEFT's ``ParamWrapper`` chain ``wrapper`` over an experts module that runs
    tigon's kernel, ``{"gate_up_proj": (lora_a, lora_b, scaling), ...}`` (a weight without an
    active adapter is left out); ``None`` where the chain holds anything the kernel does not
    compute exactly, so that PEFT's own forward runs."""
    experts = wrapper.get_base_layer()
    # Only an experts module whose forward dispatches to experts_forward reads the adapters: one of
    # a use_experts_implementation class (is_transposed), set to "tigon", its forward not replaced.
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if implementation != IMPLEMENTATION or not hasattr(experts, "is_transposed") or "forward" in vars(experts):
        return None
    transposed = bool(experts.is_transposed)
    adapters = {}
    layer = wrapper
    while layer is not experts:
        name = getattr(layer, "parameter_name", None)
        if type(layer) is not type(wrapper) or name not in ("gate_up_proj", "down_proj") or name in adapters:
            return None
        if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1 or layer.num_experts < 2:
            return None
        (adapter,) = layer.active_adapters
        if adapter in layer.lora_A:
            if layer.get_param().dtype not in _FACTOR_DTYPES:
                return None
            adapters[name] = _kernel_adapter(*layer.get_delta_factors(adapter), transposed)
        layer = layer.base_layer
    return adapters


@contextlib.contextmanager
def handing_adapters(experts, adapters: dict):
    """``adapters`` (:func:`peft_adapters`) read by :func:`experts_forward` of ``experts`` inside the ``with``."""
    experts.tigon_adapters = adapters
    try:
        yield
    finally:
        del experts.tigon_adapters


def _refuse_dtensors(experts, tensors: dict) -> None:
    """A ``ValueError`` naming the first DTensor of ``tensors``: the kernel takes each rank's local
    experts, which transformers' experts hook (``moe_tp_experts``) hands the forward."""
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            raise ValueError(
                f"tigon's experts kernel (experts_implementation={IMPLEMENTATION!r}) got {name} of "
                f"{type(experts).__name__} as a DTensor (placements {tensor.placements}), where it takes plain "
                f"tensors: each rank's local experts, as transformers' expert- and tensor-parallel plans hand them "
                f"to the experts' forward (the 'moe_tp_experts' style, from_pretrained(..., distributed_config="
                f"DistributedConfig(tp_size=N, enable_expert_parallel=True))); under a plan of your own, give the "
                f"experts module that style or call it on local tensors"
            )


def register() -> None:
    """Register :func:`experts_forward` in transformers' ``ALL_EXPERTS_FUNCTIONS`` as ``"tigon"``
    (again: no change), so that ``experts_implementation="tigon"`` is accepted and dispatched."""
    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def use_tigon_experts(experts) -> None:
    """Make ``experts`` (checked by :func:`experts_kernel`) run on tigon: its config's
    ``experts_implementation``, which transformers reads at every forward, becomes ``"tigon"``
    (with its sub-configs', as transformers' setter does)."""
    if not hasattr(experts, "tigon_replaced_implementation"):
        experts.tigon_replaced_implementation = experts.config._experts_implementation
    experts.config._experts_implementation = IMPLEMENTATION


def restore_experts(experts) -> None:
    """Undo :func:`use_tigon_experts`: ``experts``' config gets back the implementation it had."""
    if hasattr(experts, "tigon_replaced_implementation"):
        experts.config._experts_implementation = experts.tigon_replaced_implementation
        del experts.tigon_replaced_implementation
