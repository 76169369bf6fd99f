"""End to end: a 4-layer Llama-3-8B- or Qwen3-30B-A3B-shaped model trained with Hugging Face, + Liger-Kernel, + tigon.

Shapes as ../shared/anchors.md: hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocab 128256,
bf16 weights, AdamW, gradient checkpointing, SDPA attention, batch 4 × 4096 tokens. Each setup
runs in its own process (patching is global, and peak memory must start from nothing); each
reports tokens/s over the timed steps, the peak memory of a training step and of each of its
phases (forward, backward, optimizer), and the longest sequence that trains at batch 1 (searched
in steps of 4096 tokens). AdamW is PyTorch's fused one by default, as the Hugging Face Trainer
uses with torch ≥ 2.8 (``adamw_torch_fused``); ``--optimizer foreach`` takes PyTorch's default.
``--memory-profile`` adds, per setup, the largest tensors alive at the peak and where they were
allocated.

``--model qwen3_moe`` trains 4 layers of Qwen3-30B-A3B instead (hidden 2048, 32 heads / 4 KV heads
of dim 128, 128 experts of width 768 with 8 per token and their weights renormalised, vocab 151936,
rope theta 1e6), with the same batch, optimizer and checkpointing. The router's auxiliary loss is as
the released config has it: not computed (``output_router_logits`` false, coefficient 0.001);
``--router-aux-loss`` turns it on. The experts run as each setup has them: Hugging Face with
transformers' default ``experts_implementation`` (``grouped_mm``), Liger with its
``apply_liger_kernel_to_qwen3_moe`` defaults (which replace the experts by its fused MoE,
``LigerExperts``, besides its norms, RoPE and fused linear cross entropy) and tigon with its family
patch and ``experts_implementation="tigon"`` (its fused experts kernel); each result records its
experts' class and implementation.

``--lora`` trains PEFT LoRA adapters instead (r 16, alpha 32, no dropout, on q, k, v, o, gate, up
and down; PEFT's defaults otherwise, so fp32 adapters on the bf16 model), AdamW on the adapters
only, and adds tigon's full fine-tuning of the same model and batch for scale. ``--qlora`` does the
same over a 4-bit base: the decoder's linear layers as bitsandbytes NF4 layers computing in bf16.

``--budget hf`` trains each setup at its best gradient checkpointing within one memory budget:
Hugging Face's own peak with every layer recomputed (``--budget 30`` gives GiB instead). Each
setup, Hugging Face included, runs the same search, :func:`tigon.transformers.fit_checkpointing`,
which probes training steps and keeps the activations of as many of the last layers as fit; each
result records the plan, every probe's peak and the timed steps' own peak against the budget.

``--cuda-graph`` captures each setup's whole training step (forward, backward, AdamW with
``capturable=True``, gradients zeroed in place) as one CUDA graph after three warm-up steps on a
side stream, and replays it on every new batch, copied into the captured input: no host time is
left in the step, which is what small batches are bound by. A setup whose step cannot be captured
(a host sync inside it) fails and says why. The peak memory is the capture's (replays allocate
nothing). It does not combine with ``--budget``, whose plans are probed with eager steps.

    tigon bench e2e [--model llama | llama_1b | qwen3_moe] [--lora | --qlora] [--setups hf liger tigon]
        [--steps 6] [--batch 4] [--seq-len 4096] [--optimizer fused] [--router-aux-loss]
        [--budget hf | GiB] [--cuda-graph] [--out DIR]
    (python -m tigon.bench.e2e takes the same arguments)
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SETUPS = ("hf", "liger", "tigon")
LABELS = {"hf": "Hugging Face", "liger": "Hugging Face + Liger-Kernel", "tigon": "Hugging Face + tigon"}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# With --lora, tigon's full fine-tuning runs last, for scale.
FULL_TIGON = "tigon-full"
# Llama-3-8B's layer shapes (the number of layers is build_model's argument).
LLAMA_3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
)
# Llama-3.2-1B's, all 16 layers, the head tied to the embedding as released (its llama3 RoPE scaling
# changes no shape or cost, and is left out).
LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
)
# Qwen3-30B-A3B's, as its released config.json: every layer a mixture of experts.
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, output_router_logits=False,
    router_aux_loss_coef=0.001,
)


@dataclass(frozen=True)
class Model:
    """A model trained end to end: ``module`` names its folder in ``transformers.models``, its
    Liger patch (``apply_liger_kernel_to_<module>``) and tigon's (``PATCHERS[module]``).

    Attributes:
        title: the model whose layer shapes these are, for tables and plots.
        config_class, model_class: names in the family's modeling module.
        shapes: the released model's shapes (the number of layers is build_model's argument).
        experts: a mixture of experts, whose tigon setup runs tigon's experts kernel.
        layers: the layers trained unless ``--layers`` says otherwise.
        tied: the head shares the embedding's weight.
    """

    title: str
    module: str
    config_class: str
    model_class: str
    shapes: dict
    experts: bool = False
    layers: int = 4
    tied: bool = False


MODELS = {
    "llama": Model("Llama-3-8B", "llama", "LlamaConfig", "LlamaForCausalLM", LLAMA_3_8B),
    "llama_1b": Model("Llama-3.2-1B", "llama", "LlamaConfig", "LlamaForCausalLM", LLAMA_3_2_1B, layers=16, tied=True),
    "qwen3_moe": Model(
        "Qwen3-30B-A3B", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_30B_A3B, experts=True,
    ),
}


def gpu_slug() -> str:
    """The GPU's name as a folder name (benchmarks/results/<slug>/, where tigon bench writes too)."""
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def build_model(
    setup: str, layers: int, device: str = "cuda", *, model: str = "llama", dtype=torch.bfloat16, **shape
):
    """A ``dtype`` causal LM of ``layers`` layers with the shapes of ``MODELS[model]`` (``shape``
    overrides them, for smoke runs), seeded weights, SDPA, non-reentrant gradient checkpointing, in
    training mode; ``setup`` "liger" or "tigon" patches the modeling module first, and a mixture of
    experts built for "tigon" runs its experts by tigon's kernel."""
    spec = MODELS[model]
    options = {}
    if setup == "liger":
        import liger_kernel.transformers

        getattr(liger_kernel.transformers, f"apply_liger_kernel_to_{spec.module}")()
    elif setup == "tigon":
        from tigon.transformers import PATCHERS

        PATCHERS[spec.module]()
        if spec.experts:
            from tigon.transformers.moe import IMPLEMENTATION, register

            register()  # before the model is built: transformers checks the name then
            options["experts_implementation"] = IMPLEMENTATION
    modeling = importlib.import_module(f"transformers.models.{spec.module}.modeling_{spec.module}")
    config_class = getattr(importlib.import_module(f"transformers.models.{spec.module}"), spec.config_class)
    config = config_class(
        **{**spec.shapes, **shape}, num_hidden_layers=layers, tie_word_embeddings=spec.tied, attn_implementation="sdpa",
        **options,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(modeling, spec.model_class)(config).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


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
    """``model`` with PEFT LoRA adapters (r 16, alpha 32) on every linear layer of its decoder."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LORA_TARGETS)))


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


def new_optimizer(model, kind: str, capturable: bool = False) -> torch.optim.Optimizer:
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trained, lr=1e-5, fused=kind == "fused", foreach=kind == "foreach", capturable=capturable)


def train_step(model, optimizer, batch: int, seq_len: int, generator, phase_peaks: dict | None = None) -> float:
    """One step; with ``phase_peaks``, the peak memory (GiB) of each phase is recorded into it."""

    def end_phase(name):
        if phase_peaks is not None:
            torch.cuda.synchronize()
            phase_peaks[name] = max(phase_peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()

    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len), device="cuda", generator=generator)
    if phase_peaks is not None:
        torch.cuda.reset_peak_memory_stats()
    loss = model(input_ids=tokens, labels=tokens).loss
    end_phase("forward")
    loss.backward()
    end_phase("backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    end_phase("optimizer")
    return loss.item()


def captured_train_step(model, optimizer, batch: int, seq_len: int, generator) -> tuple[Callable[[], float], float]:
    """The training step captured as one CUDA graph: → (a call that draws a new batch into the
    captured input, replays the graph and returns the loss; the peak memory (GiB) of the warm-up
    and the capture). ``optimizer`` must be capturable."""
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len), device="cuda", generator=generator)

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the captured gradients stay where the graph wrote them
        return loss.detach()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # Warm-up on a side stream, as capture requires: Triton compiles, cuBLAS picks its kernels,
    # the optimizer's state and the gradients are allocated.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    torch.cuda.synchronize()
    capture_peak = torch.cuda.max_memory_allocated() / 2**30

    def replay() -> float:
        tokens.copy_(torch.randint(0, model.config.vocab_size, tokens.shape, device="cuda", generator=generator))
        graph.replay()
        return loss.item()

    return replay, capture_peak


def peak_tensors(model, optimizer, batch: int, seq_len: int, generator, top: int = 24) -> list[dict]:
    """The ``top`` largest allocations alive at the peak of one recorded step, with the frames of
    tigon, transformers or the optimizer that allocated them."""
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    train_step(model, optimizer, batch, seq_len, generator)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, peak_live, in_use, peak = {}, {}, 0, 0
    for event in (e for trace in snapshot["device_traces"] for e in trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            in_use += event["size"]
            if in_use > peak:
                peak, peak_live = in_use, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            in_use -= live.pop(event["addr"])["size"]
    keep = ("tigon", "transformers", "optim", "autograd", "checkpoint")
    rows = []
    for event in sorted(peak_live.values(), key=lambda e: -e["size"])[:top]:
        frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in event["frames"]]
        ours = [frame for frame, f in zip(frames, event["frames"]) if any(k in f["filename"] for k in keep)]
        rows.append({"mib": event["size"] / 2**20, "frames": (ours or frames)[:4]})
    return rows


def time_steps(step: Callable[[], float], tokens_per_step: int, steps: int,
               phase_step: Callable[[dict], float] | None = None) -> dict:
    """Two warm-up calls of ``step`` (→ the loss), then ``steps`` timed ones: tokens/s of this
    process, the peak memory of its training steps and every step's loss; then, with
    ``phase_step``, one more step that records the peak of each phase."""
    losses = [step() for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    losses += [step() for _ in range(steps)]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30
    phase_peaks = {}
    if phase_step is not None:
        losses.append(phase_step(phase_peaks))
    return {
        "tokens_per_second": tokens_per_step * steps / seconds, "peak_memory_gib": peak,
        "peak_memory_by_phase_gib": phase_peaks, "losses": losses,
    }


def label(setup: str, lora: str | None) -> str:
    """The setup's name in tables and plots; ``lora`` is "LoRA", "QLoRA" or ``None``."""
    if setup == FULL_TIGON:
        return "Hugging Face + tigon, full fine-tuning"
    return LABELS[setup] + (f" + PEFT {lora}" if lora else "")


def fit_budget(model, optimizer, batch: int, seq_len: int, budget: str) -> dict:
    """Fits ``model``'s checkpointing to ``budget`` (GiB, or "self": its own peak with every layer
    recomputed) on a probe batch of the training shape; returns the plan as a result's record."""
    from tigon.transformers import fit_checkpointing

    generator = torch.Generator(device="cuda").manual_seed(1)  # the timed steps' data stay as without probes
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len), device="cuda", generator=generator)
    probe_batch = {"input_ids": tokens, "labels": tokens}
    plan = fit_checkpointing(model, probe_batch, None if budget == "self" else float(budget), optimizer=optimizer)
    return {
        "budget_gib": plan.budget_gib, "layers_kept": plan.kept, "layers_recomputed": plan.recomputed,
        "probe_peak_gib": plan.peak_gib, "probes_gib": plan.probes,
    }


