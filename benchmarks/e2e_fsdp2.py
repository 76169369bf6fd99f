"""End to end on several GPUs: a Llama-3-8B-shaped model under FSDP2, with Hugging Face, + Liger-Kernel, + tigon.

The model, data and training step of tigon bench e2e (bf16 weights, AdamW, gradient checkpointing,
SDPA, batch 4 × 4096 on each GPU), here with 8 decoder layers: each layer is an FSDP2 unit and the
root unit holds the embeddings, the final norm and lm_head, whose weight both fused losses read
inside the root's forward, unsharded. Each setup runs in its own torchrun launch on ``--gpus``
GPUs, then, for the comparison, in one process on one GPU without FSDP (tigon bench e2e's child), so
that one run gives each setup's speed-up and memory saving on one GPU and on several. Reported per
GPU: tokens/s (that GPU's tokens over the timed steps' wall time; the mean over GPUs) and the peak
memory of a training step (the largest over GPUs).

    python benchmarks/e2e_fsdp2.py [--gpus 2] [--setups hf liger tigon] [--layers 8] [--steps 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tigon.bench.e2e import LABELS, SETUPS, build_model, time_steps

HERE = Path(__file__).resolve().parent


def run_sharded(setup: str, layers: int, batch: int, seq_len: int, steps: int) -> dict | None:
    """One process of the torchrun launch; returns the result on rank 0."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world_size = dist.get_rank(), dist.get_world_size()

    model = build_model(setup, layers)  # the same weights in every process, then sharded
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    torch.cuda.empty_cache()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator(device="cuda").manual_seed(rank)  # each GPU its own batch
    measured = time_steps(model, optimizer, batch, seq_len, steps, generator)

    per_gpu = [None] * world_size
    dist.all_gather_object(per_gpu, measured)
    dist.destroy_process_group()
    if rank:
        return None
    return {
        "setup": setup, "label": LABELS[setup], "gpus": world_size, "layers": layers, "batch_per_gpu": batch,
        "seq_len": seq_len, "steps": steps,
        "tokens_per_second_per_gpu": sum(m["tokens_per_second"] for m in per_gpu) / world_size,
        "peak_memory_gib_per_gpu": max(m["peak_memory_gib"] for m in per_gpu),
        "per_gpu": per_gpu,
    }


def launch(command: list[str], what: str) -> dict | None:
    """Run a child command; its result is the JSON after its last ``RESULT `` line."""
    # In a session of its own, so that a run past its time goes with all its processes (the
    # ranks torchrun started would otherwise hold their GPUs).
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        print(f"{what}: timed out\n{stderr[-4000:]}", flush=True)
        return None
    completed = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode or not lines:
        print(f"{what}: failed (exit {completed.returncode})\n{completed.stderr[-4000:]}", flush=True)
        return None
    return json.loads(lines[-1].removeprefix("RESULT "))


def add_ratios(results: list[dict], speed: str, memory: str) -> None:
    base = next((r for r in results if r["setup"] == "hf"), None)
    for r in results:
        if base is not None:
            r["speedup_vs_hf"] = r[speed] / base[speed]
            r["memory_vs_hf"] = r[memory] / base[memory]


def plot(sharded: list[dict], single: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = sharded[0]["gpus"]
    setups = [r["setup"] for r in sharded]
    single_by_setup = {r["setup"]: r for r in single}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.38
    for ax, (shard_key, single_key, title) in zip(axes, (
        ("tokens_per_second_per_gpu", "tokens_per_second", "tokens/s per GPU"),
        ("peak_memory_gib_per_gpu", "peak_memory_gib", "peak memory per GPU (GiB)"),
    )):
        for offset, label, values, color in (
            (-width / 2, "1 GPU", [single_by_setup.get(s, {}).get(single_key, 0) for s in setups], "tab:gray"),
            (width / 2, f"{gpus} GPUs, FSDP2", [r[shard_key] for r in sharded], "tab:orange"),
        ):
            bars = ax.bar([i + offset for i in range(len(setups))], values, width, label=label, color=color)
            ax.bar_label(bars, [f"{v:,.0f}" if v > 100 else f"{v:.1f}" for v in values], fontsize=8)
        ax.set_xticks(range(len(setups)), [LABELS[s].replace("Hugging Face", "HF") for s in setups])
        ax.set_title(title)
        ax.legend(loc="lower right")
    fig.suptitle(f"{sharded[0]['layers']}-layer Llama-3-8B shapes, bf16, AdamW, gradient checkpointing, "
                 f"batch {sharded[0]['batch_per_gpu']} × {sharded[0]['seq_len']} per GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(title: str, results: list[dict], speed: str, memory: str) -> None:
    print(f"\n{title}\n{'setup':<30}{'tokens/s/GPU':>13}{'speed-up':>10}{'peak GiB/GPU':>14}{'memory':>9}")
    for r in results:
        print(f"{r['label']:<30}{r[speed]:>13,.0f}{r.get('speedup_vs_hf', 1):>9.2f}x{r[memory]:>14.1f}"
              f"{r.get('memory_vs_hf', 1):>9.0%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-single", dest="single", action="store_false", help="skip the one-GPU runs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=SETUPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = ["--layers", str(args.layers), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
             "--steps", str(args.steps)]
    if args.child:
        result = run_sharded(args.child, args.layers, args.batch, args.seq_len, args.steps)
        if result is not None:
            print("RESULT " + json.dumps(result))
        return 0

    name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    out = args.out or HERE / "results" / f"{name}-x{args.gpus}"
    out.mkdir(parents=True, exist_ok=True)
    # HF and tigon first, the GPUs' runs before the one-GPU ones: a run cut short loses the least.
    order = sorted(args.setups, key=("hf", "tigon", "liger").index)
    runs = [(setup, args.gpus) for setup in order] + [(setup, 1) for setup in order if args.single]
    sharded, single = [], []
    for setup, gpus in runs:
        if gpus > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                       __file__, "--child", setup, *sizes]
        else:
            command = [sys.executable, "-m", "tigon.bench.e2e", "--child", setup, *sizes, "--max-search", "0"]
        result = launch(command, f"{setup} on {gpus} GPU(s)")
        if result is None:
            continue
        result.pop("longest_seq_len_batch1", None)
        (sharded if gpus > 1 else single).append(result)
        for results in (sharded, single):
            results.sort(key=lambda r: SETUPS.index(r["setup"]))
        add_ratios(sharded, "tokens_per_second_per_gpu", "peak_memory_gib_per_gpu")
        add_ratios(single, "tokens_per_second", "peak_memory_gib")
        # Written after every run: a call cut short keeps what it measured.
        record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sharded": sharded,
                  "single_gpu": single}
        (out / "e2e_fsdp2.json").write_text(json.dumps(record, indent=2))
        print(f"{setup} on {gpus} GPU(s): {json.dumps({k: v for k, v in result.items() if k != 'per_gpu'})}",
              flush=True)
    if not sharded:
        return 1
    print_table(f"{args.gpus} GPUs, FSDP2", sharded, "tokens_per_second_per_gpu", "peak_memory_gib_per_gpu")
    if single:
        print_table("1 GPU, no FSDP", single, "tokens_per_second", "peak_memory_gib")
        plot(sharded, single, out / "e2e_fsdp2.png")
    print(f"wrote {out / 'e2e_fsdp2.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
