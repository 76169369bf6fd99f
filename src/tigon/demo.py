"""``tigon demo``: train a small Llama twice on the bundled corpus, plain Hugging Face and patched
by tigon, and compare losses, speed and memory.

Both runs start from the same random weights and see the same batches in the same order, so
their per-step losses must agree to within the dtype's rounding; the demo prints the largest
difference, tokens per second, peak memory (GPU only) and writes a PNG of both loss curves.
The corpus ships inside the package and is read byte by byte (vocabulary 256): nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

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

    has_memory = all(r.peak_memory_bytes is not None for r in results)
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(11 if has_memory else 6, 4), squeeze=False)
    for result, style in zip(results, ("-", "--")):
        axes[0, 0].plot(range(1, len(result.losses) + 1), result.losses, style, label=result.name)
    axes[0, 0].set(xlabel="step", ylabel="loss", title="training loss")
    axes[0, 0].legend()
    if has_memory:
        names = [r.name for r in results]
        axes[0, 1].bar(names, [r.peak_memory_bytes / 2**30 for r in results], color=["tab:gray", "tab:orange"])
        axes[0, 1].set(ylabel="GiB", title="peak GPU memory")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tigon demo", description=__doc__.splitlines()[0])
    on_gpu = torch.cuda.is_available()
    parser.add_argument("--size", choices=sorted(SIZES), default="base" if on_gpu else "tiny")
    parser.add_argument("--steps", type=int, default=30 if on_gpu else 8)
    parser.add_argument("--seq-len", type=int, default=1024 if on_gpu else 32)
    parser.add_argument("--batch", type=int, default=8 if on_gpu else 2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16" if on_gpu else "fp32")
    parser.add_argument("--out", type=Path, default=Path("tigon-out"), help="folder for demo.png (default: tigon-out)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from tqdm import tqdm

    from tigon.transformers import apply_tigon

    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    where = torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter: correctness only, no speed claims)"
    print(f"tigon demo: Llama '{args.size}' {SIZES[args.size]}, {args.steps} steps of {args.batch}×{args.seq_len} "
          f"bytes, {args.dtype}, on {where}")
    corpus = load_corpus()
    batches = make_batches(corpus, args.steps, args.batch, args.seq_len, args.seed)
    torch.manual_seed(args.seed)
    plain = build_model(args.size, args.seq_len, dtype, device)
    patched = copy.deepcopy(plain)
    apply_tigon(patched)

    results = [
        train("Hugging Face", plain, batches, args.lr, device, tqdm),
        train("Hugging Face + tigon", patched, batches, args.lr, device, tqdm),
    ]
    max_diff = max(abs(a - b) for a, b in zip(results[0].losses, results[1].losses))
    print(f"{'run':<24}{'first loss':>12}{'last loss':>12}{'tokens/s':>12}{'peak memory':>14}")
    for r in results:
        memory = f"{r.peak_memory_bytes / 2**30:.2f} GiB" if r.peak_memory_bytes is not None else "n/a (CPU)"
        print(f"{r.name:<24}{r.losses[0]:>12.4f}{r.losses[-1]:>12.4f}{r.tokens_per_second:>12.0f}{memory:>14}")
    print(f"largest per-step loss difference: {max_diff:.2e}")
    if on_gpu:
        speedup = results[1].tokens_per_second / results[0].tokens_per_second
        memory_ratio = results[1].peak_memory_bytes / results[0].peak_memory_bytes
        print(f"tigon: {speedup:.2f}x tokens/s, {memory_ratio:.0%} of the peak memory")
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "demo.png"
    plot(results, png, f"Llama '{args.size}', {args.dtype}, {where}")
    print(f"wrote {png}")
    return 0
