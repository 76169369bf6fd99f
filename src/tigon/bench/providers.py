"""Providers: who computes each op. A provider loads into a table ``{op: fn}`` where
``fn(case.args)`` returns the op's outputs (ops it does not support are absent).

Peers are optional: one that cannot be imported, or cannot run on this device, is reported once
and skipped. Each provider is called as its users would call it by default (Liger's norms write
``dx`` into ``dy``; tigon's cross entropy and gates write gradients over their inputs, as its modules do).
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tigon.testing import reference
from tigon.bench.specs import FP8_OPS, OPS

OpTable = dict[str, Callable[[dict[str, Any]], Any]]
# Losses whose gradients tigon and Liger compute during forward.
LOSSES = ("kl_div", "jsd", "tvd", "fused_linear_jsd", "dpo", "orpo", "simpo", "kto", "grpo", "grpo_ref")


@dataclass(frozen=True)
class Provider:
    name: str
    load: Callable[[], OpTable]  # imports the implementation; raises ImportError/RuntimeError saying why not
    distribution: str | None = None  # the pip package, for the install hint and the recorded version
    needs_gpu: bool = False
    # Ops whose gradients are written during forward, or whose backward consumes what forward
    # kept, so backward cannot be re-run on a retained graph: their backward time is reported as
    # full − forward.
    grads_in_forward: frozenset[str] = frozenset()
    in_smoke_run: bool = True  # included by default when there is no GPU to time on

    def version(self) -> str | None:
        if self.distribution is None:
            return None
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None


def _standard_table(module) -> OpTable:
    """Every op called through ``module``'s functions (tigon.functional or the references)."""
    return {name: functools.partial(spec.call, module) for name, spec in OPS.items()}


def _tigon() -> OpTable:
    import tigon.functional as tf
    from tigon.ops import cross_entropy as ops_cross_entropy
    from tigon.ops import gated as ops_gated

    table = _standard_table(tf)
    # As tigon's modules call them: gradients written over the inputs' storage (the gated MLPs' gate
    # and up projections, the loss's logits), which nothing else reads afterwards. The bench's inputs
    # are leaves that require grad, which tigon.functional refuses to overwrite (as torch's in-place
    # ops do): these call the ops behind it, with the functions' default options.
    table["cross_entropy"] = lambda a: ops_cross_entropy.cross_entropy(
        a["logits"], a["target"], -100, "mean", 0.0, 0.0, None, False, True,
    )
    table["swiglu"] = lambda a: ops_gated.swiglu(a["gate"], a["up"], True)
    table["geglu"] = lambda a: ops_gated.geglu(a["gate"], a["up"], True)
    # As tigon.trl runs SFT: its mean NLL's gradient, the same for every token, computed in forward.
    table["fused_linear_logprobs_sft"] = lambda a: tf.fused_linear_logprobs(
        a["input"], a["weight"], a["target"], outputs=("log_probs", "entropy", "is_top1"), grad_in_forward=True,
    )[0]
    table.update(_tigon_losses())
    return table


def _tigon_losses() -> OpTable:
    import tigon.losses as tl

    return {
        "kl_div": lambda a: tl.kl_div(a["input"], a["target"], reduction="batchmean"),
        "jsd": lambda a: tl.jsd(a["input"], a["target"]),
        "tvd": lambda a: tl.tvd(a["input"], a["target"]),
        "fused_linear_jsd": lambda a: tl.fused_linear_jsd(**a),
        "dpo": lambda a: tl.fused_linear_dpo(**a)[0],
        "orpo": lambda a: tl.fused_linear_orpo(**a)[0],
        "simpo": lambda a: tl.fused_linear_simpo(**a)[0],
        "kto": lambda a: tl.fused_linear_kto(**a)[0],
        "grpo": lambda a: tl.fused_linear_grpo(**a)[0],
        "grpo_ref": lambda a: tl.fused_linear_grpo(**a)[0],
    }


# The ops PyTorch's reference is timed on as a peer: all but the FP8 losses, whose reference is an
# oracle (see specs.FP8_OPS).
REFERENCE_PEER_OPS = {name: spec for name, spec in OPS.items() if name not in FP8_OPS}


def _allow_a_compile_per_size() -> None:
    # Static shapes: each swept size is compiled once, on its first (warm-up) call. Dynamo's
    # default limit of 8 recompilations per function would otherwise cap a longer sweep.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def _torch() -> OpTable:
    return {name: functools.partial(spec.call, reference) for name, spec in REFERENCE_PEER_OPS.items()}


def _torch_compile() -> OpTable:
    _allow_a_compile_per_size()
    return {
        name: functools.partial(torch.compile(spec.call, dynamic=False), reference)
        for name, spec in REFERENCE_PEER_OPS.items()
    }


