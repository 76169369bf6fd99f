"""``tigon bench longctx``: the longest sequence each setup trains at batch 1 under a memory cap, and
its tokens/s at every length it trained.

The model is a whole Llama-3.1-8B by default (``--model llama``: 32 layers of
:mod:`tigon.bench.e2e_models`' Llama-3-8B shapes, hidden 4096, MLP 14336, 32 heads / 8 KV heads,
vocabulary 128256; 3.1 differs only by its RoPE scaling and context length, which change no shape
or cost), random weights built from its config, bf16, SDPA attention; ``--layers`` shrinks it,
``--model llama_1b`` takes Llama-3.2-1B's 16 layers instead. What is trained (as ``tigon bench e2e
--lora``, ``--qlora`` and its default loop):

- ``--lora`` (default): PEFT LoRA adapters, r 16 on every linear layer of the decoder, fp32 on the
  bf16 model; fused AdamW on the adapters.
- ``--full``: every weight, fused AdamW (the whole 8B does not fit 80 GiB this way: bf16 weights
  and gradients and AdamW's fp32 state take ~90 GiB before any activation; shrink it with ``--layers``).
- ``--qlora``: as ``--lora`` over bitsandbytes NF4 linear layers computing in bf16 (skipped, with
  the reason recorded, where bitsandbytes or a GPU is missing).

Setups, each in a process of its own (:mod:`tigon.bench.processes`), all with Hugging Face's
non-reentrant gradient checkpointing on every decoder layer:

- ``hf``: Hugging Face (+ PEFT) alone.
- ``liger``: Liger-Kernel's patch for Llama applied before the model is built, as ``tigon bench
  e2e`` does (skipped where Liger-Kernel is not installed).
- ``tigon``: ``tigon.transformers.apply_tigon(model)`` on the built (PEFT) model, every layer
  recomputed (``fit_checkpointing`` is left out: each of its probes is a whole step, slow at long
  ``T``, and at the longest ``T`` that trains it keeps no layer anyway).
- ``tigon-offload``: tigon's long-context path: ``apply_tigon(model, mlp_tile_tokens="auto")`` (the
  gated MLP over tiles of the sequence) and ``set_checkpointing(model, 0, offload=True)`` (every
  layer recomputed, its saved input in pinned host memory until its backward); each length also
  records the pinned host memory that took (``host_memory_gib``).

Each process caps its GPU memory at ``--cap-gib`` (``torch.cuda.set_per_process_memory_fraction``,
default 80 GiB: an H200 then runs out where an H100 would) and searches the sequence length ``T``
at batch 1 (:func:`search_lengths`): from ``--start`` (default ``--step``), doubling while a step
trains and then bisecting between the longest that trained and the shortest that ran out of
memory, in multiples of ``--step`` (default 16384) up to ``--max-tokens``; ``--lengths`` measures
the lengths given instead, in increasing order. At each ``T``: ``--warmup`` untimed training steps
(default 1), then ``--steps`` timed ones (default 1): tokens/s and the peak memory allocated by the timed steps. Out
of memory (the GPU's, or the host's for pinned buffers) ends the doubling (and the list of ``--lengths``); any other error ends the setup and is
recorded. A result records every length tried, the longest that trained and the shortest that
failed. Child processes run with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the
environment sets it (the long steps' allocations vary in size; every setup gets the same).

``--smoke`` (the only run without a GPU) trains the tiny Llama of :mod:`tigon.bench.e2e_models`
(2 layers, hidden 64), fp32, through the same code: the search from 32 tokens in steps of 32 up to
64 (two lengths), one warm-up and one timed step each, nothing capped; its timings mean nothing.

Writes ``longctx_<model>_<mode>[_l<layers>].json``, ``.csv`` (a row per setup and length, or per
setup that measured nothing, with its reason) and ``.png`` (tokens/s and peak memory against
``T``, one line per setup) into ``--out`` (default ``tigon-out/bench-<gpu>`` of the working
directory, ``tigon-out/bench-smoke`` for smoke runs), rewritten after each setup. A setup whose
process is killed past ``--timeout`` (or dies) keeps the lengths it measured, with an error.

    tigon bench longctx [--model llama | llama_1b] [--lora | --full | --qlora] [--setups SETUP ...]
        [--layers L] [--cap-gib 80] [--start T] [--step 16384] [--max-tokens 524288] [--lengths T ...]
        [--warmup 1] [--steps 1] [--timeout S] [--smoke] [--out DIR]
    (python -m tigon.bench.longctx takes the same arguments)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tigon.bench.e2e import new_optimizer, time_steps, train_step
from tigon.bench.e2e_models import build_model, quantize_4bit, text_batch, with_lora
from tigon.bench.machine import BENCH_EXTRA, default_out, environment, require_modules, run_device
from tigon.bench.processes import failure_record, launch, print_result
from tigon.bench.report import write_csv

SETUPS = ("hf", "liger", "tigon", "tigon-offload")
LABELS = {
    "hf": "Hugging Face", "liger": "Hugging Face + Liger-Kernel", "tigon": "Hugging Face + tigon",
    "tigon-offload": "Hugging Face + tigon, offloaded checkpoints, tiled MLP",
}
COLORS = {"hf": "tab:gray", "liger": "tab:blue", "tigon": "tab:orange", "tigon-offload": "tab:red"}
MODES = {"lora": "PEFT LoRA r 16", "full": "full fine-tuning", "qlora": "PEFT QLoRA r 16 (NF4 base)"}
# The models, by their names in e2e_models.MODELS: the released model whose shapes they take, and
# its depth (the default --layers).
MODELS = {"llama": ("Llama-3.1-8B", 32), "llama_1b": ("Llama-3.2-1B", 16)}
SMOKE = {"layers": 2, "start": 32, "step": 32, "max_tokens": 64}
DEFAULT_STEP, DEFAULT_MAX_TOKENS, DEFAULT_CAP_GIB, TIMEOUT_S = 16384, 524288, 80.0, 7200
OUT_OF_MEMORY = "out of memory"
# The CSV's columns: one row per (setup, length tried), or per setup that measured nothing.
COLUMNS = (
    "setup", "label", "model", "mode", "layers", "seq_len", "status", "tokens_per_second", "peak_memory_gib",
    "host_memory_gib", "cap_gib", "note",
)


# The search.


def search_lengths(fits: Callable[[int], bool], start: int, step: int, max_tokens: int) -> tuple[int, int | None]:
    """The longest multiple of ``step`` in ``[start, max_tokens]`` for which ``fits(T)``, assuming
    that every length below one that fits also fits: ``T`` doubles from ``start`` while it fits (the
    last doubling clipped to ``max_tokens`` rounded down to ``step``), then bisects, in multiples of
    ``step``, between the longest that fitted and the shortest that did not.

    ``start`` is a multiple of ``step``, at most ``max_tokens``. Returns ``(longest, first_failed)``:
    the longest length that fitted (0 if ``start`` did not) and the shortest that did not (``None``
    if ``max_tokens`` fitted); ``fits`` is called on each length once, in the order tried."""
    top = max_tokens // step * step
    longest, failed, length = 0, None, start
    while failed is None:
        if not fits(length):
            failed = length
        elif length == top:
            return length, None
        else:
            longest, length = length, min(2 * length, top)
    while longest and failed - longest > step:
        middle = longest + (failed - longest) // (2 * step) * step
        if fits(middle):
            longest = middle
        else:
            failed = middle
    return longest, failed


def measure_lengths(fits: Callable[[int], bool], lengths: Iterable[int]) -> tuple[int, int | None]:
    """``fits`` on each of ``lengths`` in increasing order until one does not: ``(longest,
    first_failed)`` as :func:`search_lengths` returns them."""
    longest = 0
    for length in sorted(set(lengths)):
        if not fits(length):
            return longest, length
        longest = length
    return longest, None


# One setup, in its own process.


def skip_reason(setup: str, mode: str, on_gpu: bool) -> str | None:
    """Why ``setup`` cannot train in ``mode`` here (a peer not installed, QLoRA without a GPU), or ``None``."""
    if setup == "liger" and importlib.util.find_spec("liger_kernel") is None:
        return "Liger-Kernel is not installed"
    if mode == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes (QLoRA's NF4 layers) is not installed"
    if mode == "qlora" and not on_gpu:
        return "bitsandbytes' NF4 layers need a GPU"
    return None


def cap_memory(cap_gib: float) -> float:
    """Cap this process's allocations on the current GPU at ``cap_gib`` GiB (all of it if it has
    less); returns the GPU's memory in GiB."""
    device_gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib / device_gib))
    return device_gib


