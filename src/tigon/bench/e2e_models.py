"""The models ``tigon bench e2e`` trains, as each setup builds them, and the batches they train on.

A model is a row of :data:`MODELS`: a Hugging Face family (its ``model_type`` names Liger-Kernel's
patch in ``MODEL_TYPE_TO_APPLY_LIGER_FN`` and tigon's in ``PATCHERS``), the released model whose
layer shapes it takes, few of its layers, and tiny shapes of the same family for smoke runs on the
CPU (hidden 64, vocabulary 512 or less). Every setup builds the same weights (``torch.manual_seed(0)``)
and draws the same batches from a generator seeded the same, so the losses of a step compare.

- ``llama``: Llama-3-8B (hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocab 128256).
- ``llama_1b``: Llama-3.2-1B, all 16 layers, the head tied to the embedding as released (its llama3
  RoPE scaling changes no shape or cost, and is left out).
- ``qwen3_moe``: Qwen3-30B-A3B (hidden 2048, 32 heads / 4 KV heads of dim 128, 128 experts of width
  768 with 8 per token and their weights renormalised, vocab 151936, rope theta 1e6). The router's
  auxiliary loss is as the released config has it: not computed (``output_router_logits`` false).
  Its tigon setup runs tigon's experts kernel (``experts_implementation="tigon"``); Liger's patch
  replaces the experts by its fused MoE.
- ``qwen2_5_vl``: Qwen2.5-VL-7B's language model (hidden 3584, MLP 18944, 28 heads / 4 KV heads,
  vocab 152064, M-RoPE sections [16, 24, 24]) and its vision tower at real width (hidden 1280, MLP
  3420, 16 heads, patch 14, 2×2 merge, windows of 112 pixels) with 4 of its 32 blocks, the last with
  full attention (the real tower's every eighth). A sample is one square image (:func:`image_text_batch`).
- ``deepseek_v3``: DeepSeek-V3's layer (multi-head latent attention: q LoRA rank 1536, KV LoRA rank
  512, no-RoPE / RoPE / value head dims 128 / 64 / 128, interleaved RoPE; sigmoid router with grouped
  top-k, 8 groups of which 4 are kept; 2 shared experts; a dense first layer) at DeepSeek-V2-Lite's /
  Moonlight-16B-A3B's scale: hidden 2048, 16 heads, 64 routed experts of width 1408 with 6 per token,
  dense MLP 10944, vocab 129280, no YaRN (which changes no shape or cost). No auxiliary router loss.
- ``gpt_oss``: GPT-OSS-20B (hidden 2880, 32 experts of width 2880 with 4 per token and the clamped
  SwiGLU, 64 heads / 8 KV heads of dim 64, vocab 201088, sliding windows of 128 tokens in every other
  layer, attention sinks, YaRN), the router's auxiliary loss on. Transformers gives it no SDPA (its
  sinks): flex attention on the GPU keeps attention's memory linear in the sequence (eager builds
  ``B·64·T²`` scores per layer); eager on the CPU, where flex has no sinks.

The experts run as each setup has them (transformers' ``grouped_mm`` by default, Liger's or tigon's
as their patches replace them); each result records their class and implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A mixture of experts' stacked weights [E, out, in] (transformers 5's experts modules).
LORA_EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# The tiny models' shared sizes: hidden 64, 4 heads of 16, vocab 512.
TINY_TEXT = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


def _llama_3_8b(layers: int, tiny: bool) -> dict:
    # Tiny: 4 heads of keys and values (not 2), so that tensor parallel on 4 ranks splits them.
    tiny_shapes = dict(TINY_TEXT, num_key_value_heads=4, intermediate_size=128, max_position_embeddings=1024)
    shapes = tiny_shapes if tiny else dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072,
    )
    return dict(shapes, num_hidden_layers=layers, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _llama_3_2_1b(layers: int, tiny: bool) -> dict:
    shapes = dict(TINY_TEXT, intermediate_size=128, head_dim=16, max_position_embeddings=1024) if tiny else dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=131072,
    )
    return dict(shapes, num_hidden_layers=layers, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def _qwen3_30b_a3b(layers: int, tiny: bool) -> dict:
    shapes = dict(TINY_TEXT, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  head_dim=16) if tiny else dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960,
    )
    return dict(shapes, num_hidden_layers=layers, norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
                output_router_logits=False, router_aux_loss_coef=0.001, tie_word_embeddings=False)


def _qwen2_5_vl_7b(layers: int, tiny: bool) -> dict:
    if tiny:
        text = dict(TINY_TEXT, intermediate_size=128, bos_token_id=None, eos_token_id=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      fullatt_block_indexes=[])
        # The image and vision tokens at the top of the tiny vocabulary, as Qwen's are at the top of its own.
        tokens = dict(image_token_id=511, video_token_id=510, vision_start_token_id=509, vision_end_token_id=508)
    else:
        text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                    num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
        vision = dict(depth=4, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      fullatt_block_indexes=[3])
        tokens = {}
    vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, tokens_per_second=2)
    return dict(text_config=dict(text, num_hidden_layers=layers), vision_config=vision, **tokens,
                tie_word_embeddings=False)


def _deepseek_v3_lite(layers: int, tiny: bool) -> dict:
    if tiny:
        shapes = dict(TINY_TEXT, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                      num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        shapes["num_key_value_heads"] = shapes["num_attention_heads"]
    else:
        shapes = dict(vocab_size=129280, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                      n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4, num_attention_heads=16,
                      num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840)
    return dict(shapes, num_hidden_layers=layers, n_shared_experts=2, first_k_dense_replace=1, rope_interleave=True,
                routed_scaling_factor=2.5, tie_word_embeddings=False)


def _gpt_oss_20b(layers: int, tiny: bool) -> dict:
    shapes = dict(TINY_TEXT, intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=16) if tiny else dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
        num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    )
    # layer_types (sliding, full, sliding, ...) and YaRN are the config's defaults, as GPT-OSS's.
    return dict(shapes, num_hidden_layers=layers, output_router_logits=True, tie_word_embeddings=False)


@dataclass(frozen=True)
class Model:
    """A model trained end to end.

    Attributes:
        title: the released model whose shapes these are, for tables and plots.
        model_type: transformers' name of the family (its folder in ``transformers.models``).
        config_class, model_class: names in ``transformers``.
        config: ``(layers, tiny) -> the config's keyword arguments``: the released model's shapes,
            or the smoke run's tiny ones.
        layers: the layers trained unless ``--layers`` says otherwise.
        tigon_experts: a mixture of experts whose tigon setup runs tigon's experts kernel.
        router_aux_loss: the router's auxiliary loss can be switched on (``--router-aux-loss``).
        vision: samples hold an image (:func:`image_text_batch`), else only text (:func:`text_batch`).
        attention: the attention implementation on the GPU (on the CPU "eager" where this has no CPU path).
        max_search: ``--max-search``'s default: the longest sequence searched at batch 1 (0: none).
    """

    title: str
    model_type: str
    config_class: str
    model_class: str
    config: Callable[[int, bool], dict]
    layers: int = 4
    tigon_experts: bool = False
    router_aux_loss: bool = False
    vision: bool = False
    attention: str = "sdpa"
    max_search: int = 65536


MODELS = {
    "llama": Model("Llama-3-8B", "llama", "LlamaConfig", "LlamaForCausalLM", _llama_3_8b),
    "llama_1b": Model("Llama-3.2-1B", "llama", "LlamaConfig", "LlamaForCausalLM", _llama_3_2_1b, layers=16),
    "qwen3_moe": Model("Qwen3-30B-A3B", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", _qwen3_30b_a3b,
                       tigon_experts=True, router_aux_loss=True),
    # The longest-sequence search of the three families is off by default: their steps are slow.
    "qwen2_5_vl": Model("Qwen2.5-VL-7B (4-block vision tower at real width)", "qwen2_5_vl", "Qwen2_5_VLConfig",
                        "Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl_7b, vision=True, max_search=0),
    "deepseek_v3": Model("DeepSeek-V3 layers at V2-Lite/Moonlight scale (64 experts, hidden 2048)", "deepseek_v3",
                         "DeepseekV3Config", "DeepseekV3ForCausalLM", _deepseek_v3_lite, max_search=0),
    "gpt_oss": Model("GPT-OSS-20B", "gpt_oss", "GptOssConfig", "GptOssForCausalLM", _gpt_oss_20b,
                     attention="flex_attention", max_search=0),
}


def patch(setup: str, model_type: str) -> None:
    """Patch the family's modeling module before a model is built: Liger's or tigon's entry for it."""
    if setup == "liger":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]()
    elif setup == "tigon":
        from tigon.transformers import PATCHERS

        PATCHERS[model_type]()


