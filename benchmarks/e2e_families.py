"""End to end beyond Llama: Qwen2.5-VL, a DeepSeek-V3-style MoE and GPT-OSS trained with HF, + Liger-Kernel, + tigon.

tigon bench e2e's measurement (one process per setup, tokens/s over the timed steps after two
warm-up steps, the peak memory of a training step and of each phase, bf16 weights, PyTorch's fused
AdamW, non-reentrant gradient checkpointing) on three families at their real width with few layers:

- ``qwen2_5_vl``: Qwen2.5-VL-7B's language model (hidden 3584, MLP 18944, 28 heads / 4 KV heads,
  vocab 152064, M-RoPE sections [16, 24, 24], rope theta 1e6) with ``--layers`` layers, and its
  vision tower at real width (hidden 1280, MLP 3420, 16 heads, patch 14, 2×2 merge, windows of
  112 pixels, output 3584) with 4 of its 32 blocks, the last of them with full attention (the real
  tower's every eighth). A sample is one 448×448 image (``--image-side``; a 32×32 grid of patches,
  flattened as the image processor does, ``[patches, 3·2·14·14]``; 256 image tokens after
  merging) between the vision start and end tokens, after a short text prefix and before text up
  to ``--seq-len`` tokens; the image tokens' labels are -100, and ``mm_token_type_ids`` marks them
  for M-RoPE's 3-D positions. Text tokens are drawn below Qwen's special tokens. SDPA in both
  towers. Its tokens/s counts the language model's tokens (image tokens included); the vision
  tower's 1024 patches per sample are extra work.
- ``deepseek_v3``: DeepSeek-V3's layer (multi-head latent attention: q LoRA rank 1536, KV LoRA
  rank 512, no-RoPE / RoPE / value head dims 128 / 64 / 128, interleaved RoPE; sigmoid router
  with grouped top-k, 8 groups of which 4 are kept; 2 shared experts; a dense first layer) scaled
  to one GPU: hidden 2048, 16 heads, 64 routed experts of width 1408 with 6 per token, dense MLP
  10944, vocab 129280. That is DeepSeek-V2-Lite's / Moonlight-16B-A3B's scale (hidden 2048, 64
  experts of 1408, 6 routed + 2 shared, MLA with 16 heads) with V3's router and RoPE layout and no
  YaRN scaling (which changes no shape or cost). V3 has no auxiliary router loss. SDPA.
- ``gpt_oss``: GPT-OSS-20B's shapes (hidden 2880, 32 experts of width 2880 with 4 per token and
  the clamped SwiGLU, 64 heads / 8 KV heads of dim 64, vocab 201088, sliding windows of 128 tokens
  in every other layer, attention sinks, YaRN) with the router's auxiliary loss on
  (``output_router_logits=True``). Transformers 5.17 gives GPT-OSS no SDPA (its sinks); it runs
  eager, flash (the kernels hub, which the GPU machine cannot reach) or flex attention. Flex (in
  PyTorch, compiled on the first step) keeps attention's memory linear in the sequence; eager
  builds 4·64·4096² scores per layer (8 GiB per bf16 tensor at batch 4, several alive at once), so
  flex is the default on the GPU (``--attn eager`` to compare) and eager on CPU, where flex has no
  sinks.

The experts run as Transformers builds them (``experts_implementation`` "grouped_mm" where the GPU
has it). Setups: ``hf`` (nothing patched), ``liger`` (Liger's ``MODEL_TYPE_TO_APPLY_LIGER_FN`` entry
with its defaults, fused linear cross entropy on: for DeepSeek V3 without RoPE, for GPT-OSS
without its SwiGLU) and ``tigon`` (``tigon.transformers.PATCHERS[model_type]()``), each applied
before the model is built. Every setup builds the same weights (``torch.manual_seed(0)``) and
trains on the same batches (a generator seeded the same), so the losses of a step compare: the
first step's must agree to ~1e-2 relative in bf16, and the run prints how far each setup's is
from Hugging Face's. A setup that fails (out of memory, Liger raising on a family) is recorded
with its reason; the others run on. ``--max-search`` adds tigon bench e2e's longest sequence that trains
at batch 1 (slow: off by default; each process has 300 s, e2e_fsdp2.launch's limit).

Peak memory at the default sizes, estimated. bf16 weights, gradients and AdamW's two moments take
8 bytes per parameter, but when Hugging Face's loss peaks (the start of backward) only the lm_head's
gradient exists: ~6 bytes per parameter then. That loss upcasts the logits to fp32 and holds ~12
bytes per logit at its peak (log-softmax's output, its gradient and the input's gradient, all fp32).
The fused losses never hold the logits: their peak is at the end of backward, all gradients
allocated, plus one layer's recomputed activations and the MoE's routed copies (~3-5 GiB):

    family        parameters  8 B/param  logits B·T·V   HF: 6 B/param + 12 B/logit   Liger, tigon
    qwen2_5_vl    2.15 B      16 GiB     2.5 G          12 + 28 = ~42 GiB            ~21 GiB
    deepseek_v3   2.37 B      18 GiB     2.1 G          13 + 24 = ~38 GiB            ~23 GiB
    gpt_oss       4.45 B      33 GiB     3.3 G          25 + 37 = ~63 GiB            ~38 GiB

so all three train at batch 4 × 4096 on an 80 GB H100: GPT-OSS with flex attention (eager would
add several 8 GiB score tensors of one layer to the ~37 GiB at the end of backward: too close to
80 GB; ``--batch 2`` for it with ``--attn eager``).

``--smoke`` is a CPU run in fp32 of tiny models of the same families (hidden 64, 2 layers, vocab
512, 1 × 128 tokens, a vision tower of one block of width 32 and a 168×168 image): every setup
runs all families in one process (the imports dominate), no memory is measured and the timings
mean nothing; the losses of tigon and Hugging Face agree to ~1e-6.

    python benchmarks/e2e_families.py [--family qwen2_5_vl deepseek_v3 gpt_oss] [--setups hf liger tigon]
        [--layers 4] [--batch 4] [--seq-len 4096] [--steps 6] [--image-side 448] [--attn IMPL] [--max-search 65536]
        [--out DIR]
    python benchmarks/e2e_families.py --smoke [--setups hf tigon] [--out DIR]   # into tigon-out/e2e_families-smoke

On the GPU machine, one call per family (three processes of ~1-2 minutes each: imports, the
model's build, Triton's and flex attention's compilations, 9 steps; ``carry: [".whl"]``, where
liger-kernel 0.8.5 travels as a wheel)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/liger_kernel-0.8.5-*.whl && export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 || exit; \
    set -o pipefail; python3 benchmarks/e2e_families.py --family gpt_oss --out $OUT 2>&1 | tee $OUT/e2e_gpt_oss.log
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from e2e_fsdp2 import launch
from tigon.bench.e2e import LABELS, SETUPS, gpu_slug, new_optimizer
from e2e_trl import environment, peak_gib, reset_peak, synchronize

HERE = Path(__file__).resolve().parent
SMOKE = dict(layers=2, batch=1, seq_len=128, warmup=1, steps=2, image_side=168)
# The smoke models' shared sizes: hidden 64, 4 heads of 16, vocab 512.
SMOKE_TEXT = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


@dataclass(frozen=True)
class Family:
    """A model family of the benchmark.

    Attributes:
        model_class: the Hugging Face class trained, in ``transformers``.
        title: the model in words, for the figure.
        config: ``(layers, smoke) -> config`` with the family's shapes (tiny ones for ``smoke``).
        vision: samples hold an image (:func:`image_text_inputs`), else only text (:func:`text_inputs`).
        attention: the attention implementation on the GPU (on CPU "eager" where this has no CPU path).
    """

    model_class: str
    title: str
    config: Callable
    vision: bool = False
    attention: str = "sdpa"


def qwen2_5_vl_config(layers: int, smoke: bool):
    from transformers import Qwen2_5_VLConfig

    if smoke:
        text = dict(**SMOKE_TEXT, intermediate_size=128, bos_token_id=None, eos_token_id=None,
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
    return Qwen2_5_VLConfig(text_config=dict(text, num_hidden_layers=layers), vision_config=vision, **tokens,
                            tie_word_embeddings=False)


def deepseek_v3_config(layers: int, smoke: bool):
    from transformers import DeepseekV3Config

    if smoke:
        shapes = dict(**SMOKE_TEXT, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                      num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=2, q_lora_rank=32,
                      kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        shapes["num_key_value_heads"] = shapes["num_attention_heads"]
    else:
        shapes = dict(vocab_size=129280, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                      n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4, n_shared_experts=2,
                      num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840)
    return DeepseekV3Config(**shapes, num_hidden_layers=layers, first_k_dense_replace=1, rope_interleave=True,
                            routed_scaling_factor=2.5, tie_word_embeddings=False)


def gpt_oss_config(layers: int, smoke: bool):
    from transformers import GptOssConfig

    if smoke:
        shapes = dict(**SMOKE_TEXT, intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                      sliding_window=16)
    else:
        shapes = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
                      num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=4, sliding_window=128)
    # layer_types (sliding, full, sliding, ...) and YaRN are the config's defaults, as GPT-OSS's.
    return GptOssConfig(**shapes, num_hidden_layers=layers, output_router_logits=True, tie_word_embeddings=False)


def text_inputs(config, batch: int, seq_len: int, generator, device) -> dict:
    """Random tokens, labelled with themselves (the model shifts them), as tigon bench e2e."""
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len), device=device, generator=generator)
    return {"input_ids": tokens, "labels": tokens}


def image_text_inputs(config, batch: int, seq_len: int, generator, device, image_side: int) -> dict:
    """One square image per sample, as Qwen2.5-VL's processor lays it out, in a sequence of ``seq_len`` tokens.

    ``pixel_values``: ``[batch·t·h·w, channels·temporal_patch·patch²]``, the image's patches flattened
    (an image is one frame repeated over ``temporal_patch_size``, so ``t`` = 1); ``image_grid_thw``:
    ``(t, h, w)`` per image, in patches. The sequence: a text prefix, the vision start token,
    ``h·w / merge²`` image tokens (one per merged 2×2 patch), the vision end token, text.
    """
    vision = config.vision_config
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
    # Text below the special tokens (Qwen's start at 151643; the smoke model's at 508).
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


FAMILIES = {
    "qwen2_5_vl": Family(
        "Qwen2_5_VLForConditionalGeneration", "Qwen2.5-VL-7B shapes (4-block vision tower at real width)",
        qwen2_5_vl_config, vision=True,
    ),
    "deepseek_v3": Family(
        "DeepseekV3ForCausalLM", "DeepSeek-V3 layers at V2-Lite/Moonlight scale (64 experts, hidden 2048)",
        deepseek_v3_config,
    ),
    "gpt_oss": Family(
        "GptOssForCausalLM", "GPT-OSS-20B shapes", gpt_oss_config, attention="flex_attention",
    ),
}


def patch(setup: str, model_type: str) -> None:
    """Patch the family's modeling module before the model is built: Liger's or tigon's entry for it."""
    if setup == "liger":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]()
    elif setup == "tigon":
        from tigon.transformers import PATCHERS

        PATCHERS[model_type]()


