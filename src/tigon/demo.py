"""``tigon demo``: train a small Llama twice on the bundled corpus, plain Hugging Face and patched
by tigon, and compare their losses (and, on a GPU, their speed and memory).

Both runs start from the same random weights and see the same batches in the same order, so
their per-step losses must agree to within the dtype's rounding; the demo prints the largest
difference and writes a PNG of both loss curves. On a GPU it also prints each run's tokens per
second and peak memory; without one the kernels run through Triton's interpreter, whose speed
says nothing about a GPU's, so it prints none. The corpus ships inside the package and is read
byte by byte (vocabulary 256): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import math
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from pathlib import Path

import torch

from tigon.bench.machine import BENCH_EXTRA, require_modules

DESCRIPTION = (
    "Train a small Llama twice on the corpus bundled with tigon, plain Hugging Face and patched by tigon, from the "
    "same weights on the same batches; print both runs' losses and their largest difference (and, on a GPU, tokens/s "
    "and peak memory) and write demo.png."
)
SIZES = {
    # name: (hidden, layers, heads, kv heads, intermediate)
    "tiny": (64, 2, 4, 2, 160),
    "small": (256, 4, 8, 4, 688),
    "base": (1024, 8, 16, 8, 2816),
}


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    peak_memory_bytes: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def load_corpus() -> torch.Tensor:
    text = resources.files("tigon").joinpath("data/corpus.txt").read_bytes()
    return torch.tensor(list(text), dtype=torch.long)


def make_batches(corpus: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (steps, batch), generator=generator)
    return [torch.stack([corpus[s : s + seq_len] for s in row.tolist()]) for row in starts]


def build_model(size: str, seq_len: int, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter = SIZES[size]
    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=inter, max_position_embeddings=max(seq_len, 64),
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def train(name, model, batches, lr, device, progress) -> RunResult:
    result = RunResult(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for tokens in progress(batches, desc=name):
        tokens = tokens.to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(loss.item())
        result.tokens += tokens.numel()
    if device.type == "cuda":
        torch.cuda.synchronize()
        result.peak_memory_bytes = torch.cuda.max_memory_allocated()
    result.seconds = time.perf_counter() - start
    return result


def plot(results: list[RunResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    has_memory = all(r.peak_memory_bytes is not None for r in results)
    width = 11 if has_memory else 6
    # Constrained layout makes room for the title; wrapped to the figure, it is never clipped.
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(width, 4), squeeze=False, layout="constrained")
    for result, style in zip(results, ("-", "--")):
        axes[0, 0].plot(range(1, len(result.losses) + 1), result.losses, style, label=result.name)
    axes[0, 0].set(xlabel="step", ylabel="loss", title="training loss")
    axes[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].legend()
    if has_memory:
        names = [r.name for r in results]
        axes[0, 1].bar(names, [r.peak_memory_bytes / 2**30 for r in results], color=["tab:gray", "tab:orange"])
        axes[0, 1].set(ylabel="GiB", title="peak GPU memory")
    fig.suptitle(textwrap.fill(title, width=9 * width))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _int_at_least(minimum: int, meaning: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``; ``meaning`` says why, in argparse's usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum} ({meaning}), got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum} ({meaning}), got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def parser(on_gpu: bool) -> argparse.ArgumentParser:
    """The options; their defaults are for the machine: a real model with a GPU, a tiny one without."""

    def machine_default(gpu, cpu, what="") -> tuple[object, str]:
        return (gpu if on_gpu else cpu), f"(default: {gpu}{what} with a GPU, {cpu}{what} without)"

    parser = argparse.ArgumentParser(prog="tigon demo", description=DESCRIPTION)
    sizes = "; ".join(
        f"{name}: hidden {hidden}, {layers} layers, {heads} heads ({kv_heads} kv), intermediate {inter}"
        for name, (hidden, layers, heads, kv_heads, inter) in SIZES.items()
    )
    size, default = machine_default("base", "tiny")
    parser.add_argument("--size", choices=list(SIZES), default=size, help=f"the Llama's size: {sizes} {default}")
    steps, default = machine_default(30, 8)
    parser.add_argument("--steps", type=_int_at_least(1, "training steps"), default=steps,
                        help=f"training steps of each run {default}")
    seq_len, default = machine_default(1024, 32, " bytes")
    # A causal LM predicts each token from the ones before it: one token alone has no target.
    parser.add_argument("--seq-len", type=_int_at_least(2, "a sequence needs a token to predict and one before it"),
                        default=seq_len, help=f"tokens (bytes of the corpus) per sequence, at least 2 {default}")
    batch, default = machine_default(8, 2)
    parser.add_argument("--batch", type=_int_at_least(1, "sequences per step"), default=batch,
                        help=f"sequences per step {default}")
    parser.add_argument("--lr", type=_positive_float, default=1e-3, help="AdamW's learning rate (default: %(default)g)")
    dtype, default = machine_default("bf16", "fp32")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=dtype, help=f"the models' dtype {default}")
    parser.add_argument("--out", type=Path, default=Path("tigon-out"),
                        help="folder for demo.png, created if missing (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights and of the batches (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    on_gpu = torch.cuda.is_available()
    options = parser(on_gpu)
    args = options.parse_args(argv)
    require_modules("tigon demo", {**BENCH_EXTRA, "transformers": "transformers"})
    corpus = load_corpus()
    # make_batches draws each sequence's start from [0, corpus bytes - seq_len - 1).
    if args.seq_len > corpus.numel() - 2:
        options.error(f"argument --seq-len: the bundled corpus has {corpus.numel()} bytes, so at most "
                      f"{corpus.numel() - 2}; got {args.seq_len}")

    from tqdm import tqdm

    from tigon.transformers import apply_tigon

    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    where = torch.cuda.get_device_name() if on_gpu else "CPU, through Triton's interpreter"
    print(f"tigon demo: Llama '{args.size}' {SIZES[args.size]}, {args.steps} steps of {args.batch}×{args.seq_len} "
          f"bytes, {args.dtype}, on {where}")
    if not on_gpu:
        print("Without a GPU the kernels run through Triton's interpreter: this compares the losses only; "
              "speed is not measured.")
    batches = make_batches(corpus, args.steps, args.batch, args.seq_len, args.seed)
    torch.manual_seed(args.seed)
    plain = build_model(args.size, args.seq_len, dtype, device)
    patched = copy.deepcopy(plain)
    apply_tigon(patched)

    # Through the interpreter the progress bars show no rate (steps per second) either.
    bar_format = None if on_gpu else "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]"
    results = [
        train(name, model, batches, args.lr, device, partial(tqdm, bar_format=bar_format))
        for name, model in (("Hugging Face", plain), ("Hugging Face + tigon", patched))
    ]
    max_diff = max(abs(a - b) for a, b in zip(results[0].losses, results[1].losses))
    speed_columns = f"{'tokens/s':>12}{'peak memory':>14}" if on_gpu else ""
    print(f"{'run':<24}{'first loss':>12}{'last loss':>12}{speed_columns}")
    for r in results:
        speed = f"{r.tokens_per_second:>12.0f}{r.peak_memory_bytes / 2**30:>10.2f} GiB" if on_gpu else ""
        print(f"{r.name:<24}{r.losses[0]:>12.4f}{r.losses[-1]:>12.4f}{speed}")
    print(f"largest per-step loss difference: {max_diff:.2e}")
    if on_gpu:
        speedup = results[1].tokens_per_second / results[0].tokens_per_second
        memory_ratio = results[1].peak_memory_bytes / results[0].peak_memory_bytes
        print(f"tigon: {speedup:.2f}x tokens/s, {memory_ratio:.0%} of the peak memory")
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "demo.png"
    plot(results, png, f"tigon demo: Llama '{args.size}', {args.dtype}, {args.steps} steps on {where}")
    print(f"wrote {png}")
    return 0
