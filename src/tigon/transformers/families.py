"""The patch table: one row per Hugging Face model family, naming what tigon replaces.

A row says where things live in the family's modeling module (class and function names, looked up
when a patch is applied, so a renamed one fails with a clear error rather than at import) and
the few settings in which families differ. Adding a family is adding a row: the patching code and
the causal-LM loss wrapper are shared by all. Written against transformers 5.17.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """Where a family's layers live and how they differ.

    Attributes:
        model_type: ``config.model_type`` of the models this row patches.
        module: the modeling module, e.g. ``transformers.models.llama.modeling_llama``.
        causal_lm: the ``...ForCausalLM`` class whose forward gets tigon's loss.
        rms_norm: the RMSNorm class, or ``None``.
        rms_norm_eps: the attribute in which that class keeps its epsilon.
        rms_norm_offset: added to the weight: ``1.0`` for Gemma's ``(1 + weight)``.
        rms_norm_casting: ``"llama"`` (round to the input dtype, then scale by the weight) or
            ``"gemma"`` (scale in fp32, round once), as the family's own RMSNorm does.
        rope: the module-level rotary function the attention calls, or ``None``.
        mlp: the dense MLP class, or ``None`` (Mixtral: its experts keep their own forward).
        mlp_layout: ``"separate"`` (``gate_proj``, ``up_proj``, ``down_proj``) or ``"gate_up"``
            (one ``gate_up_proj`` producing ``[gate | up]``, then ``down_proj``).
        gate: ``"swiglu"`` or ``"geglu"``: the MLP's gate kernel, and the name of its flag.
        activation: the config field naming the MLP activation (checked against ``gate``).
        logit_softcap: config field of a final ``cap · tanh(logits / cap)`` (Gemma 2, 3).
        logit_divisor: config field the logits are divided by (Granite's ``logits_scaling``).
        aux_loss_coef: attribute of the causal LM weighting the MoE router loss, which its
            forward adds to the loss when labels are given.
    """

    model_type: str
    module: str
    causal_lm: str
    rms_norm: str | None
    mlp: str | None
    rms_norm_eps: str = "variance_epsilon"
    rms_norm_offset: float = 0.0
    rms_norm_casting: str = "llama"
    rope: str | None = "apply_rotary_pos_emb"
    mlp_layout: str = "separate"
    gate: str = "swiglu"
    activation: str = "hidden_act"
    logit_softcap: str | None = None
    logit_divisor: str | None = None
    aux_loss_coef: str | None = None


def _module(package: str) -> str:
    return f"transformers.models.{package}.modeling_{package}"


_GEMMA = dict(rms_norm_eps="eps", rms_norm_offset=1.0, rms_norm_casting="gemma", gate="geglu")
_MOE = dict(aux_loss_coef="router_aux_loss_coef")

FAMILIES: dict[str, Family] = {
    row.model_type: row
    for row in (
        Family("llama", _module("llama"), "LlamaForCausalLM", "LlamaRMSNorm", "LlamaMLP"),
        Family("mistral", _module("mistral"), "MistralForCausalLM", "MistralRMSNorm", "MistralMLP"),
        Family("mixtral", _module("mixtral"), "MixtralForCausalLM", "MixtralRMSNorm", None, **_MOE),
        Family("qwen2", _module("qwen2"), "Qwen2ForCausalLM", "Qwen2RMSNorm", "Qwen2MLP"),
        Family("qwen3", _module("qwen3"), "Qwen3ForCausalLM", "Qwen3RMSNorm", "Qwen3MLP"),
        # The MoE layers' experts keep their own forward; the dense layers' MLP is patched.
        Family("qwen3_moe", _module("qwen3_moe"), "Qwen3MoeForCausalLM", "Qwen3MoeRMSNorm", "Qwen3MoeMLP", **_MOE),
        Family("gemma", _module("gemma"), "GemmaForCausalLM", "GemmaRMSNorm", "GemmaMLP", **_GEMMA),
        Family(
            "gemma2", _module("gemma2"), "Gemma2ForCausalLM", "Gemma2RMSNorm", "Gemma2MLP",
            activation="hidden_activation", logit_softcap="final_logit_softcapping", **_GEMMA,
        ),
        Family(
            "gemma3_text", _module("gemma3"), "Gemma3ForCausalLM", "Gemma3RMSNorm", "Gemma3MLP",
            activation="hidden_activation", logit_softcap="final_logit_softcapping", **_GEMMA,
        ),
        # Phi-3 rotates only the first partial_rotary_factor · head_dim features of each head.
        Family("phi3", _module("phi3"), "Phi3ForCausalLM", "Phi3RMSNorm", "Phi3MLP", mlp_layout="gate_up"),
        # OLMo 2 scales by the weight in fp32 before rounding, as Gemma does, but without the offset.
        Family("olmo2", _module("olmo2"), "Olmo2ForCausalLM", "Olmo2RMSNorm", "Olmo2MLP", rms_norm_casting="gemma"),
        Family(
            "granite", _module("granite"), "GraniteForCausalLM", "GraniteRMSNorm", "GraniteMLP",
            logit_divisor="logits_scaling",
        ),
    )
}