def build_model(family: str, setup: str, layers: int, attention: str, device: str, dtype: torch.dtype, smoke: bool):
    """The family's model of ``layers`` layers, ``setup``'s patches applied first: seeded weights in
    ``dtype`` on ``device``, non-reentrant gradient checkpointing, in training mode."""
    import transformers

    config = FAMILIES[family].config(layers, smoke)
    config._attn_implementation = attention
    patch(setup, config.model_type)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, FAMILIES[family].model_class)(config).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


def train_step(model, optimizer, inputs: dict, device: str, phase_peaks: dict | None = None) -> float:
    """One step; with ``phase_peaks`` (on CUDA), the peak memory (GiB) of each phase is recorded into it."""

    def end_phase(name):
        if phase_peaks is not None:
            synchronize(device)
            phase_peaks[name] = max(phase_peaks.get(name, 0.0), peak_gib(device))
            reset_peak(device)

    if phase_peaks is not None:
        reset_peak(device)
    loss = model(**inputs).loss
    end_phase("forward")
    loss.backward()
    end_phase("backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    end_phase("optimizer")
    return loss.item()


def run_family(args, family: str, setup: str) -> dict:
    spec = FAMILIES[family]
    device = "cpu" if args.smoke else "cuda"
    attention = args.attn or ("eager" if args.smoke and spec.attention == "flex_attention" else spec.attention)
    result = {"family": family, "setup": setup, "label": LABELS[setup], "attention": attention}
    try:
        model = build_model(family, setup, args.layers, attention, device,
                            torch.float32 if args.smoke else torch.bfloat16, args.smoke)
        optimizer = new_optimizer(model, "fused")
        generator = torch.Generator(device=device).manual_seed(0)

        def step(batch_size=args.batch, seq_len=args.seq_len, phase_peaks=None):
            if spec.vision:
                inputs = image_text_inputs(model.config, batch_size, seq_len, generator, device, args.image_side)
            else:
                inputs = text_inputs(model.config, batch_size, seq_len, generator, device)
            return train_step(model, optimizer, inputs, device, phase_peaks)

        if getattr(model.config, "num_local_experts", None):
            result["experts_implementation"] = model.config._experts_implementation
        result["parameters"] = sum(p.numel() for p in model.parameters())
        # Warm-up (Triton's and flex attention's compilations, AdamW's state), then the timed steps.
        losses = [step() for _ in range(args.warmup)]
        synchronize(device)
        reset_peak(device)
        start = time.perf_counter()
        losses += [step() for _ in range(args.steps)]
        synchronize(device)
        seconds = time.perf_counter() - start
        tokens_per_second = args.batch * args.seq_len * args.steps / seconds
        result.update(tokens_per_second=tokens_per_second, peak_memory_gib=peak_gib(device))
        phase_peaks = {}
        if device == "cuda":
            losses.append(step(phase_peaks=phase_peaks))
        result.update(peak_memory_by_phase_gib=phase_peaks, losses=losses)
        if args.max_search:
            result["longest_seq_len_batch1"] = longest_sequence(step, optimizer, args.max_search)
    except Exception as error:  # noqa: BLE001 - a failing setup is a result (OOM, a patch raising), not the end
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:500]
    return result


