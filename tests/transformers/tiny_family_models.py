"""Tiny, randomly initialised models of the families tigon is adding (text, MoE and
vision-language), and batches for them; nothing is downloaded.

``TINY_FAMILIES`` is keyed by the ``config.model_type`` of the model that ``apply_tigon`` receives
(the outer model's: ``"qwen2_vl"`` for ``Qwen2VLForConditionalGeneration``), in the style of
``TINY`` in tiny_models.py. One exception: ``"pixtral"`` is a ``LlavaForConditionalGeneration``
(model_type ``"llava"``) with a Pixtral vision tower, Pixtral-12B's real structure, since
``PixtralVisionModel`` has no language-model head.

Sizes come from ``pick``: on the CPU a hidden size of 32 (64 for the multimodal-RoPE text models
without a head_dim option), vocabulary 160, sequences of 16, 2 layers, vision towers of width 32
and 2 layers on images of a few 14- or 16-pixel patches a side, 4 image tokens each; on the GPU a
hidden size of 1024, vocabulary 32000, sequences of 512, vision towers of width 256 and 64 image
tokens per image.

Every family runs on the CPU in fp32 (sdpa attention, eager for DeepSeek-V4 and gpt-oss, whose
attention sinks sdpa does not take). The hybrid families' linear-attention layers (qwen3_next,
qwen3_5*: Gated DeltaNet with a causal conv1d) and Mamba-2 mixers (falcon_h1) use the ``fla`` /
``causal_conv1d`` / ``mamba_ssm`` kernels only where those packages are installed (or hub kernels
are asked for with ``use_kernels``), and Hugging Face's torch implementations otherwise: without
them, as on this project's CPU machine, no CUDA-only kernel is needed.

Images: one per row, its placeholder tokens (``config.image_token_id`` / ``image_token_index``,
wrapped in the family's start / end tokens where it has them) near the start of the row, labelled
-100 as a processor's collator would. The special token ids sit at the top of the vocabulary
(``_SPECIAL``) and text tokens are drawn below them, so no text token is mistaken for one.
"""

from __future__ import annotations

import torch
import transformers

from tiny_models import BATCH, SEQ, VOCAB, _COMMON, _HEAD_DIM
from utils import DEVICE, pick

# ---------------------------------------------------------------------------------------------
# Shared pieces

# The special ids: the last ``_SPECIAL`` ids of the vocabulary. Text is drawn from [3, VOCAB - 8).
_SPECIAL = 8
IMAGE, VIDEO, START, END, AUDIO, EXTRA = (VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4, VOCAB - 5, VOCAB - 6)

# output_router_logits puts the router's load-balancing loss into the training loss (the families
# whose causal LM reads it); 4 experts, top-2.
_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
_EXPERTS = 4
_MOE_INTER = pick(cpu=32, gpu=704)

# Vision towers: width 32 (2 heads of 16) on the CPU; patch grids of 4x4 (16x16 on the GPU).
_V_HIDDEN = pick(cpu=32, gpu=256)
_V_INTER = pick(cpu=64, gpu=1024)
_V_HEADS = pick(cpu=2, gpu=4)
_GRID = pick(cpu=4, gpu=16)  # patches per image side

# Qwen-style wider heads (head_dim 16 on the CPU) where a multimodal RoPE splits the rotary
# frequencies into (t, h, w) sections: the sections sum to half the rotary dimension.
_VL_HEAD_DIM = pick(cpu=16, gpu=128)
_MROPE = pick(cpu=[2, 3, 3], gpu=[16, 24, 24])  # Qwen2-VL / Qwen2.5-VL: sum = head_dim / 2

_SLIDING = pick(cpu=8, gpu=256)  # a window shorter than the sequence, so that it really masks
# A small final-logit softcap where a family has one, so that the tiny model's logits are really
# capped (as TINY does for Gemma 2 and 3; the released Gemma 3 / 4 configs have none).
_SOFTCAP = 0.5


# Vision-tower option sets shared by several families.
_SIGLIP = dict(
    hidden_size=_V_HIDDEN, intermediate_size=_V_INTER, num_hidden_layers=2, num_attention_heads=_V_HEADS,
)
_CLIP = dict(_SIGLIP, model_type="clip_vision_model", projection_dim=_V_HIDDEN)
# SiLU as in Pixtral-12B's and Mistral Small 3.1's towers (PixtralVisionConfig defaults to GELU).
_PIXTRAL = dict(_SIGLIP, model_type="pixtral", head_dim=_V_HIDDEN // _V_HEADS, patch_size=14, hidden_act="silu")

# Text sub-configs of the multimodal-RoPE families without a head_dim option: width 64 on the CPU
# (head_dim 16), so that the (t, h, w) sections of the rotary frequencies are not empty.
_VL_TEXT = dict(hidden_size=pick(cpu=64, gpu=1024), intermediate_size=pick(cpu=128, gpu=2816))
# GLM-4.1V / 4.5V: half of each head rotates, its frequencies in (t, h, w) sections.
_GLM4V_ROPE = dict(
    rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
    mrope_section=pick(cpu=[2, 1, 1], gpu=[8, 12, 12]),
)
_QWEN2_VL_TEXT = dict(_VL_TEXT, rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=_MROPE))
_QWEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
_QWEN3_VL_TEXT = dict(
    head_dim=_VL_HEAD_DIM,
    rope_parameters=dict(
        rope_type="default", rope_theta=5e5, mrope_section=pick(cpu=[4, 2, 2], gpu=[24, 20, 20]),
        mrope_interleaved=True,
    ),
)
_QWEN3_5_TEXT = dict(
    head_dim=pick(cpu=32, gpu=256), layer_types=["linear_attention", "full_attention"],
    linear_key_head_dim=pick(cpu=8, gpu=64), linear_value_head_dim=pick(cpu=8, gpu=64),
    linear_num_key_heads=2, linear_num_value_heads=4,
    rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
        mrope_section=pick(cpu=[2, 1, 1], gpu=[11, 11, 10]), mrope_interleaved=True,
    ),
)
_GEMMA4_TEXT = dict(
    head_dim=_HEAD_DIM, global_head_dim=2 * _HEAD_DIM, sliding_window=_SLIDING, final_logit_softcapping=_SOFTCAP,
    layer_types=["sliding_attention", "full_attention"],
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=pick(cpu=8, gpu=128),
)


