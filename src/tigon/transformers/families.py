"""The patch table: one row per Hugging Face model family, naming what tigon replaces.

A row says where things live in the family's modeling module and how its layers differ, as
sub-rows of four kinds: the norms (:class:`Norm`), the MLPs (:class:`Mlp`), the rotary functions
(:class:`Rope`) and the mixture-of-experts experts (:class:`Experts`), each naming a class or
function of the module (looked up when a patch is applied, so a renamed one fails with a clear
error rather than at import) and which of tigon's kernel variants computes it. The loss settings
(logit softcap, scaling, the MoE router loss) are config fields of the row's head class. The patching code, the layers and the causal-LM loss
wrapper are shared by all; adding a family is adding a row.

Vision-language models are composed: a row patches the layers of its own module, and a model
patched by it has every sub-model whose ``config.model_type`` has a row of its own (Llava's
language model, Mistral 3's Pixtral vision tower) patched by that row as well.

The table holds for every transformers of :data:`SUPPORTED_RANGE`, and is applied to newer ones
too. A piece of a row that a version lacks (a family newer than it, a class it names otherwise, a rotary function of
another signature) is left unpatched with a warning when a patch is applied
(:class:`tigon.transformers.patching.MissingInTransformersWarning`); a class renamed between
supported versions is a row's ``former_names``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tigon._versions import tested_range

# The transformers releases the table is tested with (tigon._versions.TESTED): from 5.6 (LLaMA-Factory
# 0.9.5's newest) to the newest that CI's newest-releases job passed.
SUPPORTED_RANGE = tested_range("transformers")


@dataclass(frozen=True)
class Norm:
    """A norm class and the kernel variant that computes it.

    Attributes:
        name: the class in the family's modeling module; a dotted name (``"torch.nn.LayerNorm"``)
            is a class of another library, whose instances in the model are patched but which is
            never replaced in any module.
        kind: ``"rms"`` (:func:`tigon.functional.rms_norm`), ``"rms_gated"`` (the gated RMSNorm
            of linear-attention and Mamba mixers, :func:`tigon.functional.rms_norm_gated`) or
            ``"layer"`` (:func:`tigon.functional.layer_norm`).
        eps: the attribute in which the class keeps its epsilon.
        offset: added to the weight: ``1.0`` for Gemma's ``(1 + weight)``, Nemotron's LayerNorm1P.
        casting: for RMSNorms, ``"llama"`` (round to the input dtype, then scale by the weight)
            or ``"gemma"`` (scale in fp32, round once), as the class does.
    """

    name: str
    kind: str = "rms"
    eps: str = "variance_epsilon"
    offset: float = 0.0
    casting: str = "llama"

    @property
    def flag(self) -> str:
        return "layer_norm" if self.kind == "layer" else "rms_norm"


@dataclass(frozen=True)
class Mlp:
    """An MLP (or experts) class and the activation kernel fused into it.

    Attributes:
        name: the class in the family's modeling module.
        layout: ``"separate"`` (``gate_proj``, ``up_proj``, ``down_proj``), ``"gate_up"`` (one
            ``gate_up_proj`` giving ``[gate | up]``, then ``down_proj``), ``"up_down"`` (no gate:
            ``down_proj(act(up_proj(x)))``) or ``"experts"`` (GPT-OSS's experts, whose
            ``_apply_gate`` is replaced).
        gate: the kernel: ``"swiglu"``, ``"geglu"``, ``"relu2"`` (squared ReLU) or
            ``"swiglu_clamped"`` (GPT-OSS).
    """

    name: str
    layout: str = "separate"
    gate: str = "swiglu"

    @property
    def flag(self) -> str:
        return "swiglu" if self.gate == "swiglu_clamped" else self.gate


@dataclass(frozen=True)
class Rope:
    """A module-level rotary function and the drop-in replacing it.

    Attributes:
        name: the function in the family's modeling module, called by its attention layers.
        form: the key of :data:`tigon.transformers.layers.ROPE_FORMS`: the function's signature
            and pair layout (``"rotate_half"`` is Llama's ``apply_rotary_pos_emb``).
        former_forms: ``((last (major, minor), form), ...)``, oldest first: the form of the
            function up to that transformers release, where an older one computed it otherwise
            under the same name (GLM-4V's up to 5.16).
    """

    name: str = "apply_rotary_pos_emb"
    form: str = "rotate_half"
    former_forms: tuple[tuple[tuple[int, int], str], ...] = ()
    flag = "rope"


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts experts class, which transformers dispatches on its config's
    ``experts_implementation`` (it is decorated ``use_experts_implementation``): its models get
    ``"tigon"``, :func:`tigon.functional.moe_experts` (see :mod:`tigon.transformers.moe` for the
    gates and layouts it computes).

    Attributes:
        name: the class in the family's modeling module.
        former_names: its names in older transformers of the supported range (DeepSeek V3's
            ``DeepseekV3NaiveMoe`` in 5.6), tried in turn when ``name`` is missing.
    """

    name: str
    former_names: tuple[str, ...] = ()
    flag = "experts"


@dataclass(frozen=True)
class NormInput:
    """A decoder layer's norm whose output only some projections of one sibling module read: the
    norm may then hand them the FP8 tensor they take (``TigonRMSNorm``, under torchao's float8).

    Attributes:
        norm: the norm's attribute in the layer.
        module: the attribute of the module that holds the projections.
        projections: the projections' attributes in that module.
    """

    norm: str
    module: str
    projections: tuple[str, ...]


# A pre-norm decoder layer: its first norm feeds the attention's q, k and v projections alone,
# its second the MLP's gate and up projections.
PRE_NORM_INPUTS = (
    NormInput("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj")),
    NormInput("post_attention_layernorm", "mlp", ("gate_proj", "up_proj")),
)


@dataclass(frozen=True)
class Family:
    """Where a family's layers live, and its loss settings.

    Attributes:
        model_type: ``config.model_type`` of the models this row patches.
        module: the modeling module, e.g. ``transformers.models.llama.modeling_llama``.
        head: the ``...ForCausalLM`` or ``...ForConditionalGeneration`` class whose forward gets
            tigon's loss, or ``None`` (a vision tower, patched inside the model that holds it).
        norms, mlps, ropes, experts: the sub-rows.
        logit_softcap: text-config field of a final ``cap · tanh(logits / cap)``.
        logit_divisor: text-config field the logits are divided by (Granite's ``logits_scaling``).
        logit_multiplier: text-config field the logits are multiplied by (Falcon-H1, MuseGlimmer).
        aux_loss_coef: text-config field weighting the MoE router loss, which the head's forward
            adds to the loss when labels are given.
        norm_inputs: the norms whose readers the decoder layer's code fixes (:class:`NormInput`).
    """

    model_type: str
    module: str
    head: str | None
    norms: tuple[Norm, ...] = ()
    mlps: tuple[Mlp, ...] = ()
    ropes: tuple[Rope, ...] = (Rope(),)
    experts: tuple[Experts, ...] = ()
    logit_softcap: str | None = None
    logit_divisor: str | None = None
    logit_multiplier: str | None = None
    aux_loss_coef: str | None = None
    norm_inputs: tuple[NormInput, ...] = ()

    def sub_rows(self):
        return (*self.norms, *self.mlps, *self.ropes, *self.experts)


def _module(package: str, name: str | None = None) -> str:
    return f"transformers.models.{package}.modeling_{name or package}"


def _llama_like(model_type, prefix, head="ForCausalLM", package=None, **settings):
    """The commonest row: ``<Prefix>RMSNorm``, ``<Prefix>MLP``, the rotate-half RoPE and
    pre-norm decoder layers."""
    settings.setdefault("norm_inputs", PRE_NORM_INPUTS)
    return Family(
        model_type, _module(package or model_type), f"{prefix}{head}",
        norms=(Norm(f"{prefix}RMSNorm"),), mlps=(Mlp(f"{prefix}MLP"),), **settings,
    )


# Gemma's RMSNorm: epsilon in `eps`, (1 + weight) scaled in fp32; OLMo 2/3 and GPT-OSS scale in
# fp32 without the offset.
_GEMMA_NORM = dict(eps="eps", offset=1.0, casting="gemma")
_FP32_SCALED_NORM = dict(casting="gemma")
_SOFTCAP = dict(logit_softcap="final_logit_softcapping")
_ROUTER_LOSS = dict(aux_loss_coef="router_aux_loss_coef")
# Vision towers built from torch's LayerNorm (CLIP, SigLIP, the Qwen-VL and Llama 4 towers).
_TORCH_LAYER_NORM = Norm("torch.nn.LayerNorm", kind="layer", eps="eps")


def _qwen3_next_norms(prefix):
    """Qwen3-Next and Qwen3.5: Gemma-style RMSNorms, and the gated RMSNorm of the linear attention."""
    return Norm(f"{prefix}RMSNorm", **_GEMMA_NORM), Norm(f"{prefix}RMSNormGated", kind="rms_gated")


FAMILIES: dict[str, Family] = {
    row.model_type: row
    for row in (
        # Dense text models.
        _llama_like("llama", "Llama"),
        _llama_like("mistral", "Mistral"),
        _llama_like("ministral", "Ministral"),
        _llama_like("qwen2", "Qwen2"),
        _llama_like("qwen3", "Qwen3"),
        # EXAONE 4 normalises the attention's and the MLP's outputs (post-norm layers).
        _llama_like("exaone4", "Exaone4", norm_inputs=()),
        _llama_like("smollm3", "SmolLM3"),
        _llama_like("hunyuan_v1_dense", "HunYuanDenseV1"),
        _llama_like("granite", "Granite", logit_divisor="logits_scaling"),
        # OLMo 2 and 3 scale by the weight in fp32 before rounding, as Gemma does, without the offset.
        Family(
            "olmo2", _module("olmo2"), "Olmo2ForCausalLM",
            norms=(Norm("Olmo2RMSNorm", **_FP32_SCALED_NORM),), mlps=(Mlp("Olmo2MLP"),),
        ),
        Family(
            "olmo3", _module("olmo3"), "Olmo3ForCausalLM",
            norms=(Norm("Olmo3RMSNorm", **_FP32_SCALED_NORM),), mlps=(Mlp("Olmo3MLP"),),
        ),
        # Phi-3 rotates only the first partial_rotary_factor · head_dim features of each head.
        Family(
            "phi3", _module("phi3"), "Phi3ForCausalLM",
            norms=(Norm("Phi3RMSNorm"),), mlps=(Mlp("Phi3MLP", layout="gate_up"),),
        ),
        # GLM-4 rotates interleaved pairs of its first half, one angle per pair.
        Family(
            "glm4", _module("glm4"), "Glm4ForCausalLM", norms=(Norm("Glm4RMSNorm"),),
            mlps=(Mlp("Glm4MLP", layout="gate_up"),), ropes=(Rope(form="glm"),),
        ),
        Family(
            "gemma", _module("gemma"), "GemmaForCausalLM",
            norms=(Norm("GemmaRMSNorm", **_GEMMA_NORM),), mlps=(Mlp("GemmaMLP", gate="geglu"),),
        ),
        Family(
            "gemma2", _module("gemma2"), "Gemma2ForCausalLM",
            norms=(Norm("Gemma2RMSNorm", **_GEMMA_NORM),), mlps=(Mlp("Gemma2MLP", gate="geglu"),), **_SOFTCAP,
        ),
        Family(
            "gemma3_text", _module("gemma3"), "Gemma3ForCausalLM",
            norms=(Norm("Gemma3RMSNorm", **_GEMMA_NORM),), mlps=(Mlp("Gemma3MLP", gate="geglu"),), **_SOFTCAP,
        ),
        # Gemma 4 rotates q and k in separate calls; its norms may have no weight.
        Family(
            "gemma4_text", _module("gemma4"), "Gemma4ForCausalLM",
            norms=(Norm("Gemma4RMSNorm", eps="eps", casting="gemma"),), mlps=(Mlp("Gemma4TextMLP", gate="geglu"),),
            ropes=(Rope(form="single"),), experts=(Experts("Gemma4TextExperts"),), **_SOFTCAP,
        ),
        # Nemotron: LayerNorm with (1 + weight), and a squared-ReLU MLP without a gate.
        Family(
            "nemotron", _module("nemotron"), "NemotronForCausalLM",
            norms=(Norm("NemotronLayerNorm1P", kind="layer", eps="eps", offset=1.0),),
            mlps=(Mlp("NemotronMLP", layout="up_down", gate="relu2"),),
        ),
        # Falcon-H1's MLP scales the gate's input and the output by config multipliers: not patched.
        Family(
            "falcon_h1", _module("falcon_h1"), "FalconH1ForCausalLM",
            norms=(Norm("FalconH1RMSNorm"), Norm("FalconH1RMSNormGated", kind="rms_gated", casting="gemma")),
            logit_multiplier="lm_head_multiplier",
        ),
        Family(
            "qwen3_next", _module("qwen3_next"), "Qwen3NextForCausalLM", norms=_qwen3_next_norms("Qwen3Next"),
            mlps=(Mlp("Qwen3NextMLP"),), experts=(Experts("Qwen3NextExperts"),), **_ROUTER_LOSS,
        ),
        Family(
            "qwen3_5_text", _module("qwen3_5"), "Qwen3_5ForCausalLM", norms=_qwen3_next_norms("Qwen3_5"),
            mlps=(Mlp("Qwen3_5MLP"),),
        ),
        # DeepSeek V2 rotates complex interleaved pairs; V3 either layout, by config.rope_interleave.
        Family(
            "deepseek_v2", _module("deepseek_v2"), "DeepseekV2ForCausalLM", norms=(Norm("DeepseekV2RMSNorm"),),
            mlps=(Mlp("DeepseekV2MLP"),), ropes=(Rope("apply_rotary_emb", form="complex_bhtd"),),
            experts=(Experts("DeepseekV2Experts"),),
        ),
        Family(
            "deepseek_v3", _module("deepseek_v3"), "DeepseekV3ForCausalLM", norms=(Norm("DeepseekV3RMSNorm"),),
            mlps=(Mlp("DeepseekV3MLP"),),
            ropes=(Rope(), Rope("apply_rotary_pos_emb_interleave", form="deepseek_interleave")),
            experts=(Experts("DeepseekV3Experts", former_names=("DeepseekV3NaiveMoe",)),),
        ),
        # DeepSeek V4's MLP and experts clamp gate and up before SiLU: not patched.
        Family(
            "deepseek_v4", _module("deepseek_v4"), "DeepseekV4ForCausalLM",
            norms=(Norm("DeepseekV4RMSNorm"), Norm("DeepseekV4UnweightedRMSNorm", eps="eps")),
            ropes=(Rope(form="deepseek_v4"),), **_ROUTER_LOSS,
        ),
        # Mixture-of-experts text models: the experts by tigon's fused kernel, through transformers'
        # experts interface (GPT-OSS's gate is also patched, for when they run another one); dense
        # layers' MLPs and shared experts are patched.
        Family(
            "mixtral", _module("mixtral"), "MixtralForCausalLM", norms=(Norm("MixtralRMSNorm"),),
            experts=(Experts("MixtralExperts"),), **_ROUTER_LOSS,
        ),
        _llama_like("qwen3_moe", "Qwen3Moe", experts=(Experts("Qwen3MoeExperts"),), **_ROUTER_LOSS),
        _llama_like(
            "glm4_moe", "Glm4Moe", experts=(Experts("Glm4MoeExperts", former_names=("Glm4MoeNaiveMoe",)),),
        ),
        _llama_like("hunyuan_v1_moe", "HunYuanMoEV1", experts=(Experts("HunYuanMoEV1Experts"),)),
        Family(
            "qwen3_5_moe_text", _module("qwen3_5_moe"), "Qwen3_5MoeForCausalLM",
            norms=_qwen3_next_norms("Qwen3_5Moe"), mlps=(Mlp("Qwen3_5MoeMLP"),),
            experts=(Experts("Qwen3_5MoeExperts"),), **_ROUTER_LOSS,
        ),
        Family(
            "gpt_oss", _module("gpt_oss"), "GptOssForCausalLM", norms=(Norm("GptOssRMSNorm", **_FP32_SCALED_NORM),),
            mlps=(Mlp("GptOssExperts", layout="experts", gate="swiglu_clamped"),), ropes=(Rope(form="half_table"),),
            experts=(Experts("GptOssExperts"),), **_ROUTER_LOSS,
        ),
        # Vision towers, patched inside the vision-language models that hold them.
        Family(
            "pixtral", _module("pixtral"), None, norms=(Norm("PixtralRMSNorm"),), mlps=(Mlp("PixtralMLP"),),
        ),
        # Vision-language models. Llava, InternVL, Mistral 3, PaliGemma and SmolVLM hold a language
        # model (and Mistral 3 a vision tower) of a family of their own, patched by its row.
        Family("llava", _module("llava"), "LlavaForConditionalGeneration", norms=(_TORCH_LAYER_NORM,), ropes=()),
        Family(
            "internvl", _module("internvl"), "InternVLForConditionalGeneration",
            norms=(Norm("InternVLVisionRMSNorm"), _TORCH_LAYER_NORM), ropes=(),
        ),
        Family(
            "mistral3", _module("mistral3"), "Mistral3ForConditionalGeneration", norms=(Norm("Mistral3RMSNorm"),),
            ropes=(),
        ),
        Family(
            "paligemma", _module("paligemma"), "PaliGemmaForConditionalGeneration", norms=(_TORCH_LAYER_NORM,),
            ropes=(),
        ),
        Family("smolvlm", _module("smolvlm"), "SmolVLMForConditionalGeneration", norms=(_TORCH_LAYER_NORM,), ropes=()),
        Family(
            "gemma3", _module("gemma3"), "Gemma3ForConditionalGeneration",
            norms=(Norm("Gemma3RMSNorm", **_GEMMA_NORM), _TORCH_LAYER_NORM), mlps=(Mlp("Gemma3MLP", gate="geglu"),),
        ),
        Family(
            "gemma4", _module("gemma4"), "Gemma4ForConditionalGeneration",
            norms=(Norm("Gemma4RMSNorm", eps="eps", casting="gemma"),),
            mlps=(Mlp("Gemma4TextMLP", gate="geglu"), Mlp("Gemma4VisionMLP", gate="geglu")),
            ropes=(Rope(form="single"),), experts=(Experts("Gemma4TextExperts"),), **_SOFTCAP,
        ),
        Family(
            "llama4", _module("llama4"), "Llama4ForConditionalGeneration",
            norms=(Norm("Llama4TextRMSNorm", eps="eps"), _TORCH_LAYER_NORM), mlps=(Mlp("Llama4TextMLP"),),
            ropes=(Rope("apply_rotary_emb", form="complex_bthd"),),
        ),
        Family(
            "mllama", _module("mllama"), "MllamaForConditionalGeneration",
            norms=(Norm("MllamaTextRMSNorm"), _TORCH_LAYER_NORM), mlps=(Mlp("MllamaTextMLP"),),
        ),
        Family(
            "muse_glimmer", _module("muse_glimmer"), "MuseGlimmerForConditionalGeneration",
            norms=(
                Norm("MuseGlimmerRMSNorm", eps="eps", casting="gemma"),
                Norm("MuseGlimmerTextCenteredRMSNorm", **_GEMMA_NORM),
            ),
            mlps=(Mlp("MuseGlimmerTextMLP"),), logit_multiplier="output_multiplier", **_SOFTCAP,
        ),
        Family(
            "qwen2_vl", _module("qwen2_vl"), "Qwen2VLForConditionalGeneration",
            norms=(Norm("Qwen2VLRMSNorm"), _TORCH_LAYER_NORM), mlps=(Mlp("Qwen2MLP"),),
        ),
        Family(
            "qwen2_5_vl", _module("qwen2_5_vl"), "Qwen2_5_VLForConditionalGeneration",
            norms=(Norm("Qwen2_5_VLRMSNorm"),), mlps=(Mlp("Qwen2MLP"), Mlp("Qwen2_5_VLMLP")),
        ),
        Family(
            "qwen3_vl", _module("qwen3_vl"), "Qwen3VLForConditionalGeneration",
            norms=(Norm("Qwen3VLTextRMSNorm"), _TORCH_LAYER_NORM), mlps=(Mlp("Qwen3VLTextMLP"),),
        ),
        Family(
            "qwen3_vl_moe", _module("qwen3_vl_moe"), "Qwen3VLMoeForConditionalGeneration",
            norms=(Norm("Qwen3VLMoeTextRMSNorm"), _TORCH_LAYER_NORM), mlps=(Mlp("Qwen3VLMoeTextMLP"),),
            experts=(Experts("Qwen3VLMoeTextExperts"),), **_ROUTER_LOSS,
        ),
        Family(
            "qwen3_5", _module("qwen3_5"), "Qwen3_5ForConditionalGeneration",
            norms=(*_qwen3_next_norms("Qwen3_5"), _TORCH_LAYER_NORM), mlps=(Mlp("Qwen3_5MLP"),),
        ),
        Family(
            "qwen3_5_moe", _module("qwen3_5_moe"), "Qwen3_5MoeForConditionalGeneration",
            norms=(*_qwen3_next_norms("Qwen3_5Moe"), _TORCH_LAYER_NORM), mlps=(Mlp("Qwen3_5MoeMLP"),),
            experts=(Experts("Qwen3_5MoeExperts"),), **_ROUTER_LOSS,
        ),
        # GLM-4V rotates interleaved pairs, each feature by its own entry of the table (up to
        # transformers 5.16 as GLM-4 does, one angle per pair from the table's first half).
        Family(
            "glm4v", _module("glm4v"), "Glm4vForConditionalGeneration", norms=(Norm("Glm4vRMSNorm"),),
            mlps=(Mlp("Glm4vTextMLP", layout="gate_up"), Mlp("Glm4VisionMlp")),
            ropes=(Rope(form="glm4v", former_forms=(((5, 16), "glm"),)),),
        ),
        Family(
            "glm4v_moe", _module("glm4v_moe"), "Glm4vMoeForConditionalGeneration",
            norms=(Norm("Glm4vMoeTextRMSNorm"), Norm("Glm4vMoeRMSNorm")),
            mlps=(Mlp("Glm4vMoeTextMLP"), Mlp("Glm4vMoeisionMlp")),
            experts=(Experts("Glm4vMoeTextExperts", former_names=("Glm4vMoeTextNaiveMoe",)),),
            **_ROUTER_LOSS,
        ),
    )
}