def longest_sequence(step, optimizer, max_len: int) -> int:
    """The longest sequence (in steps of 4096 from 8192) that trains at batch 1, as tigon bench e2e."""
    longest = 0
    for trial in range(8192, max_len + 1, 4096):
        try:
            step(batch_size=1, seq_len=trial)
            longest = trial
        except torch.OutOfMemoryError:
            break
        finally:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    return longest


def add_comparisons(results: list[dict]) -> None:
    """Speed-up, memory (overall and per phase) and the step-0 loss against the ``hf`` row."""
    base = next((r for r in results if r["setup"] == "hf" and "error" not in r), None)
    if base is None:
        return
    for r in results:
        if "error" in r:
            continue
        r["speedup_vs_hf"] = r["tokens_per_second"] / base["tokens_per_second"]
        if r["peak_memory_gib"] is not None:
            r["memory_vs_hf"] = r["peak_memory_gib"] / base["peak_memory_gib"]
            r["memory_vs_hf_by_phase"] = {
                phase: peak / base["peak_memory_by_phase_gib"][phase]
                for phase, peak in r["peak_memory_by_phase_gib"].items()
            }
        r["step0_loss_rel_diff_vs_hf"] = abs(r["losses"][0] - base["losses"][0]) / abs(base["losses"][0])