def run_setup(args, setup: str) -> dict:
    batch, seq_len = args.batch, args.seq_len
    lora = (args.lora or args.qlora) and setup != FULL_TIGON
    shape = {"output_router_logits": True} if args.router_aux_loss else {}
    model = build_model("tigon" if setup == FULL_TIGON else setup, args.layers, model=args.model, **shape)
    experts = experts_in(model)
    if lora and args.qlora:
        model = quantize_4bit(model)
    if lora:
        model = with_lora(model)
    optimizer = new_optimizer(model, args.optimizer, capturable=args.cuda_graph)
    checkpointing = fit_budget(model, optimizer, batch, seq_len, args.budget_gib) if args.budget_gib else None
    generator = torch.Generator(device="cuda").manual_seed(0)
    if args.cuda_graph:
        step, capture_peak = captured_train_step(model, optimizer, batch, seq_len, generator)
        timed = time_steps(step, batch * seq_len, args.steps)
        timed["peak_memory_gib"] = max(timed["peak_memory_gib"], capture_peak)
    else:
        timed = time_steps(
            lambda: train_step(model, optimizer, batch, seq_len, generator), batch * seq_len, args.steps,
            lambda phase_peaks: train_step(model, optimizer, batch, seq_len, generator, phase_peaks),
        )
    result = {
        "setup": setup, "label": label(setup, "QLoRA" if args.qlora else "LoRA" if args.lora else None),
        "model": args.model, "lora": lora, "layers": args.layers, "batch": batch,
        "seq_len": seq_len, "steps": args.steps, "optimizer": f"AdamW ({args.optimizer})",
        "cuda_graph": args.cuda_graph,
        **({"experts": experts, "router_aux_loss": args.router_aux_loss} if experts else {}),
        **timed,
    }
    if checkpointing:
        checkpointing["within_budget"] = result["peak_memory_gib"] <= checkpointing["budget_gib"]
        result["checkpointing"] = checkpointing
    if args.memory_profile:
        result["peak_tensors"] = peak_tensors(model, optimizer, batch, seq_len, generator)
    longest = 0
    for trial in range(8192, args.max_search + 1, 4096):
        try:
            train_step(model, optimizer, 1, trial, generator)
            longest = trial
        except torch.OutOfMemoryError:
            break
        finally:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    result["longest_seq_len_batch1"] = longest
    return result