def attention_for(model: str, device: str | torch.device, attention: str | None = None) -> str:
    """``attention``, or the model's attention implementation on ``device``."""
    spec = MODELS[model]
    if attention:
        return attention
    return "eager" if torch.device(device).type == "cpu" and spec.attention == "flex_attention" else spec.attention


def build_model(setup: str, layers: int, device: str | torch.device = "cuda", *, model: str = "llama",
                dtype=torch.bfloat16, tiny: bool = False, attention: str | None = None, **shape):
    """A ``dtype`` model of ``layers`` layers of ``MODELS[model]`` (its tiny shapes with ``tiny``;
    ``shape`` overrides the config's arguments), seeded weights, non-reentrant gradient
    checkpointing, in training mode; ``setup`` "liger" or "tigon" patches the family's modeling
    module first, and a tigon-experts model built for "tigon" runs its experts by tigon's kernel."""
    import transformers

    spec = MODELS[model]
    patch(setup, spec.model_type)
    options = {}
    if setup == "tigon" and spec.tigon_experts:
        from tigon.transformers.moe import IMPLEMENTATION, register

        register()  # before the model is built: transformers checks the name then
        options["experts_implementation"] = IMPLEMENTATION
    config = getattr(transformers, spec.config_class)(**{**spec.config(layers, tiny), **shape}, **options)
    config._attn_implementation = attention_for(model, device, attention)
    torch.manual_seed(0)
    with torch.device(device):
        built = getattr(transformers, spec.model_class)(config).to(dtype)
    built.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    built.config.use_cache = False
    built.train()
    return built