def print_table(family: str, results: list[dict]) -> None:
    print(f"\n{family}: {FAMILIES[family].title}")
    print(f"{'setup':<30}{'tokens/s':>10}{'speed-up':>10}{'peak GiB':>10}{'memory':>9}{'step-0 loss':>13}")
    for r in results:
        if "error" in r:
            print(f"{r['label']:<30}  failed: {r['error']}")
            continue
        peak = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        memory = f"{r['memory_vs_hf']:.0%}" if "memory_vs_hf" in r else "-"
        speedup = f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else "-"
        print(f"{r['label']:<30}{r['tokens_per_second']:>10,.0f}{speedup:>10}{peak:>10}{memory:>9}"
              f"{r['losses'][0]:>13.6f}")
    for r in results:
        if r.get("peak_memory_by_phase_gib"):
            peaks = {phase: round(peak, 2) for phase, peak in r["peak_memory_by_phase_gib"].items()}
            print(r["label"], "peak by phase (GiB):", peaks)
    diffs = {r["setup"]: r["step0_loss_rel_diff_vs_hf"] for r in results if "step0_loss_rel_diff_vs_hf" in r}
    if len(diffs) > 1:
        each = ", ".join(f"{setup} {diff:.2e}" for setup, diff in diffs.items())
        print(f"step-0 loss vs hf, relative: max {max(diffs.values()):.2e} ({each})")