def plot(results: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        r["label"].replace("Hugging Face", "HF").replace(" + ", "\n+ ").replace(", full fine-tuning", "\n(full FT)")
        + (f"\nrecomputes {r['checkpointing']['layers_recomputed']}/{r['layers']} layers" if "checkpointing" in r else "")
        for r in results
    ]
    first = results[0]
    graphed = ", one CUDA graph per step" if first.get("cuda_graph") else ""
    panels = [
        ("tokens_per_second", f"tokens/s (batch {first['batch']} × {first['seq_len']}{graphed})"),
        ("peak_memory_gib", "peak memory (GiB)"),
    ]
    if any(r["longest_seq_len_batch1"] for r in results):  # searched unless --max-search 0
        panels.append(("longest_seq_len_batch1", "longest sequence at batch 1"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, title) in zip(axes, panels):
        ax.bar(labels, [r[key] for r in results], color=["tab:gray", "tab:blue", "tab:orange", "tab:olive"][: len(results)])
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(title)
        for i, r in enumerate(results):
            ax.annotate(f"{r[key]:,.0f}" if r[key] > 100 else f"{r[key]:.1f}", (i, r[key]), ha="center", va="bottom")
    what = "full fine-tuning"
    if results[0]["lora"]:
        what = f"PEFT {'QLoRA (NF4 base)' if 'QLoRA' in results[0]['label'] else 'LoRA'} r 16 on all linear layers"
    checkpointing = "gradient checkpointing"
    if "checkpointing" in first:
        checkpointing = f"checkpointing fitted to {first['checkpointing']['budget_gib']:.1f} GiB"
    fig.suptitle(f"{first['layers']}-layer {MODELS[first['model']].title} shapes, bf16, {what}, {first['optimizer']}, "
                 f"{checkpointing} — {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tigon bench e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama", help="whose layer shapes (default: llama)")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--layers", type=int, default=None, help="default: 4, the whole model for llama_1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-search", type=int, default=65536)
    parser.add_argument("--optimizer", choices=("fused", "foreach"), default="fused")
    parser.add_argument("--memory-profile", action="store_true")
    parser.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters; adds tigon's full fine-tuning")
    parser.add_argument("--qlora", action="store_true", help="as --lora over a bitsandbytes 4-bit NF4 base")
    parser.add_argument("--router-aux-loss", action="store_true",
                        help="with --model qwen3_moe: add the router's auxiliary loss (off in the released config)")
    parser.add_argument("--budget", default=None,
                        help="'hf' or GiB: each setup at its best per-layer checkpointing within this peak")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture each setup's whole training step as one CUDA graph and replay it")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=(*SETUPS, FULL_TIGON), help=argparse.SUPPRESS)
    parser.add_argument("--budget-gib", default=None, help=argparse.SUPPRESS)  # a child's: GiB, or "self"
    args = parser.parse_args(argv)
    if args.layers is None:
        args.layers = MODELS[args.model].layers
    if args.budget is not None:
        if args.budget != "hf" and not _is_positive_number(args.budget):
            parser.error(f"--budget takes 'hf' or a number of GiB, got {args.budget!r}")
        if args.budget == "hf" and "hf" not in args.setups:
            parser.error("--budget hf needs the hf setup (--setups hf ...)")
        if args.lora or args.qlora:
            parser.error("--budget trains full fine-tuning only")
    if args.cuda_graph and (args.lora or args.qlora):
        parser.error("--cuda-graph trains full fine-tuning only")
    if args.cuda_graph and args.budget is not None:
        # The plan is probed with eager steps; a captured step also holds its graph's private memory
        # pool (1.1 GiB over the budget for the 1B at batch 1 x 1024), so the budget would not hold.
        parser.error("--cuda-graph and --budget do not combine: the budget is probed with eager steps")
    if args.model not in ("llama", "llama_1b") and (args.lora or args.qlora):
        parser.error("--lora and --qlora train the Llama model only")
    if args.router_aux_loss and not MODELS[args.model].experts:
        parser.error("--router-aux-loss needs a mixture of experts (--model qwen3_moe)")
    if not torch.cuda.is_available():
        print("tigon bench e2e trains on a GPU; no CUDA device is available here.")
        return 1
    if args.child:
        result = run_setup(args, args.child)
        print("RESULT " + json.dumps(result))
        return 0

    from tigon.bench.command import _default_out

    out = args.out or _default_out(False, torch.cuda.get_device_name())
    out.mkdir(parents=True, exist_ok=True)
    results = []
    lora = args.lora or args.qlora
    setups = [*args.setups, *[FULL_TIGON] * lora]
    if args.budget is not None:  # Hugging Face first: its peak may be the budget
        setups.sort(key=lambda setup: setup != "hf")
        args.max_search = 0
    if args.cuda_graph:  # the longest-sequence search trains eagerly, on other shapes
        args.max_search = 0
    budget = args.budget
    for setup in setups:
        if args.budget == "hf":
            budget = "self" if setup == "hf" else str(results[0]["checkpointing"]["budget_gib"]) if results else None
            if budget is None:
                print("Hugging Face's run failed: no budget to fit the others to")
                return 1
        command = [
            sys.executable, "-m", "tigon.bench.e2e", "--child", setup, "--model", args.model,
            "--layers", str(args.layers),
            "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
            "--max-search", str(args.max_search), "--optimizer", args.optimizer,
            *["--lora"] * args.lora, *["--qlora"] * args.qlora, *["--memory-profile"] * args.memory_profile,
            *["--router-aux-loss"] * args.router_aux_loss, *(["--budget-gib", budget] if budget else []),
            *["--cuda-graph"] * args.cuda_graph,
        ]
        completed = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
        if completed.returncode or not lines:
            print(f"{setup}: failed (exit {completed.returncode})\n{completed.stderr[-3000:]}")
            continue
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    if not results:
        return 1
    base = next((r for r in results if r["setup"] == "hf"), results[0])
    print(f"{'setup':<42}{'tokens/s':>10}{'speed-up':>10}{'peak GiB':>10}{'memory':>9}{'longest T @ B=1':>17}")
    for r in results:
        r["memory_vs_hf_by_phase"] = {
            phase: peak / base["peak_memory_by_phase_gib"][phase] for phase, peak in r["peak_memory_by_phase_gib"].items()
        }
        r["speedup_vs_hf"] = r["tokens_per_second"] / base["tokens_per_second"]
        r["memory_vs_hf"] = r["peak_memory_gib"] / base["peak_memory_gib"]
        print(f"{r['label']:<42}{r['tokens_per_second']:>10,.0f}{r['speedup_vs_hf']:>9.2f}x{r['peak_memory_gib']:>10.1f}"
              f"{r['memory_vs_hf']:>9.0%}{r['longest_seq_len_batch1']:>17,}")
    for r in results:
        if "checkpointing" in r:
            plan = r["checkpointing"]
            print(f"{r['label']}: recomputes {plan['layers_recomputed']} of "
                  f"{plan['layers_recomputed'] + plan['layers_kept']} layers within {plan['budget_gib']:.2f} GiB; "
                  f"probe peak {plan['probe_peak_gib']:.2f}, timed peak {r['peak_memory_gib']:.2f} GiB")
        phases = {k: round(v, 2) for k, v in r["peak_memory_by_phase_gib"].items()}
        print(f"{r['label']} peak by phase (GiB): {phases}" + (f"; experts: {r['experts']}" if "experts" in r else ""))
        for row in r.get("peak_tensors", []):
            print(f"  {row['mib']:9.1f} MiB  " + " <- ".join(row["frames"]))
    name = f"e2e_{args.model}" + ("_qlora" if args.qlora else "_lora" if args.lora else "")
    if args.router_aux_loss:
        name += "_aux_loss"
    if args.budget is not None:
        name += f"_budget_{args.budget}"
    if (args.batch, args.seq_len) != (4, 4096):
        name += f"_b{args.batch}x{args.seq_len}"
    if args.cuda_graph:
        name += "_graph"
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    plot(results, out / f"{name}.png", torch.cuda.get_device_name())
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}")
    return 0


def _is_positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