def _liger() -> OpTable:
    from liger_kernel.transformers import functional as lf

    return {
        "rms_norm": lambda a: lf.liger_rms_norm(a["x"], a["weight"], 1e-6),
        "fused_add_rms_norm": lambda a: lf.liger_fused_add_rms_norm(a["x"], a["residual"], a["weight"], 1e-6),
        "layer_norm": lambda a: lf.liger_layer_norm(a["x"], a["weight"], a["bias"], 1e-5),
        # Liger's LayerNorm has no offset: the weight + 1 is one more (tiny) op.
        "layer_norm_1p": lambda a: lf.liger_layer_norm(a["x"], a["weight"] + 1.0, a["bias"], 1e-5),
        "rope": lambda a: lf.liger_rope(a["q"], a["k"], a["cos"], a["sin"]),
        "swiglu": lambda a: lf.liger_swiglu(a["gate"], a["up"]),
        "geglu": lambda a: lf.liger_geglu(a["gate"], a["up"]),
        "relu2": lambda a: lf.liger_relu_squared(a["x"]),
        "cross_entropy": lambda a: lf.liger_cross_entropy(a["logits"], a["target"]),
        "fused_linear_cross_entropy": lambda a: lf.liger_fused_linear_cross_entropy(
            a["input"], a["weight"], a["target"]
        ),
        **_liger_losses(),
    }


def _liger_losses() -> OpTable:
    from liger_kernel.transformers import functional as lf
    from liger_kernel.chunked_loss import (
        LigerFusedLinearDPOLoss,
        LigerFusedLinearGRPOLoss,
        LigerFusedLinearKTOLoss,
        LigerFusedLinearORPOLoss,
        LigerFusedLinearSimPOLoss,
    )

    # Options set to the same formulas as tigon's defaults (Liger's SimPO adds α·NLL by default,
    # and its KTO module ignores the reference model unless told to use it).
    dpo, orpo = LigerFusedLinearDPOLoss(beta=0.1), LigerFusedLinearORPOLoss(beta=0.1)
    simpo = LigerFusedLinearSimPOLoss(beta=2.0, gamma=0.5, alpha=0.0)
    kto = LigerFusedLinearKTOLoss(beta=0.1, use_ref_model=True)
    return {
        "kl_div": lambda a: lf.liger_kl_div(a["input"], a["target"], reduction="batchmean"),
        "jsd": lambda a: lf.liger_jsd(a["input"], a["target"]),
        "tvd": lambda a: lf.liger_tvd(a["input"], a["target"], reduction="batchmean"),
        "fused_linear_jsd": lambda a: lf.liger_fused_linear_jsd(
            a["input"], a["weight"], a["teacher_input"], a["teacher_weight"]
        ),
        "dpo": lambda a: dpo(a["weight"], a["input"], a["target"], None, a["ref_input"], a["ref_weight"])[0],
        "orpo": lambda a: orpo(a["weight"], a["input"], a["target"])[0],
        "simpo": lambda a: simpo(a["weight"], a["input"], a["target"])[0],
        "kto": lambda a: kto(
            a["input"], a["weight"], a["target"], None, a["preference_labels"], a["ref_input"], a["ref_weight"],
        )[0],
        "grpo": _liger_grpo(LigerFusedLinearGRPOLoss, beta=0.0),
        "grpo_ref": _liger_grpo(LigerFusedLinearGRPOLoss, beta=0.04),
    }