def plot(family: str, record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = record["setups"]
    labels = [r["label"].replace("Hugging Face", "HF") for r in results]
    colors = {"hf": "tab:gray", "liger": "tab:blue", "tigon": "tab:orange"}
    config = record["config"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, key, title in zip(axes, ("tokens_per_second", "peak_memory_gib"), (
        f"tokens/s (batch {config['batch']} × {config['seq_len']})", "peak memory (GiB)",
    )):
        values = [r.get(key) or 0 for r in results]
        ax.bar(labels, values, color=[colors[r["setup"]] for r in results])
        ax.set_title(title)
        for i, (r, value) in enumerate(zip(results, values)):
            number = f"{value:,.0f}" if value > 100 else f"{value:.1f}"
            text = "failed" if "error" in r else number if value else "-"
            ax.annotate(text, (i, value), ha="center", va="bottom")
    # Hugging Face's losses as a thick line, the others drawn over it: where they agree, they overlap.
    for r in results:
        if "losses" in r:
            hf = r["setup"] == "hf"
            axes[2].plot(r["losses"], marker="o", label=r["label"].replace("Hugging Face", "HF"),
                         color=colors[r["setup"]], linewidth=4 if hf else 1.5, alpha=0.5 if hf else 1.0)
    axes[2].set(title="loss per step (same data and initial weights)", xlabel="step")
    axes[2].xaxis.get_major_locator().set_params(integer=True)
    axes[2].legend()
    model = f"tiny stand-in for {FAMILIES[family].title}" if config["smoke"] else FAMILIES[family].title
    fig.suptitle(f"{model}, {config['layers']} layers, {config['dtype']}, AdamW "
                 f"({config['optimizer']}), gradient checkpointing — {record['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--image-side", type=int, default=448, help="pixels of each sample's square image")
    parser.add_argument("--attn", default=None, help="attn_implementation for every family (default: the family's)")
    parser.add_argument("--max-search", type=int, default=0, help="search the longest sequence at batch 1 up to this")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 models on CPU: " + ", ".join(
        f"{k.replace('_', '-')} {v}" for k, v in SMOKE.items()))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=SETUPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        # The smoke sizes are its defaults; options given still apply.
        parser.set_defaults(**SMOKE, max_search=0)
        args = parser.parse_args()
        # tigon's and Liger's Triton kernels on CPU tensors (set before they are imported).
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        parser.error("without a GPU only --smoke runs")
    if args.child:
        print("RESULT " + json.dumps([run_family(args, family, args.child) for family in args.family]))
        return 0

    default_out = HERE.parent / "tigon-out" / "e2e_families-smoke" if args.smoke else HERE / "results" / gpu_slug()
    out = args.out or default_out
    out.mkdir(parents=True, exist_ok=True)
    options = ["--layers", str(args.layers), "--seq-len", str(args.seq_len), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--max-search", str(args.max_search), "--image-side", str(args.image_side)]
    options += ["--batch", str(args.batch)] + ["--attn", args.attn] * bool(args.attn)
    options += ["--smoke"] * args.smoke
    # On the GPU each (family, setup) has a process of its own (patching is global; peak memory
    # starts from nothing); on CPU the imports would dominate, so one process per setup runs every
    # family (each setup patches only its families' modules).
    groups = [(args.family, setup) for setup in args.setups] if args.smoke else [
        ([family], setup) for family in args.family for setup in args.setups
    ]
    env = environment("cpu" if args.smoke else "cuda")
    records = {
        family: {
            "family": family, "model": FAMILIES[family].title, "environment": env,
            "config": {"layers": args.layers, "seq_len": args.seq_len, "warmup": args.warmup, "steps": args.steps,
                       "batch": args.batch, **({"image_side": args.image_side} if FAMILIES[family].vision else {}),
                       "dtype": "fp32" if args.smoke else "bf16", "optimizer": "fused",
                       "gradient_checkpointing": "non-reentrant", "smoke": args.smoke},
            "setups": [],
        }
        for family in args.family
    }
    for families, setup in groups:
        command = [sys.executable, __file__, "--child", setup, "--family", *families, *options]
        results = launch(command, f"{setup} on {', '.join(families)}") or [
            {"family": family, "setup": setup, "label": LABELS[setup], "error": "its process failed (see the log)"}
            for family in families
        ]
        for result in results:
            record = records[result["family"]]
            record["setups"].append(result)
            add_comparisons(record["setups"])
            # Written after every process: a run cut short keeps what it measured.
            (out / f"e2e_{result['family']}.json").write_text(json.dumps(record, indent=2))
    for family, record in records.items():
        print_table(family, record["setups"])
        plot(family, record, out / f"e2e_{family}.png")
        print(f"wrote {out / f'e2e_{family}.json'} and {out / f'e2e_{family}.png'}")
    return 0 if any("error" not in r for record in records.values() for r in record["setups"]) else 1


if __name__ == "__main__":
    sys.exit(main())
