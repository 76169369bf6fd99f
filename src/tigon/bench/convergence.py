"""FP8 convergence: a small Llama trained in bf16 and under each of torchao's float8 recipes, with
tigon, on the same learnable synthetic corpus; the loss curves side by side.

The corpus (:func:`synthetic_corpus`) is generated from a seed, nothing downloaded: a first-order
Markov chain over the vocabulary in which every token has a few successors of Zipf-like
probabilities, so that a model can learn it and its loss has a known floor (the chain's entropy
rate, recorded). Every setup starts from the same weights (seed 0) and sees the same batches in the
same order: ``bf16`` (tigon's kernels, bf16 matmuls) and one per recipe (``tensorwise``,
``rowwise``, ``rowwise_with_gw_hp``: the model converted by torchao's
``convert_to_float8_training`` after ``apply_tigon``, its fused loss in FP8 by the head's recipe).
AdamW (lr 1e-3, cosine to 10%, 5% warm-up), bf16 weights.

The check: each recipe's final loss (the mean of the last 10% of steps) within 1% of bf16's.
Writes ``convergence_fp8.json`` (every step's loss per setup, the final losses, their ratios, the
verdict) and ``convergence_fp8.png`` into ``--out`` (default ``tigon-out/bench-<gpu>``).
``--smoke`` trains a tiny model a few steps on the CPU (through Triton's interpreter): the code
path, no verdict worth reading.

    tigon bench convergence [--steps 300] [--recipes tensorwise rowwise rowwise_with_gw_hp] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from tigon.bench.machine import BENCH_EXTRA, default_out, environment, require_modules
from tigon.ops.fp8 import RECIPES

SIZES = dict(vocab=2048, hidden=512, intermediate=1408, layers=4, heads=8, batch=16, seq_len=512, steps=300)
SMOKE_SIZES = dict(vocab=64, hidden=32, intermediate=64, layers=2, heads=2, batch=2, seq_len=32, steps=6)
SUCCESSORS = 6
TOLERANCE = 0.01
LR, MIN_LR_FRACTION, WARMUP_FRACTION = 1e-3, 0.1, 0.05


def synthetic_corpus(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The chain: ``(successors [V, S], probabilities [V, S], entropy rate in nats)``. Each token's
    ``S`` successors are drawn without repetition; their probabilities fall as ``1 / rank``."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab, generator=generator)[:SUCCESSORS] for _ in range(vocab)])
    weights = 1.0 / torch.arange(1, SUCCESSORS + 1, dtype=torch.float64)
    probabilities = (weights / weights.sum()).expand(vocab, -1).contiguous()
    # Every row has the same distribution, so the entropy rate is one row's entropy.
    entropy = -(probabilities[0] * probabilities[0].log()).sum().item()
    return successors, probabilities.float(), entropy


def sample_batch(successors, probabilities, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, seq_len]`` token ids walked along the chain from uniform starts."""
    vocab = successors.shape[0]
    tokens = torch.empty(batch, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    for position in range(1, seq_len):
        previous = tokens[:, position - 1]
        choice = torch.multinomial(probabilities[previous], 1, generator=generator).squeeze(1)
        tokens[:, position] = successors[previous, choice]
    return tokens


def build(sizes: dict, recipe: str | None, device: str, dtype: torch.dtype):
    """The small Llama (seed-0 weights), patched by tigon, converted to FP8 by ``recipe`` unless ``None``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tigon.transformers import apply_tigon

    config = LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["heads"],
        max_position_embeddings=sizes["seq_len"], tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa" if device == "cuda" else "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    apply_tigon(model)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    return model.train()


def learning_rate(step: int, steps: int) -> float:
    warmup = max(1, int(WARMUP_FRACTION * steps))
    if step < warmup:
        return LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(sizes: dict, recipe: str | None, device: str, dtype: torch.dtype, chain) -> dict:
    """One setup's run: every step's loss and the seconds it took."""
    model = build(sizes, recipe, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)  # the same batches for every setup
    losses = []
    start = time.perf_counter()
    for step in range(sizes["steps"]):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, sizes["steps"])
        tokens = sample_batch(*chain[:2], sizes["batch"], sizes["seq_len"], generator).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "seconds": time.perf_counter() - start}


def final_loss(losses: list[float]) -> float:
    """The mean of the last 10% of the steps (at least one)."""
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in record["runs"].items():
        ax.plot(run["losses"], label=f"{name} (final {run['final_loss']:.4f})", linewidth=1.2)
    ax.axhline(record["entropy_rate"], color="black", linestyle=":", label="the corpus's entropy rate")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"Llama {record['sizes']['layers']} layers × {record['sizes']['hidden']}, tigon, bf16 vs FP8 "
                 "(torchao recipes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    summary = __doc__.split("\n\n")[0].replace("\n", " ")
    parser = argparse.ArgumentParser(prog="tigon bench convergence", description=summary)
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES), metavar="RECIPE",
                        help=f"torchao's float8 recipes to train against bf16 (default: {' '.join(RECIPES)})")
    parser.add_argument("--steps", type=int, help=f"training steps (default: {SIZES['steps']}; "
                        f"{SMOKE_SIZES['steps']} with --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model a few steps in fp32 on the CPU: the code path, no verdict")
    parser.add_argument("--out", type=Path, help="results folder (default: tigon-out/bench-<gpu>)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps takes at least 1, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    require_modules("tigon bench convergence", BENCH_EXTRA)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        print("tigon bench convergence trains on a GPU; no CUDA device is available here. "
              "`tigon bench convergence --smoke` runs a tiny model on the CPU.")
        return 1
    sizes = dict(SMOKE_SIZES if args.smoke else SIZES)
    if args.steps is not None:
        sizes["steps"] = args.steps
    device = "cuda" if on_gpu and not args.smoke else "cpu"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    out = args.out or default_out(args.smoke, torch.cuda.get_device_name() if on_gpu else None)
    out.mkdir(parents=True, exist_ok=True)
    chain = synthetic_corpus(sizes["vocab"])
    record: dict = {"sizes": sizes, "smoke": args.smoke, "entropy_rate": chain[2], "tolerance": TOLERANCE,
                    "environment": environment(device), "runs": {}}
    for recipe in (None, *args.recipes):
        name = recipe or "bf16"
        print(f"{name} ...", flush=True)
        run = train(sizes, recipe, device, dtype, chain)
        run["final_loss"] = final_loss(run["losses"])
        record["runs"][name] = run
        print(f"{name}: final loss {run['final_loss']:.4f} ({run['seconds']:.0f} s)", flush=True)
    base = record["runs"]["bf16"]["final_loss"]
    record["final_vs_bf16"] = {name: run["final_loss"] / base for name, run in record["runs"].items() if name != "bf16"}
    record["within_tolerance"] = all(abs(ratio - 1) <= TOLERANCE for ratio in record["final_vs_bf16"].values())
    (out / "convergence_fp8.json").write_text(json.dumps(record, indent=2))
    plot(record, out / "convergence_fp8.png")
    for name, ratio in record["final_vs_bf16"].items():
        print(f"{name}: final loss {ratio:.4f}× bf16's")
    print(f"{'within' if record['within_tolerance'] else 'NOT within'} {TOLERANCE:.0%} of bf16; wrote "
          f"{out / 'convergence_fp8.json'} and {out / 'convergence_fp8.png'}")
    return 0 if record["within_tolerance"] or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