def _liger_eager() -> OpTable:
    """Liger's GRPO loss with its chunk function left uncompiled (``compiled=False``): its default
    torch.compile failed or recompiled in tigon bench's sweep (docs/perf-notes/grpo.md)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    return {
        "grpo": _liger_grpo(LigerFusedLinearGRPOLoss, beta=0.0, compiled=False),
        "grpo_ref": _liger_grpo(LigerFusedLinearGRPOLoss, beta=0.04, compiled=False),
    }


def _liger_grpo(loss_class, beta, compiled=True):
    # The reference model's log-probs are given precomputed, as to tigon.
    loss_fn = loss_class(beta=beta, use_ref_model=beta != 0.0, loss_type="dapo", compiled=compiled)
    return lambda a: loss_fn(
        a["input"], a["weight"], a["completion_ids"], a["completion_mask"], a["advantages"], None,
        a["ref_per_token_logps"], a["old_per_token_logps"],
    )[0]


def _trl() -> OpTable:
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    def head(outputs):
        # As add_fused_lm_head's forward calls it (the rows are already the labelled ones).
        return lambda a: ChunkedLogProbFunction.apply(
            a["input"], a["weight"], None, a["target"], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, outputs,
        )[0]

    def grpo(a):
        # TRL's GRPOTrainer: its head on the completion tokens, then its loss on the log-probs.
        mask = a["completion_mask"]
        log_probs = ChunkedLogProbFunction.apply(
            a["input"][mask], a["weight"], None, a["completion_ids"][mask], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE,
            None, 1.0, ("log_probs",),
        )[0]
        per_token_logps = log_probs.new_zeros(mask.shape).masked_scatter(mask, log_probs)
        options = {k: a[k] for k in ("old_per_token_logps", "ref_per_token_logps", "beta")}
        return reference.grpo_loss_from_logps(per_token_logps, mask, a["advantages"], **options)[0]

    return {
        "fused_linear_logprobs": head(("log_probs",)),
        "fused_linear_logprobs_sft": head(("log_probs", "entropy", "is_top1")),
        "grpo": grpo,
        "grpo_ref": grpo,
    }


def _cut_cross_entropy() -> OpTable:
    from cut_cross_entropy import linear_cross_entropy

    return {"fused_linear_cross_entropy": lambda a: linear_cross_entropy(a["input"], a["weight"], a["target"])}


def _torchao(compiled: bool = False) -> OpTable:
    """torchao's float8 training as a user of it computes the loss: the head a ``Float8Linear`` (of
    the op's recipe) giving the whole bf16 logits, then PyTorch's cross entropy over them in fp32;
    ``compiled``: that under ``torch.compile``, which fuses torchao's casts (as torchtitan runs it)."""
    import torch.nn.functional as F
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    # The head of the case being timed, per recipe: (its weight, the module). Only the current
    # case's is kept, so that an earlier case's weight is freed with it.
    heads: dict[str, tuple[torch.Tensor, Float8Linear]] = {}

    def head(weight: torch.Tensor, recipe: str) -> Float8Linear:
        # Made once per case: its Parameter shares the case's weight storage.
        if recipe not in heads or heads[recipe][0] is not weight:
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            linear.weight = torch.nn.Parameter(weight.detach(), requires_grad=weight.requires_grad)
            heads[recipe] = (weight, Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name(recipe)))
        return heads[recipe][1]

    def head_loss(linear: Float8Linear, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(linear(x).float(), target)

    if compiled:
        _allow_a_compile_per_size()
        head_loss = torch.compile(head_loss, dynamic=False)

    def loss(recipe: str):
        return lambda a: head_loss(head(a["weight"], recipe), a["input"], a["target"])

    return {name: loss(recipe) for name, recipe in FP8_OPS.items()}


def _quack() -> OpTable:
    if torch.cuda.get_device_capability()[0] < 9:
        raise RuntimeError("Quack's CuTe DSL kernels need a Hopper (sm_90) or newer GPU")
    import quack

    return {
        "rms_norm": lambda a: quack.rmsnorm(a["x"], a["weight"], eps=1e-6),
        "cross_entropy": lambda a: quack.cross_entropy(a["logits"], a["target"]),
    }


PROVIDERS: dict[str, Provider] = {
    provider.name: provider
    for provider in (
        Provider(
            "tigon", _tigon,
            grads_in_forward=frozenset({
                "cross_entropy", "fused_linear_cross_entropy", *FP8_OPS, "fused_linear_logprobs",
                "fused_linear_logprobs_sft", *LOSSES,
            }),
        ),
        Provider("torch", _torch),
        Provider("torch.compile", _torch_compile, in_smoke_run=False),
        Provider(
            "liger", _liger, distribution="liger-kernel", needs_gpu=True,
            grads_in_forward=frozenset({"cross_entropy", "fused_linear_cross_entropy", *LOSSES}),
        ),
        Provider(
            "liger-eager", _liger_eager, distribution="liger-kernel", needs_gpu=True,
            grads_in_forward=frozenset({"grpo", "grpo_ref"}),
        ),
        Provider("trl", _trl, distribution="trl"),
        Provider("cce", _cut_cross_entropy, distribution="cut-cross-entropy", needs_gpu=True),
        Provider("quack", _quack, distribution="quack-kernels", needs_gpu=True),
        Provider("torchao", _torchao, distribution="torchao"),
        Provider("torchao.compile", functools.partial(_torchao, compiled=True), distribution="torchao",
                 in_smoke_run=False),
    )
}


def load_providers(names: list[str], on_gpu: bool) -> tuple[dict[str, OpTable], dict[str, str]]:
    """Load the named providers: ``({name: table}, {name: why it was skipped})``."""
    tables, skipped = {}, {}
    for name in names:
        provider = PROVIDERS[name]
        if provider.needs_gpu and not on_gpu:
            skipped[name] = "needs a CUDA device"
            continue
        try:
            tables[name] = provider.load()
        except ImportError as error:
            hint = f" (pip install {provider.distribution})" if provider.distribution else ""
            skipped[name] = f"not importable: {error}{hint}"
        except RuntimeError as error:
            skipped[name] = str(error)
    return tables, skipped