def build_setup(args: argparse.Namespace, setup: str, device: str) -> torch.nn.Module:
    """The model ``setup`` trains, on ``device``, as the module docstring describes."""
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = build_model("liger" if setup == "liger" else "hf", args.layers, device, model=args.model, dtype=dtype,
                        tiny=args.smoke, attention=args.attn)
    if args.mode == "qlora":
        model = quantize_4bit(model)
    if args.mode != "full":
        model = with_lora(model)
    if setup in ("tigon", "tigon-offload"):
        from tigon.transformers import apply_tigon

        if setup == "tigon":
            apply_tigon(model)
        else:
            from tigon.transformers import set_checkpointing

            apply_tigon(model, mlp_tile_tokens="auto")
            set_checkpointing(model, 0, offload=True)
    return model


def release(optimizer: torch.optim.Optimizer, device: str) -> None:
    """Free what a step left behind (after an out-of-memory error, its gradients and cached blocks)."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_setup(args: argparse.Namespace, setup: str, device: str, progress: Callable[[dict], None]) -> dict:
    """Train ``setup`` at each length of the search (or of ``args.lengths``) in this process;
    ``progress(result)`` is called with the result so far before and after each length."""
    result: dict = {"setup": setup, "label": LABELS[setup], "measurements": [], "complete": False}
    try:
        if device == "cuda":
            result["device_gib"] = cap_memory(args.cap_gib)
        model = build_setup(args, setup, device)
        optimizer = new_optimizer(model, "fused")
        generator = torch.Generator(device=device).manual_seed(0)
        host_bytes = None
        if setup == "tigon-offload":
            from tigon.transformers import offload_host_bytes

            host_bytes = offload_host_bytes

        def fits(seq_len: int) -> bool:
            def step() -> float:
                return train_step(model, optimizer, text_batch(model.config, 1, seq_len, generator))

            # "unfinished" until measured: what a process killed at this length leaves in its last result.
            row: dict = {"seq_len": seq_len, "status": "unfinished"}
            result["measurements"].append(row)
            progress(result)
            try:
                measured = time_steps(step, seq_len, args.warmup, args.steps, device)
            except torch.OutOfMemoryError:
                row["status"] = OUT_OF_MEMORY
            except MemoryError:  # the host's: tigon's offloader refuses pinned buffers it cannot have
                row["status"] = "out of host memory"
            except Exception:
                row["status"] = "error"
                raise
            else:
                row.update({key: measured[key] for key in ("tokens_per_second", "peak_memory_gib", "losses")},
                           status="ok")
                if host_bytes is not None:
                    row["host_memory_gib"] = host_bytes(model) / 2**30
            release(optimizer, device)
            progress(result)
            return row["status"] == "ok"

        if args.lengths:
            measure_lengths(fits, args.lengths)
        else:
            search_lengths(fits, args.start, args.step, args.max_tokens)
    except Exception as error:  # noqa: BLE001  (recorded: a patch raising, an API missing, a kernel failing at some T)
        traceback.print_exc()
        result.update(failure_record(error))
    result["complete"] = True
    return result


def run_child(args: argparse.Namespace) -> int:
    """The ``--child`` process: one setup, its results so far printed before and after every length."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run_setup(args, args.child, device, print_result)
    print_result(result)
    return 0