def experts_in(model) -> str | None:
    """What computes the model's mixture-of-experts experts: their class and transformers'
    ``experts_implementation`` it dispatches on (a class replacing it, Liger's, has none); ``None``
    for a dense model."""
    experts = next((module for module in model.modules() if type(module).__name__.endswith("Experts")), None)
    if experts is None:
        return None
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    return type(experts).__name__ + (f" ({implementation})" if implementation else "")


def with_lora(model):
    """``model`` with PEFT LoRA adapters (r 16, alpha 32, no dropout) on every linear layer of its
    decoder and on its experts' stacked weights (PEFT's ``target_parameters``); PEFT's defaults
    otherwise, so fp32 adapters on a bf16 model."""
    from peft import LoraConfig, get_peft_model

    experts = [name for name in LORA_EXPERT_TARGETS if any(path.endswith(name) for path, _ in model.named_parameters())]
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                                            target_parameters=experts or None))


def quantize_4bit(model, compute_dtype=torch.bfloat16):
    """``model`` with the linear layers of its decoder as bitsandbytes 4-bit NF4 layers computing
    in ``compute_dtype`` (QLoRA's base), on the GPU; the head stays as it was."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    quantized = bnb.nn.Linear4bit(
                        child.in_features, child.out_features, bias=child.bias is not None,
                        compute_dtype=compute_dtype, quant_type="nf4",
                    )
                    quantized.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False, quant_type="nf4")
                    setattr(parent, name, quantized.cuda())
    # As transformers' bitsandbytes quantizer marks a model it loads in 4 bits: PEFT then wraps these
    # layers with its QLoRA class (lora.Linear4bit), as it does for a from_pretrained 4-bit model.
    model.is_loaded_in_4bit = True
    torch.cuda.empty_cache()
    return model


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layers (of the language model, for a vision-language model)."""
    return model.get_decoder().layers


