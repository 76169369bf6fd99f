"""``tigon bench``: argument parsing and the sweep loop."""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton

import tigon
from tigon.bench import report, runner
from tigon.bench.machine import BENCH_EXTRA, default_out, require_modules, run_device
from tigon.bench.providers import PROVIDERS, load_providers
from tigon.bench.specs import MODES, OPS

# `tigon bench NAME ...`: the module whose main() takes the rest of the arguments.
SUBCOMMANDS = {name: name for name in ("e2e", "moe", "longctx", "axolotl", "parallel", "convergence")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tigon bench",
        usage="tigon bench [OP ...] [options] | tigon bench e2e [options] | tigon bench moe [options] | "
        "tigon bench longctx [options] | tigon bench axolotl [options] | tigon bench parallel [options] | "
        "tigon bench convergence [options]",
        description="Time every op against its peers on this GPU and write CSV, JSON and plots. "
        "Without a GPU, runs a tiny smoke sweep that exercises the harness and times nothing. "
        "`tigon bench e2e` trains models end to end instead (Llama, Qwen3-MoE, Qwen2.5-VL, DeepSeek-V3, GPT-OSS; "
        "under TRL with --trl, FSDP2 with --gpus); `tigon bench moe` times whole MoE blocks; `tigon bench longctx` "
        "searches the longest sequence each setup trains at batch 1 under a memory cap; `tigon bench axolotl` times "
        "Axolotl's own training, plain, with its Liger plugin and with tigon's; `tigon bench parallel` times the "
        "vocabulary-parallel loss and training under tensor and expert parallelism on several GPUs; `tigon bench "
        "convergence` trains bf16 against FP8 (see their --help).",
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help=f"ops to run (default: all): {', '.join(OPS)}")
    parser.add_argument("--mode", choices=MODES, default="full",
                        help=f"what is timed: {', '.join(MODES)} (default: full = forward + backward)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the inputs' dtype (default: bf16)")
    parser.add_argument(
        "--providers", nargs="+", choices=list(PROVIDERS), metavar="PROVIDER",
        help=f"{', '.join(PROVIDERS)} (default: every one that can run here; torch.compile is left out of smoke runs)",
    )
    parser.add_argument(
        "--out", type=Path,
        help="results folder (default: tigon-out/bench-<gpu> of the working directory, tigon-out/bench-smoke for "
        "smoke runs; committed results: --out benchmarks/results/<gpu>)",
    )
    parser.add_argument("--quick", action="store_true", help="only the headline shape of each op (default: every size)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, one call each, no timings (the default without a GPU)")
    args = parser.parse_args(argv)
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")
    args.ops = list(dict.fromkeys(args.ops)) or list(OPS)
    return args


def _progress(total: int):
    from tqdm import tqdm

    # Redraw at most every 30 s when the output is a log rather than a terminal.
    return tqdm(total=total, unit="run", file=sys.stderr, mininterval=1 if sys.stderr.isatty() else 30)


def _sweep(args, sweeps, tables, device, smoke, l2_bytes) -> list[dict]:
    """Every (op, size, provider) of the run, one result row each."""
    dtype = DTYPES[args.dtype]
    tasks = [
        (OPS[op], sweeps[op], size, name)
        for op in args.ops
        for size in ((sweeps[op].headline,) if args.quick else sweeps[op].sizes)
        for name, table in tables.items()
        if op in table
    ]
    rows = []
    with _progress(len(tasks)) as progress:
        for spec, sweep, size, name in tasks:
            progress.set_description(f"{spec.name} {sweep.axis}={size} {name}", refresh=False)
            dims = sweep.shape_dims(size)
            torch.manual_seed(0)  # every provider sees the same input values
            build = functools.partial(spec.build, dims, dtype, device)
            fn = tables[name][spec.name]
            if smoke:
                result = runner.smoke(fn, build, args.mode, device)
            else:
                grads_in_forward = spec.name in PROVIDERS[name].grads_in_forward
                result = runner.measure(fn, build, args.mode, grads_in_forward, l2_bytes)
            rows.append({
                "op": spec.name, "axis": sweep.axis, "size": size, "headline": size == sweep.headline,
                "shape": spec.describe(dims), "dtype": args.dtype, "mode": args.mode, "provider": name,
                "status": result.status, "time_ms": None if result.time_ms is None else round(result.time_ms, 5),
                "work": spec.work_for(dims, dtype.itemsize, args.mode), "unit": spec.unit,
                "peak_mib": None if result.peak_mib is None else round(result.peak_mib, 1),
                "host_ms": None if result.host_ms is None else round(result.host_ms, 4),
                "launch_ms": None if result.launch_ms is None else round(result.launch_ms, 5),
                "smoke": smoke, "note": "; ".join(result.notes),
            })
            progress.update()
    return rows