# Results.


def summarize(result: dict) -> None:
    """Add the longest length that trained and the shortest that failed to ``result``."""
    trained = [row["seq_len"] for row in result["measurements"] if row["status"] == "ok"]
    failed = [row["seq_len"] for row in result["measurements"] if row["status"] != "ok"]
    result["longest_seq_len"] = max(trained, default=0)
    result["first_failed_seq_len"] = min(failed, default=None)


def csv_rows(record: dict) -> list[dict]:
    """A row per setup and length tried; a row of its own for a setup that measured nothing (why
    in ``note``)."""
    common = {"model": record["model"], "mode": record["mode"], "layers": record["config"]["layers"],
              "cap_gib": record["config"]["cap_gib"]}
    rows = []
    for result in record["results"]:
        reason = result.get("skipped") or result.get("error")
        setup = {"setup": result["setup"], "label": result["label"], **common}
        for row in result["measurements"]:
            note = reason if row["status"] == "error" else None
            rows.append({**setup, **row, "note": note})
        if not result["measurements"]:
            rows.append({**setup, "status": "skipped" if "skipped" in result else "error", "note": reason})
    return rows


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(record: dict) -> None:
    smoke = " (smoke run: the timings mean nothing)" if record["smoke"] else ""
    print(f"\n{record['title']}, {record['config']['layers']} layers, {MODES[record['mode']]}, batch 1{smoke}")
    width = max(len(result["label"]) for result in record["results"]) + 2
    print(f"{'setup':<{width}}{'T':>9}{'tokens/s':>12}{'peak GiB':>10}{'host GiB':>10}")
    for result in record["results"]:
        if not result["measurements"]:
            print(f"{result['label']:<{width}}{'skipped' if 'skipped' in result else 'failed'}: "
                  f"{result.get('skipped') or result.get('error')}")
        for row in result["measurements"]:
            cells = f"  {row['status']}"
            if row["status"] == "ok":
                cells = "".join(f"{_number(row.get(key), spec):>{size}}" for key, spec, size in (
                    ("tokens_per_second", ",.0f", 12), ("peak_memory_gib", ".2f", 10), ("host_memory_gib", ".2f", 10)))
            print(f"{result['label']:<{width}}{row['seq_len']:>9}{cells}")
        if result["measurements"]:
            failed = result["first_failed_seq_len"]
            print(f"{result['label']:<{width}}longest {result['longest_seq_len']:,}"
                  + (f", first failed {failed:,}" if failed else ", none failed")
                  + (f"; {result['error']}" if "error" in result else ""))