def text_batch(config, batch: int, seq_len: int, generator: torch.Generator) -> dict:
    """Random tokens, labelled with themselves (the model shifts them)."""
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len), device=generator.device, generator=generator)
    return {"input_ids": tokens, "labels": tokens}


def image_text_batch(config, batch: int, seq_len: int, generator: torch.Generator, image_side: int) -> dict:
    """One square image of ``image_side`` pixels per sample, as Qwen2.5-VL's processor lays it out,
    in a sequence of ``seq_len`` tokens.

    ``pixel_values``: ``[batch·t·h·w, channels·temporal_patch·patch²]``, the image's patches flattened
    (an image is one frame repeated over ``temporal_patch_size``, so ``t`` = 1); ``image_grid_thw``:
    ``(t, h, w)`` per image, in patches. The sequence: a text prefix, the vision start token,
    ``h·w / merge²`` image tokens (one per merged 2×2 patch), the vision end token, text. The image
    tokens' labels are -100; ``mm_token_type_ids`` marks them for M-RoPE's 3-D positions. Text
    tokens are drawn below Qwen's special tokens.
    """
    vision, device = config.vision_config, generator.device
    if image_side % (vision.patch_size * vision.spatial_merge_size):
        raise ValueError(f"image_side: {image_side} pixels; expected a multiple of the merged patch's "
                         f"{vision.patch_size * vision.spatial_merge_size}")
    patches_per_side = image_side // vision.patch_size
    n_patches = patches_per_side**2
    n_image_tokens = n_patches // vision.spatial_merge_size**2
    prefix = 16  # a system prompt and the user's turn before the image
    if prefix + n_image_tokens + 2 > seq_len:
        raise ValueError(f"seq_len: {seq_len} tokens cannot hold an image of {n_image_tokens} tokens and its text")
    patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixel_values = torch.randn(batch * n_patches, patch_values, device=device, generator=generator)
    image_grid_thw = torch.tensor([[1, patches_per_side, patches_per_side]] * batch, device=device)
    # Text below the special tokens (Qwen's start at 151643; the tiny model's at 508).
    specials = (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id)
    text_vocab = min(min(specials), getattr(config.text_config, "bos_token_id", None) or config.text_config.vocab_size)
    tokens = torch.randint(0, text_vocab, (batch, seq_len), device=device, generator=generator)
    tokens[:, prefix] = config.vision_start_token_id
    tokens[:, prefix + 1: prefix + 1 + n_image_tokens] = config.image_token_id
    tokens[:, prefix + 1 + n_image_tokens] = config.vision_end_token_id
    is_image = tokens == config.image_token_id
    return {
        "input_ids": tokens, "labels": tokens.masked_fill(is_image, -100), "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw, "mm_token_type_ids": is_image.int(),
    }


def batch_maker(model: str, config, image_side: int) -> Callable[[int, int, torch.Generator], dict]:
    """``(batch, seq_len, generator) -> inputs`` of one training step of ``MODELS[model]``."""
    if MODELS[model].vision:
        return lambda batch, seq_len, generator: image_text_batch(config, batch, seq_len, generator, image_side)
    return lambda batch, seq_len, generator: text_batch(config, batch, seq_len, generator)