def _glm4v_vision():
    return dict(
        depth=2, hidden_size=_V_HIDDEN, intermediate_size=_VL_TEXT["intermediate_size"], num_heads=_V_HEADS,
        out_hidden_size=_VL_TEXT["hidden_size"], image_size=_GRID * 14, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2,
    )


def _qwen3_vision(**options):
    return dict(
        depth=2, hidden_size=_V_HIDDEN, intermediate_size=_V_INTER, num_heads=_V_HEADS,
        out_hidden_size=_COMMON["hidden_size"], patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
        num_position_embeddings=_GRID * _GRID, **options,
    )


def _text(**options):
    """A text sub-config's options: ``_COMMON`` plus ``options``."""
    return {**_COMMON, **options}


# ---------------------------------------------------------------------------------------------
# model_type -> (config class, model class, options), the classes by their names in transformers
# (looked up when a model is built: an older transformers lacks some families). For the
# vision-language families the options hold ``text_config`` / ``vision_config`` dicts (merged one
# level deep with a caller's).

TINY_FAMILIES = {
    # ---- Dense text -------------------------------------------------------------------------
    # DeepSeek-V2: multi-head latent attention (q/kv LoRA, rope and nope parts of each head),
    # layer 0 a dense MLP, layer 1 MoE (4 routed experts, top-2, 1 shared expert). No router aux
    # loss in Hugging Face's DeepseekV2ForCausalLM.
    "deepseek_v2": (
        "DeepseekV2Config", "DeepseekV2ForCausalLM",
        dict(
            q_lora_rank=pick(cpu=16, gpu=384), kv_lora_rank=pick(cpu=16, gpu=256),
            qk_nope_head_dim=pick(cpu=8, gpu=64), qk_rope_head_dim=pick(cpu=8, gpu=32),
            v_head_dim=pick(cpu=8, gpu=64), head_dim=pick(cpu=8, gpu=32),
            num_key_value_heads=_COMMON["num_attention_heads"],  # MLA: one latent K/V per head
            n_routed_experts=_EXPERTS, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=_MOE_INTER, first_k_dense_replace=1, topk_method="greedy",
        ),
    ),
    # DeepSeek-V3: MLA as V2 (interleaved RoPE), sigmoid router with a correction bias; layer 0
    # dense, layer 1 MoE. No router aux loss in Hugging Face's model.
    "deepseek_v3": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        dict(
            q_lora_rank=pick(cpu=16, gpu=384), kv_lora_rank=pick(cpu=16, gpu=256),
            qk_nope_head_dim=pick(cpu=8, gpu=64), qk_rope_head_dim=pick(cpu=8, gpu=32),
            v_head_dim=pick(cpu=8, gpu=64), head_dim=pick(cpu=8, gpu=32),
            num_key_value_heads=_COMMON["num_attention_heads"],
            n_routed_experts=_EXPERTS, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
            moe_intermediate_size=_MOE_INTER, first_k_dense_replace=1,
        ),
    ),
    # DeepSeek-V4 is MoE in every layer (no dense-MLP option): layer 0 "hash_moe" (experts picked
    # by a frozen token-id table, all zeros at init, so every token goes to expert 0), layer 1
    # "moe" (learned sqrt-softplus router, top-2), each with a shared expert (DeepseekV4MLP).
    # Attention: a single shared K=V head, grouped low-rank output projection, per-head sinks, a
    # compressor per layer (layer 0 compressed-sparse with its Lightning indexer, layer 1 heavily
    # compressed), rates 4 and 8 so that a 16-token sequence compresses; the indexer only picks
    # entries (top-k), so its own weights get no gradient from the loss. 4 hyper-connection
    # streams carry the residual. Hugging Face ships it eager-only (the sinks).
    "deepseek_v4": (
        "DeepseekV4Config", "DeepseekV4ForCausalLM",
        dict(
            num_key_value_heads=1, head_dim=pick(cpu=16, gpu=128), q_lora_rank=pick(cpu=16, gpu=384),
            o_groups=2, o_lora_rank=pick(cpu=16, gpu=256), partial_rotary_factor=0.5,
            index_n_heads=2, index_head_dim=pick(cpu=8, gpu=64), index_topk=pick(cpu=2, gpu=64),
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "moe"], sliding_window=_SLIDING, hc_mult=4, hc_sinkhorn_iters=4,
            n_routed_experts=_EXPERTS, n_shared_experts=1, moe_intermediate_size=_MOE_INTER,
            attn_implementation="eager", **_MOE,
        ),
    ),
    # EXAONE 4: QK-norm, post-norms (no pre-norms), layer 0 sliding-window, layer 1 global (NoPE).
    "exaone4": (
        "Exaone4Config", "Exaone4ForCausalLM",
        dict(sliding_window=_SLIDING, layer_types=["sliding_attention", "full_attention"]),
    ),
    # Falcon-H1: every layer is a parallel hybrid, attention and a Mamba-2 mixer side by side;
    # the mixer runs its torch fallback (torch_forward) without the mamba_ssm / causal_conv1d
    # kernels. mamba_rms_norm on, so that the mixer's gated RMSNorm (FalconH1RMSNormGated) is in
    # the model. Embeddings, keys, the MLP's gate input and output and the logits are scaled by
    # config multipliers, all 1.0 by default: set to other values here so that they count.
    "falcon_h1": (
        "FalconH1Config", "FalconH1ForCausalLM",
        dict(
            mamba_d_ssm=pick(cpu=64, gpu=2048), mamba_n_heads=pick(cpu=8, gpu=32), mamba_d_head=pick(cpu=8, gpu=64),
            mamba_d_state=pick(cpu=16, gpu=128), mamba_n_groups=1, mamba_chunk_size=pick(cpu=8, gpu=128),
            mamba_rms_norm=True, embedding_multiplier=2.0, key_multiplier=0.5, mlp_multipliers=[0.75, 0.5],
            lm_head_multiplier=0.5,
        ),
    ),
    # Gemma 4 text: layer 0 sliding window, layer 1 global (wider heads, proportional partial
    # RoPE), per-layer input embeddings (PLE), QK- and V-norms, sandwich norms.
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", _GEMMA4_TEXT),
    # GLM-4: partial rotary (half of each head, interleaved pairs), post-attention and post-MLP
    # norms, fused gate_up MLP.
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=_HEAD_DIM)),
    # Hunyuan dense: QK-norm after RoPE (query_layernorm / key_layernorm).
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(head_dim=_HEAD_DIM)),
    # Ministral: every layer sliding-window by default.
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(head_dim=_HEAD_DIM, sliding_window=_SLIDING)),
    # Nemotron: LayerNorm1P (weight + 1, with bias), a non-gated relu² MLP, partial rotary (half).
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(head_dim=_HEAD_DIM)),
    # OLMo 3: QK-norm over the whole projection, post-norms; layer 0 sliding, layer 1 global.
    "olmo3": (
        "Olmo3Config", "Olmo3ForCausalLM",
        dict(sliding_window=_SLIDING, layer_types=["sliding_attention", "full_attention"]),
    ),
    # Qwen3.5 text (model_type "qwen3_5_text"): layer 0 Gated DeltaNet linear attention (torch
    # fallback for the causal conv1d and the chunked delta rule without fla / causal_conv1d),
    # layer 1 gated full attention with partial (1/4) multimodal RoPE; Gemma-style (1 + weight)
    # RMSNorm, RMSNormGated inside the linear attention.
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _QWEN3_5_TEXT),
    # Qwen3-Next is a MoE (the only dense layer is the one put in mlp_only_layers): layer 0 Gated
    # DeltaNet linear attention (torch fallback) with a dense MLP, layer 1 gated full attention
    # with a sparse MoE block (4 experts, top-2, a gated shared expert). Gemma-style RMSNorm.
    "qwen3_next": (
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(
            head_dim=pick(cpu=32, gpu=256), layer_types=["linear_attention", "full_attention"],
            linear_key_head_dim=pick(cpu=8, gpu=64), linear_value_head_dim=pick(cpu=8, gpu=64),
            linear_num_key_heads=2, linear_num_value_heads=4,
            num_experts=_EXPERTS, moe_intermediate_size=_MOE_INTER, shared_expert_intermediate_size=_MOE_INTER,
            mlp_only_layers=[0], **_MOE,
        ),
    ),
    # SmolLM3: layer 1 is NoPE (no_rope_layer_interval=2 gives no_rope_layers [1, 0]).
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2)),
    # ---- MoE text ---------------------------------------------------------------------------
    # GLM-4.5 (glm4_moe): layer 0 dense, layer 1 MoE (sigmoid router, 4 experts, top-2, one
    # shared expert); partial rotary (half). No router aux loss in Hugging Face's model.
    "glm4_moe": (
        "Glm4MoeConfig", "Glm4MoeForCausalLM",
        dict(
            head_dim=_HEAD_DIM, n_routed_experts=_EXPERTS, n_shared_experts=1, num_experts_per_tok=2,
            n_group=1, topk_group=1, moe_intermediate_size=_MOE_INTER, first_k_dense_replace=1,
        ),
    ),
    # gpt-oss: MoE in every layer (no dense option), experts with biases and a clamped SwiGLU;
    # attention sinks (eager), layer 0 sliding, layer 1 global, YaRN RoPE.
    "gpt_oss": (
        "GptOssConfig", "GptOssForCausalLM",
        dict(
            head_dim=_HEAD_DIM, num_local_experts=_EXPERTS, sliding_window=_SLIDING,
            layer_types=["sliding_attention", "full_attention"], attn_implementation="eager", **_MOE,
        ),
    ),
    # Hunyuan MoE: MoE in every layer (4 experts, top-2) plus a shared MLP; QK-norm. No router
    # aux loss in Hugging Face's model.
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
        dict(head_dim=_HEAD_DIM, num_experts=_EXPERTS, moe_topk=2),
    ),
    # Qwen3.5-MoE text (model_type "qwen3_5_moe_text"): as qwen3_5_text, with a sparse MoE block
    # in every layer (no dense-layer option): 4 experts, top-2, gated shared expert.
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
        dict(
            _QWEN3_5_TEXT, num_experts=_EXPERTS, moe_intermediate_size=_MOE_INTER,
            shared_expert_intermediate_size=_MOE_INTER, **_MOE,
        ),
    ),
    # ---- Vision-language (outer model_type) ------------------------------------------------
    # Gemma 3: SigLIP tower; the projector average-pools the 4x4 patch grid to 2x2 soft tokens
    # (mm_tokens_per_image), RMS-normalises them (Gemma3RMSNorm) and projects them. Images are
    # wrapped in boi / eoi tokens and attend to each other bidirectionally (token_type_ids).
    "gemma3": (
        "Gemma3Config", "Gemma3ForConditionalGeneration",
        dict(
            text_config=_text(
                head_dim=_HEAD_DIM, query_pre_attn_scalar=_HEAD_DIM, sliding_window=_SLIDING,
                layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=_SOFTCAP,
            ),
            vision_config=dict(_SIGLIP, image_size=_GRID * 14, patch_size=14, vision_use_head=False),
            mm_tokens_per_image=(_GRID // 2) ** 2,
            image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END,
        ),
    ),
    # Gemma 4: its own vision tower (2-D RoPE, QK-norms, gated MLP, pre/post norms), patches
    # pooled 3x3 into soft tokens; the text model as gemma4_text. No audio tower.
    "gemma4": (
        "Gemma4Config", "Gemma4ForConditionalGeneration",
        dict(
            text_config=_text(**_GEMMA4_TEXT),
            vision_config=dict(
                hidden_size=_V_HIDDEN, intermediate_size=_V_INTER, num_hidden_layers=2,
                num_attention_heads=_V_HEADS, num_key_value_heads=_V_HEADS, head_dim=_V_HIDDEN // _V_HEADS,
                patch_size=16, pooling_kernel_size=3, position_embedding_size=pick(cpu=64, gpu=1024),
            ),
            image_token_id=IMAGE, video_token_id=VIDEO, audio_token_id=AUDIO, boi_token_id=START, eoi_token_id=END,
            boa_token_id=EXTRA, eoa_token_index=EXTRA - 1,
        ),
    ),
    # GLM-4.1V: GLM-4 text (post-norms, partial interleaved multimodal RoPE over (t, h, w)), a
    # vision tower with RMSNorm, SwiGLU MLP, 2-D RoPE and interpolated position embeddings,
    # 2x2 patch merger.
    "glm4v": (
        "Glm4vConfig", "Glm4vForConditionalGeneration",
        dict(
            text_config=_text(**_VL_TEXT, rope_parameters=_GLM4V_ROPE),
            vision_config=_glm4v_vision(),
            image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=START, image_end_token_id=END,
            video_start_token_id=EXTRA, video_end_token_id=EXTRA - 1,
        ),
    ),
    # GLM-4.5V: glm4v's vision tower, a GLM-4.5 MoE text model: layer 0 dense, layer 1 MoE
    # (4 experts, top-2, shared expert). Its router aux loss is added only when the forward is
    # given output_router_logits=True (tiny_family_batch passes it).
    "glm4v_moe": (
        "Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration",
        dict(
            text_config=_text(
                **_VL_TEXT, rope_parameters=_GLM4V_ROPE,
                n_routed_experts=_EXPERTS, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                moe_intermediate_size=_MOE_INTER, first_k_dense_replace=1, router_aux_loss_coef=0.1,
            ),
            vision_config=_glm4v_vision(),
            image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=START, image_end_token_id=END,
            video_start_token_id=EXTRA, video_end_token_id=EXTRA - 1,
        ),
    ),
    # InternVL 3: InternViT tower (LayerNorm, layer scale, CLS token dropped), pixel shuffle 0.5
    # (4x4 patches -> 2x2 tokens), LayerNorm + MLP projector, Qwen2 text model.
    "internvl": (
        "InternVLConfig", "InternVLForConditionalGeneration",
        dict(
            text_config=_text(model_type="qwen2"),
            vision_config=dict(
                hidden_size=_V_HIDDEN, intermediate_size=_V_INTER, num_hidden_layers=2,
                num_attention_heads=_V_HEADS, image_size=[_GRID * 14] * 2, patch_size=[14, 14],
            ),
            image_token_id=IMAGE, image_seq_length=(_GRID // 2) ** 2,
        ),
    ),
    # Llama 4: layer 0 dense MLP, layer 1 MoE (4 experts, top-2 here, top-1 in the real model;
    # sigmoid router, a shared expert), chunked attention with RoPE in layer 0, global NoPE
    # attention in layer 1, QK L2-norm. Vision tower: LayerNorm, GELU MLP, 2-D RoPE, pixel
    # shuffle 0.5 then an MLP. No router aux loss in Hugging Face's model.
    "llama4": (
        "Llama4Config", "Llama4ForConditionalGeneration",
        dict(
            text_config=_text(
                head_dim=_HEAD_DIM, intermediate_size=_MOE_INTER, intermediate_size_mlp=_COMMON["intermediate_size"],
                num_local_experts=_EXPERTS, num_experts_per_tok=2, interleave_moe_layer_step=2,
                no_rope_layer_interval=2, attention_chunk_size=_SLIDING,
            ),
            vision_config=dict(
                hidden_size=_V_HIDDEN, intermediate_size=4 * _V_HIDDEN, num_hidden_layers=2,
                num_attention_heads=_V_HEADS, image_size=_GRID * 14, patch_size=14, pixel_shuffle_ratio=0.5,
                vision_output_dim=_V_INTER, projector_input_dim=_V_INTER, projector_output_dim=_V_INTER,
            ),
            image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END,
        ),
    ),
    # LLaVA-1.5: CLIP vision tower (LayerNorm, quick-GELU MLP) read at its second-to-last layer
    # (vision_feature_layer=-2: the last CLIP layer and post_layernorm get no gradient, as in the
    # real model), CLS dropped, 2x2 patches -> 4 tokens, GELU MLP projector, Llama text model.
    "llava": (
        "LlavaConfig", "LlavaForConditionalGeneration",
        dict(
            text_config=_text(model_type="llama"),
            vision_config=dict(_CLIP, image_size=_GRID // 2 * 14, patch_size=14),
            image_token_index=IMAGE, image_seq_length=(_GRID // 2) ** 2,
        ),
    ),
    # Mistral 3 (Mistral-Small-3.1): Pixtral vision tower (RMSNorm, SwiGLU MLP, 2-D RoPE,
    # variable image sizes through image_sizes), RMSNorm + 2x2 patch merger + MLP projector,
    # Mistral text model.
    "mistral3": (
        "Mistral3Config", "Mistral3ForConditionalGeneration",
        dict(
            text_config=_text(model_type="mistral", head_dim=_HEAD_DIM, sliding_window=None),
            vision_config=dict(_PIXTRAL, image_size=_GRID * 14),
            image_token_index=IMAGE, spatial_merge_size=2,
        ),
    ),
    # Llama 3.2 Vision (mllama): one <|image|> token per image; its tiles (2 of max 2 here) go
    # through a local then a gated global vision encoder (LayerNorm, GELU MLP), and layer 1 of
    # the text model is a gated cross-attention layer reading them (cross_attention_mask); layer 0
    # is self-attention. Without images the cross-attention layer is skipped.
    "mllama": (
        "MllamaConfig", "MllamaForConditionalGeneration",
        dict(
            text_config=_text(cross_attention_layers=[1]),
            vision_config=dict(
                hidden_size=_V_HIDDEN, intermediate_size=_V_INTER, num_hidden_layers=2, num_global_layers=1,
                attention_heads=_V_HEADS, image_size=_GRID * 14, patch_size=14, max_num_tiles=2,
                supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]], intermediate_layers_indices=[0],
                vision_output_dim=2 * _V_HIDDEN,
            ),
            image_token_index=IMAGE,
        ),
    ),
    # Muse Glimmer: a vision tower of LayerNorm / GELU-MLP blocks with 2-D RoPE, window attention
    # in layer 0 and full attention in layer 1, 2x2 pixel shuffle, an MLP adapter and an
    # unweighted RMSNorm; the text model has QK-norm, sandwich norms, layer 0 sliding with RoPE,
    # layer 1 global NoPE, and tanh-softcapped, scaled logits.
    "muse_glimmer": (
        "MuseGlimmerConfig", "MuseGlimmerForConditionalGeneration",
        dict(
            # The logits are scaled by output_multiplier (0.196) before the cap: a cap of 0.05
            # (20 in the released model) makes the tiny model's logits really capped.
            text_config=_text(head_dim=_HEAD_DIM, sliding_window=_SLIDING, final_logit_softcapping=0.05),
            vision_config=dict(
                hidden_size=_V_HIDDEN, intermediate_size=_V_INTER, num_hidden_layers=2,
                num_attention_heads=_V_HEADS, patch_size=14, merge_size=2, patch_temporal=2,
                pos_emb_height=_GRID, pos_emb_width=_GRID, max_position_embeddings=_GRID * _GRID,
            ),
            out_hidden_size=4 * _V_HIDDEN, projector_hidden_size=_V_INTER,
            image_token_id=IMAGE, video_token_id=VIDEO,
        ),
    ),
    # PaliGemma: SigLIP tower (2x2 patches -> 4 tokens, all kept), a linear projector, Gemma text
    # model; the image and the prompt form a bidirectional prefix (token_type_ids 0), the answer
    # (token_type_ids 1) is causal.
    "paligemma": (
        "PaliGemmaConfig", "PaliGemmaForConditionalGeneration",
        dict(
            text_config=_text(model_type="gemma", head_dim=_HEAD_DIM),
            vision_config=dict(
                _SIGLIP, image_size=_GRID // 2 * 14, patch_size=14, vision_use_head=False,
                projection_dim=_COMMON["hidden_size"],
            ),
            image_token_index=IMAGE, projection_dim=_COMMON["hidden_size"], hidden_size=_COMMON["hidden_size"],
        ),
    ),
    # Pixtral-12B: model_type "llava" (LlavaConfig / LlavaForConditionalGeneration) with a Pixtral
    # vision tower, read at its last layer with every patch kept ("full"), and a Mistral text
    # model; keyed "pixtral" here because PixtralVisionModel itself has no language-model head.
    "pixtral": (
        "LlavaConfig", "LlavaForConditionalGeneration",
        dict(
            text_config=_text(model_type="mistral", head_dim=_HEAD_DIM, sliding_window=None),
            vision_config=dict(_PIXTRAL, image_size=_GRID // 2 * 14),
            vision_feature_layer=-1, vision_feature_select_strategy="full",
            image_token_index=IMAGE, image_seq_length=(_GRID // 2) ** 2,
        ),
    ),
    # Qwen2-VL: vision tower of LayerNorm / quick-GELU MLP blocks with 2-D RoPE, a 2x2 patch
    # merger (LayerNorm + MLP); Qwen2 text with multimodal RoPE (mrope_section over t, h, w).
    "qwen2_vl": (
        "Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
        dict(
            text_config=_text(**_QWEN2_VL_TEXT),
            vision_config=dict(
                depth=2, embed_dim=_V_HIDDEN, hidden_size=_VL_TEXT["hidden_size"], mlp_ratio=2,
                num_heads=_V_HEADS, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            ),
            **_QWEN_IDS,
        ),
    ),
    # Qwen2.5-VL: vision tower with RMSNorm and SwiGLU MLP, window attention in layer 0 and full
    # attention in layer 1 (fullatt_block_indexes), RMSNorm + MLP patch merger; text as Qwen2-VL.
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
        dict(
            text_config=_text(**_QWEN2_VL_TEXT),
            vision_config=dict(
                depth=2, hidden_size=_V_HIDDEN, intermediate_size=_V_INTER, num_heads=_V_HEADS,
                out_hidden_size=_VL_TEXT["hidden_size"], patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                window_size=112, fullatt_block_indexes=[1],
            ),
            **_QWEN_IDS,
        ),
    ),
    # Qwen3-VL: vision tower of LayerNorm / GELU-MLP blocks with 2-D RoPE and interpolated
    # position embeddings, DeepStack (layer 0's merged features are added to the text model's
    # first layers), patch 16; Qwen3 text (QK-norm) with interleaved multimodal RoPE.
    "qwen3_vl": (
        "Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
        dict(
            text_config=_text(**_QWEN3_VL_TEXT), vision_config=_qwen3_vision(deepstack_visual_indexes=[0]),
            **_QWEN_IDS,
        ),
    ),
    # Qwen3-VL-MoE: as qwen3_vl; text layer 0 dense (mlp_only_layers), layer 1 MoE (4 experts,
    # top-2, no shared expert). Its router aux loss is added only when the forward is given
    # output_router_logits=True (tiny_family_batch passes it).
    "qwen3_vl_moe": (
        "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
        dict(
            text_config=_text(
                **_QWEN3_VL_TEXT, num_experts=_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=_MOE_INTER,
                mlp_only_layers=[0], router_aux_loss_coef=0.1,
            ),
            vision_config=_qwen3_vision(deepstack_visual_indexes=[0]),
            **_QWEN_IDS,
        ),
    ),
    # Qwen3.5: the qwen3_5_text model (linear attention + gated full attention, torch fallbacks
    # on the CPU) behind a Qwen3-VL-style vision tower without DeepStack.
    "qwen3_5": (
        "Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
        dict(text_config=_text(**_QWEN3_5_TEXT), vision_config=_qwen3_vision(), **_QWEN_IDS),
    ),
    # Qwen3.5-MoE: as qwen3_5 with the qwen3_5_moe_text model (MoE in every layer). Its router aux
    # loss is added only when the forward is given output_router_logits=True (tiny_family_batch
    # passes it).
    "qwen3_5_moe": (
        "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
        dict(
            text_config=_text(
                **_QWEN3_5_TEXT, num_experts=_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=_MOE_INTER,
                shared_expert_intermediate_size=_MOE_INTER, router_aux_loss_coef=0.1,
            ),
            vision_config=_qwen3_vision(),
            **_QWEN_IDS,
        ),
    ),
    # SmolVLM: SigLIP-like (Idefics3) vision tower (LayerNorm, GELU MLP), 2x2 pixel shuffle and a
    # linear connector, its default Llama text model; pixel_values are [batch, images, C, H, W].
    "smolvlm": (
        "SmolVLMConfig", "SmolVLMForConditionalGeneration",
        dict(
            text_config=_text(model_type="llama"),
            vision_config=dict(_SIGLIP, image_size=_GRID * 14, patch_size=14),
            scale_factor=2, image_token_id=IMAGE, pad_token_id=0,
        ),
    ),
}


def _merge(base: dict, options: dict) -> dict:
    """``options`` over ``base``; dict values (sub-configs) are merged one level deep."""
    merged = dict(base)
    for key, value in options.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def tiny_family_config(model_type: str, **options):
    config_name, _, family_options = TINY_FAMILIES[model_type]
    merged = _merge(family_options, options)
    if "text_config" not in merged:  # a text family: _COMMON at the top level
        merged = {**_COMMON, **merged}
    return getattr(transformers, config_name)(**merged)


# Hugging Face initialises a few weights on the image path to zero (trained checkpoints have them
# non-zero): Gemma 3's projection (mm_input_projection_weight) and Mllama's tanh gates (the text
# model's cross-attention gates, the vision tower's positional-embedding gates). A fresh model
# would then pass no gradient back to its vision tower, so these are set after initialisation
# (the same for the same seed).
def _open_gemma3(model):
    projection = model.model.multi_modal_projector.mm_input_projection_weight
    projection.normal_(0.0, model.config.initializer_range)


def _open_mllama(model):
    for name, parameter in model.named_parameters():
        if name.endswith("gate") and not parameter.any():
            parameter.fill_(0.5)


_OPEN_IMAGE_PATH = {"gemma3": _open_gemma3, "mllama": _open_mllama}


def tiny_family_model(model_type: str, seed: int = 0, **options):
    """A freshly initialised fp32 model on ``DEVICE``; the same ``seed`` gives the same weights."""
    _, model_name, _ = TINY_FAMILIES[model_type]
    config = tiny_family_config(model_type, **options)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    if model_type in _OPEN_IMAGE_PATH:
        with torch.no_grad():
            _OPEN_IMAGE_PATH[model_type](model)
    return model.to(device=DEVICE, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Images: model_type -> a function (config, generator) -> (the model's image inputs for one image
# per row, placeholder tokens per image). Pixel values are in [-1, 1) as after a processor's
# normalisation ([0, 1) for Gemma 4, which rescales them itself).


def _pixels(generator, *shape):
    return torch.rand(*shape, generator=generator) * 2 - 1


def _square(config, generator):
    """[images, 3, S, S] images at the vision tower's image size."""
    size = config.vision_config.image_size
    size = size[0] if isinstance(size, (list, tuple)) else size
    return _pixels(generator, BATCH, 3, size, size), size


def _qwen_patches(config, generator, patch, temporal):
    """Qwen-VL-style flattened patches, ``[images * grid², 3 * temporal * patch²]``, with their
    ``[images, 3]`` (t, h, w) grid; the 2x2 merger makes a token of 4 patches."""
    grid = torch.tensor([[1, _GRID, _GRID]] * BATCH)
    pixel_values = _pixels(generator, BATCH * _GRID * _GRID, 3 * temporal * patch * patch)
    return dict(pixel_values=pixel_values, image_grid_thw=grid), _GRID * _GRID // 4


def _qwen_images(config, generator):
    vision = config.vision_config
    return _qwen_patches(config, generator, vision.patch_size, vision.temporal_patch_size)


def _muse_glimmer_images(config, generator):
    vision = config.vision_config
    return _qwen_patches(config, generator, vision.patch_size, vision.patch_temporal)


def _llava_images(config, generator):
    # vision_feature_select_strategy "default" drops CLIP's CLS token; "full" (Pixtral) has none.
    pixel_values, size = _square(config, generator)
    inputs = dict(pixel_values=pixel_values)
    if config.vision_config.model_type == "pixtral":
        inputs["image_sizes"] = torch.tensor([[size, size]] * BATCH)
    return inputs, (size // config.vision_config.patch_size) ** 2


def _mistral3_images(config, generator):
    pixel_values, size = _square(config, generator)
    tokens = (size // config.vision_config.patch_size // config.spatial_merge_size) ** 2
    return dict(pixel_values=pixel_values, image_sizes=torch.tensor([[size, size]] * BATCH)), tokens


def _internvl_images(config, generator):
    return dict(pixel_values=_square(config, generator)[0]), config.image_seq_length


def _paligemma_images(config, generator):
    pixel_values, size = _square(config, generator)
    return dict(pixel_values=pixel_values), (size // config.vision_config.patch_size) ** 2


def _gemma3_images(config, generator):
    return dict(pixel_values=_square(config, generator)[0]), config.mm_tokens_per_image


def _gemma4_images(config, generator):
    """Patchified: ``[images, patches, 3 * patch²]`` and each patch's (x, y) in
    ``image_position_ids``; the tower pools 3x3 patches into a soft token."""
    vision = config.vision_config
    side = 3 * (_GRID // 2)
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    pixel_values = torch.rand(BATCH, side * side, 3 * vision.patch_size**2, generator=generator)
    inputs = dict(pixel_values=pixel_values, image_position_ids=positions.expand(BATCH, -1, -1).clone())
    return inputs, (side // vision.pooling_kernel_size) ** 2


def _llama4_images(config, generator):
    pixel_values, size = _square(config, generator)
    vision = config.vision_config
    return dict(pixel_values=pixel_values), int((size // vision.patch_size) ** 2 * vision.pixel_shuffle_ratio**2)


def _smolvlm_images(config, generator):
    pixel_values, size = _square(config, generator)
    tokens = (size // config.vision_config.patch_size) ** 2 // config.scale_factor**2
    inputs = dict(
        pixel_values=pixel_values[:, None],  # [batch, images, 3, S, S]
        pixel_attention_mask=torch.ones(BATCH, 1, size, size, dtype=torch.bool),
    )
    return inputs, tokens


def _mllama_images(config, generator):
    """One image of 2 tiles (aspect ratio 1x2, id 2) per row: ``[batch, images, tiles, 3, S, S]``;
    its one <|image|> token; the cross-attention mask is set by ``tiny_family_batch``."""
    vision = config.vision_config
    tiles = vision.max_num_tiles
    pixel_values = _pixels(generator, BATCH, 1, tiles, 3, vision.image_size, vision.image_size)
    inputs = dict(
        pixel_values=pixel_values,
        aspect_ratio_ids=torch.full((BATCH, 1), vision.supported_aspect_ratios.index([1, 2]) + 1),
        aspect_ratio_mask=torch.ones(BATCH, 1, tiles, dtype=torch.long),
    )
    return inputs, 1


_IMAGES = {
    "gemma3": _gemma3_images,
    "gemma4": _gemma4_images,
    "glm4v": _qwen_images,
    "glm4v_moe": _qwen_images,
    "internvl": _internvl_images,
    "llama4": _llama4_images,
    "llava": _llava_images,
    "mistral3": _mistral3_images,
    "mllama": _mllama_images,
    "muse_glimmer": _muse_glimmer_images,
    "paligemma": _paligemma_images,
    "pixtral": _llava_images,
    "qwen2_vl": _qwen_images,
    "qwen2_5_vl": _qwen_images,
    "qwen3_vl": _qwen_images,
    "qwen3_vl_moe": _qwen_images,
    "qwen3_5": _qwen_images,
    "qwen3_5_moe": _qwen_images,
    "smolvlm": _smolvlm_images,
}
# Families whose images are wrapped in start / end tokens (boi / eoi, vision_start / vision_end,
# image_start / image_end): START and END in their configs.
_WRAP = {
    "gemma3", "gemma4", "glm4v", "glm4v_moe", "llama4",
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
}
# Families whose multimodal RoPE needs mm_token_type_ids (0 text, 1 image), text-only included.
_MM_TOKEN_TYPES = {
    "glm4v", "glm4v_moe", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
}
# Composite MoE models whose forward adds the router aux loss only when asked in the call.
_ROUTER_LOSS_BY_KWARG = {"glm4v_moe", "qwen3_vl_moe", "qwen3_5_moe"}


def tiny_family_batch(model_type: str, seed: int = 0, images: bool = True, **options) -> dict:
    """The inputs of one training step of ``[BATCH, SEQ]`` tokens, on ``DEVICE``: ``input_ids``,
    ``labels`` (-100 on prompt, padding and image positions) and, for a vision-language family with
    ``images``, one image per row with everything its forward needs (``options`` are the model's, if
    it was built with any). The same ``seed`` gives the same batch."""
    config = tiny_family_config(model_type, **options)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB - _SPECIAL, (BATCH, SEQ), generator=generator)
    batch = {}
    image_tokens = torch.zeros(BATCH, SEQ, dtype=torch.bool)  # the placeholders
    prompt = torch.zeros(BATCH, SEQ, dtype=torch.bool)  # the placeholders and their wrapping
    if images and model_type in _IMAGES:
        inputs, tokens = _IMAGES[model_type](config, generator)
        batch.update(inputs)
        wrapped = model_type in _WRAP
        block = [START] * wrapped + [IMAGE] * tokens + [END] * wrapped
        assert 1 + len(block) < SEQ, f"{model_type}: {len(block)} image tokens do not fit in {SEQ}"
        input_ids[:, 1 : 1 + len(block)] = torch.tensor(block)
        first = 1 + wrapped
        image_tokens[:, first : first + tokens] = True
        prompt[:, 1 : 1 + len(block)] = True
        if model_type == "mllama":  # the image's token and all after it see both of its tiles
            cross_attention_mask = torch.zeros(BATCH, SEQ, 1, config.vision_config.max_num_tiles, dtype=torch.long)
            cross_attention_mask[:, 1:] = 1
            batch["cross_attention_mask"] = cross_attention_mask
        if model_type == "gemma3":  # bidirectional attention within an image
            batch["token_type_ids"] = image_tokens.long()
        if model_type == "gemma4":
            batch["mm_token_type_ids"] = image_tokens.long()
    if model_type in _MM_TOKEN_TYPES:
        batch["mm_token_type_ids"] = image_tokens.long()
    if model_type == "paligemma":  # a bidirectional prefix (image and prompt), then the answer
        token_type_ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        token_type_ids[:, SEQ // 2 :] = 1
        batch["token_type_ids"] = token_type_ids
        prompt[:, : SEQ // 2] = True
    labels = input_ids.clone()
    labels[prompt] = -100
    labels[0, :5] = -100
    labels[1, -3:] = -100
    batch = {"input_ids": input_ids, "labels": labels, **batch}
    batch = {name: value.to(DEVICE) for name, value in batch.items()}
    if model_type in _ROUTER_LOSS_BY_KWARG:
        batch["output_router_logits"] = True
    return batch