def plot(record: dict, path: Path) -> None:
    """Tokens/s and peak memory against the sequence length, one line per setup; a cross at the
    shortest length that failed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = record["config"]
    panels = [("tokens_per_second", "tokens/s")]
    if not record["smoke"]:  # no memory counter on the CPU
        panels.append(("peak_memory_gib", "peak memory allocated (GiB)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    lengths = sorted({row["seq_len"] for r in record["results"] for row in r["measurements"]})
    for ax, (key, title) in zip(axes[0], panels):
        for result in record["results"]:
            color = COLORS[result["setup"]]
            trained = [(row["seq_len"], row[key]) for row in result["measurements"] if row["status"] == "ok"]
            label = result["label"].replace("Hugging Face", "HF") + f" (longest {result['longest_seq_len']:,})"
            if trained:
                ax.plot(*zip(*sorted(trained)), marker="o", color=color, label=label)
            if result["first_failed_seq_len"] is not None:
                ax.axvline(result["first_failed_seq_len"], color=color, linestyle=":", linewidth=1)
                ax.plot([result["first_failed_seq_len"]], [0], marker="x", color=color, markersize=9, clip_on=False,
                        label=None if trained else label)
        if key == "peak_memory_gib" and config["cap_gib"] is not None:
            ax.axhline(config["cap_gib"], color="black", linestyle="--", linewidth=1, label=f"cap {config['cap_gib']:g} GiB")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{t // 1024}K" if t >= 1024 else str(t) for t in lengths], rotation=30)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set(xlabel="sequence length T (batch 1); x: shortest that failed", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    device = record["environment"]["device"]
    model = f"{config['layers']}-layer {record['title']}"
    if record["smoke"]:
        model, device = f"tiny stand-in for {record['title']}", f"{device} (smoke run: timings mean nothing)"
    elif config["cap_gib"] is not None:
        device += f", capped at {config['cap_gib']:g} GiB"
    fig.suptitle(f"{model}, {config['dtype']}, {MODES[record['mode']]}, gradient checkpointing\n{device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def file_stem(args: argparse.Namespace) -> str:
    stem = f"longctx_{args.model}_{args.mode}"
    return stem if args.smoke or args.layers == MODELS[args.model][1] else f"{stem}_l{args.layers}"


def write(record: dict, out: Path, stem: str, with_plot: bool) -> None:
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    write_csv(csv_rows(record), out / f"{stem}.csv", COLUMNS)
    if with_plot:
        plot(record, out / f"{stem}.png")


# The command.


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="tigon bench longctx",
        description=" ".join(__doc__.split("\n\n")[0].replace("``", "").split()) + " See python -m pydoc tigon.bench.longctx.",
    )
    what = parser.add_argument_group("what is trained")
    what.add_argument("--model", choices=list(MODELS), default="llama",
                      help="llama: Llama-3.1-8B's shapes; llama_1b: Llama-3.2-1B's (default: llama)")
    modes = what.add_mutually_exclusive_group()
    for mode, summary in MODES.items():
        modes.add_argument(f"--{mode}", dest="mode", action="store_const", const=mode,
                           help=summary + (" (the default)" if mode == "lora" else ""))
    what.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS), metavar="SETUP",
                      help=f"{', '.join(SETUPS)} (default: all)")
    what.add_argument("--layers", type=int, help="decoder layers (default: the whole model, 32 for llama and 16 for "
                      "llama_1b; 2 with --smoke)")
    what.add_argument("--attn", default="sdpa", help="attn_implementation of the model (default: sdpa)")
    search = parser.add_argument_group("the lengths")
    search.add_argument("--cap-gib", type=float, default=DEFAULT_CAP_GIB,
                        help=f"GPU memory each setup may allocate, GiB (default: {DEFAULT_CAP_GIB:g}, about an H100's)")
    search.add_argument("--step", type=int, help=f"lengths are multiples of this (default: {DEFAULT_STEP}; 32 with "
                        "--smoke)")
    search.add_argument("--start", type=int, help="the first length tried, a multiple of --step (default: --step)")
    search.add_argument("--max-tokens", type=int, help=f"the longest length tried (default: {DEFAULT_MAX_TOKENS}; "
                        "64 with --smoke)")
    search.add_argument("--lengths", nargs="+", type=int, metavar="T",
                        help="measure these lengths (in increasing order, until one fails) instead of searching")
    search.add_argument("--steps", type=int, default=1, help="timed steps at each length (default: 1)")
    search.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default: 1; 0 for lengths "
                        "whose steps take minutes: the one step then also warms up)")
    run = parser.add_argument_group("the run")
    run.add_argument("--smoke", action="store_true",
                     help="a tiny fp32 model, on the CPU without a GPU: checks the code paths, times nothing")
    run.add_argument("--timeout", type=float, default=TIMEOUT_S,
                     help=f"seconds each setup's process may take; it keeps what it measured (default: {TIMEOUT_S})")
    run.add_argument("--out", type=Path, help="results folder (default: tigon-out/bench-<gpu> of the working "
                     "directory; tigon-out/bench-smoke with --smoke)")
    parser.add_argument("--child", choices=SETUPS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.mode = args.mode or "lora"
    args.setups = list(dict.fromkeys(args.setups))
    return parser, args


def resolve_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the sizes not given (the smoke run's, or the defaults) and refuse those that cannot run."""
    defaults = dict(SMOKE) if args.smoke else {"layers": MODELS[args.model][1], "step": DEFAULT_STEP,
                                               "max_tokens": DEFAULT_MAX_TOKENS}
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.start is None:
        args.start = args.step
    for name in ("layers", "step", "start", "max_tokens", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} takes at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup takes at least 0, got {args.warmup}")
    if args.lengths and min(args.lengths) < 1:
        parser.error(f"--lengths takes lengths of at least 1, got {args.lengths}")
    if args.start % args.step:
        parser.error(f"--start must be a multiple of --step ({args.step}), got {args.start}")
    if args.start > args.max_tokens:
        parser.error(f"--start ({args.start}) is above --max-tokens ({args.max_tokens})")
    if args.cap_gib <= 0:
        parser.error(f"--cap-gib takes a positive number of GiB, got {args.cap_gib}")