def _meta(args, sweeps, tables, skipped, device, gpu, smoke, ceilings, l2_bytes) -> dict:
    """What the JSON records besides the rows: the setup, versions, ceilings and how it timed."""
    if smoke:
        timing = "smoke: one call per row, wall-clock, no timing claimed"
    else:
        timing = (
            f"GPU time: median over {runner.MIN_CALLS}-{runner.MAX_CALLS} calls, each enqueued behind a sleep kernel "
            f"longer than the host needs to launch it (CUDA events around the call), after {runner.WARMUP_CALLS} "
            f"warm-up calls; host_ms is one call's host time with the GPU idle; launch_ms is the launch-inclusive "
            f"time, CUDA events around {runner.BACK_TO_BACK_MIN_CALLS}-{runner.MAX_CALLS} calls made back to back "
            f"(no sleep) divided by their number, median of {runner.BACK_TO_BACK_RUNS} runs, and launch_ratio = "
            f"launch_ms / time_ms; inputs rotated over copies "
            f"exceeding 4x L2 ({l2_bytes} bytes), at most {runner.MAX_INPUT_SETS}; floor = bytes over the copy "
            f"ceiling, or FLOPs over the matmul ceiling"
        )
    return {
        "smoke": smoke,
        "gpu": gpu,
        "device": str(device),
        "dtype": args.dtype,
        "mode": args.mode,
        "quick": args.quick,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "tigon": tigon.__version__, "torch": torch.__version__, "triton": triton.__version__,
            **{name: PROVIDERS[name].version() for name in tables if PROVIDERS[name].distribution},
        },
        "ceilings": None if ceilings is None else asdict(ceilings),
        "timing": timing,
        "providers": list(tables),
        "skipped_providers": skipped,
        "ops": {
            op: {
                "shape": OPS[op].describe({**sweep.dims, sweep.axis: sweep.axis}),
                "axis": sweep.axis, "sizes": list(sweep.sizes), "headline": sweep.headline, "unit": OPS[op].unit,
            }
            for op, sweep in sweeps.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return importlib.import_module(f"tigon.bench.{SUBCOMMANDS[argv[0]]}").main(argv[1:])
    args = parse_args(argv)
    require_modules("tigon bench", BENCH_EXTRA)
    started = time.perf_counter()
    smoke, device, gpu = run_device(args.smoke)
    on_gpu = gpu is not None
    if not on_gpu:
        print("No CUDA device: running a tiny smoke sweep through Triton's interpreter on the CPU. "
              "It checks that the harness and the ops run; it measures no timings.")

    provider_names = args.providers or [name for name, p in PROVIDERS.items() if p.in_smoke_run or not smoke]
    if smoke and not args.providers:
        print("torch.compile is left out of smoke runs (compiling is slow without a GPU); name it in --providers to include it.")
    tables, skipped = load_providers(provider_names, on_gpu)
    for name, reason in skipped.items():
        print(f"skipping provider {name}: {reason}")
    if not tables:
        print("no provider can run here")
        return 1

    ceilings = l2_bytes = None
    if not smoke:
        ceilings = runner.measure_ceilings(device)
        l2_bytes = runner.l2_cache_bytes(device)
        print(f"{gpu}: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")

    sweeps = {op: OPS[op].smoke if smoke else OPS[op].sweep for op in args.ops}
    rows = _sweep(args, sweeps, tables, device, smoke, l2_bytes)
    report.add_derived_columns(rows, ceilings)
    meta = _meta(args, sweeps, tables, skipped, device, gpu, smoke, ceilings, l2_bytes)

    out = args.out or default_out(smoke, gpu)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.dtype}-{args.mode}" + ("-quick" if args.quick else "")
    report.write_csv(rows, out / f"bench-{stem}.csv")
    report.write_json(rows, meta, out / f"bench-{stem}.json")
    plots = report.write_plots(rows, meta, out, stem)
    print(report.format_table(rows, meta))
    print(f"\nwrote bench-{stem}.csv, bench-{stem}.json and {len(plots)} plot(s) to {out} "
          f"in {time.perf_counter() - started:.0f} s")
    # Peers failing on a shape are results; tigon failing is a failure of the run.
    return 1 if any(row["provider"] == "tigon" and row["status"] == "error" for row in rows) else 0