def new_record(args: argparse.Namespace, device: str) -> dict:
    on_gpu = device == "cuda"
    return {
        "model": args.model, "title": MODELS[args.model][0], "mode": args.mode,
        "smoke": args.smoke, "environment": environment(device),
        "config": {
            "layers": args.layers, "dtype": "fp32" if args.smoke else "bf16", "batch": 1, "attention": args.attn,
            "optimizer": "AdamW (fused)", "gradient_checkpointing": "non-reentrant", "cap_gib": args.cap_gib if on_gpu
            else None, "lengths": args.lengths, "start": args.start, "step": args.step, "max_tokens": args.max_tokens,
            "warmup_steps": args.warmup, "timed_steps": args.steps,
            "allocator": child_environment().get("PYTORCH_CUDA_ALLOC_CONF") if on_gpu else None,
        },
        "results": [],
    }


def child_environment() -> dict[str, str]:
    """This process's environment, with expandable segments unless it says how to allocate."""
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, args = parse_args(argv)
    resolve_sizes(parser, args)
    require_modules("tigon bench longctx", BENCH_EXTRA)
    if args.child:
        return run_child(args)
    smoke, _, gpu = run_device(args.smoke)
    if gpu is None and not args.smoke:
        print("tigon bench longctx trains on a GPU; no CUDA device is available here. "
              "`tigon bench longctx --smoke` runs a tiny model on the CPU (it times nothing).")
        return 1
    device = "cuda" if gpu else "cpu"
    out = args.out or default_out(smoke, gpu)
    out.mkdir(parents=True, exist_ok=True)
    stem = file_stem(args)
    record = new_record(args, device)
    for setup in args.setups:
        result: dict = {"setup": setup, "label": LABELS[setup], "measurements": []}
        reason = skip_reason(setup, args.mode, gpu is not None)
        if reason:
            result["skipped"] = reason
        else:
            print(f"{setup} ...", flush=True)
            command = [sys.executable, "-m", "tigon.bench.longctx", *argv, "--child", setup]
            result = launch(command, setup, args.timeout, child_environment()) or result
            if not result.pop("complete", False):
                # Killed past its time or crashed (the host out of memory): what it measured stands.
                result.setdefault("error", "its process ended before its search did (see the log)")
        summarize(result)
        record["results"].append(result)
        write(record, out, stem, with_plot=False)
    print_table(record)
    measured = any(row["status"] == "ok" for r in record["results"] for row in r["measurements"])
    write(record, out, stem, with_plot=measured)
    print(f"wrote {out / stem}.json, .csv" + (" and .png" if measured else ""))
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
