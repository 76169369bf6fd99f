"""Results of a run: derived columns, a plain-text table, CSV + JSON, one PNG per op."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

from tigon.bench.runner import Ceilings
from tigon.bench.specs import BYTES

COLUMNS = (
    "op", "axis", "size", "headline", "shape", "dtype", "mode", "provider", "status",
    "time_ms", "work", "unit", "floor_ms", "gbps", "tflops", "pct_of_ceiling",
    "speedup_vs_torch", "speedup_vs_compile", "peak_mib", "host_ms", "launch_ms", "launch_ratio", "smoke", "note",
)

SMOKE_BANNER = (
    "SMOKE RUN: no timings. Tiny shapes, one call each on this machine (no GPU, or --smoke); "
    "'wall ms' is the wall-clock of that call, shown only to prove the harness ran."
)


def add_derived_columns(rows: list[dict], ceilings: Ceilings | None) -> None:
    """Fill floor, GB/s or TFLOP/s, % of the ceiling, the speedups over torch and torch.compile
    (their time divided by this row's: above 1 is faster) and the launch-inclusive time over the
    GPU time."""
    baseline = {
        (row["op"], row["size"], row["provider"]): row["time_ms"]
        for row in rows
        if row["status"] == "ok" and row["provider"] in ("torch", "torch.compile")
    }
    for row in rows:
        for column in (
            "floor_ms", "gbps", "tflops", "pct_of_ceiling", "speedup_vs_torch", "speedup_vs_compile", "launch_ratio",
        ):
            row[column] = None
        time_ms = row["time_ms"]
        if row["status"] != "ok" or time_ms is None or time_ms <= 0:
            continue
        if row["launch_ms"] is not None:
            row["launch_ratio"] = round(row["launch_ms"] / time_ms, 2)
        if ceilings is None:
            continue
        if row["unit"] == BYTES:
            row["floor_ms"] = row["work"] / (ceilings.copy_gbps * 1e6)
            row["gbps"] = round(row["work"] / (time_ms * 1e6), 1)
        else:
            row["floor_ms"] = row["work"] / (ceilings.matmul_tflops * 1e9)
            row["tflops"] = round(row["work"] / (time_ms * 1e9), 1)
        row["pct_of_ceiling"] = round(100 * row["floor_ms"] / time_ms, 1)
        row["floor_ms"] = round(row["floor_ms"], 5)
        for column, provider in (("speedup_vs_torch", "torch"), ("speedup_vs_compile", "torch.compile")):
            reference_ms = baseline.get((row["op"], row["size"], provider))
            if reference_ms is not None:
                row[column] = round(reference_ms / time_ms, 3)


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _status_and_note(row: dict) -> str:
    status = "" if row["status"] in ("ok", "smoke") else row["status"]
    return " ".join(part for part in (status, row["note"]) if part)


def format_table(rows: list[dict], meta: dict) -> str:
    if meta["smoke"]:
        lines = [SMOKE_BANNER, ""]
    else:
        ceilings = meta["ceilings"]
        lines = [
            f"{meta['gpu']}: copy ceiling {ceilings['copy_gbps']:.0f} GB/s (read + write), "
            f"bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s. Median times, mode {meta['mode']}; "
            "floor = work / ceiling; vs torch / vs compile = their time / this time; "
            "peak = extra MiB of one forward+backward; host = the host's ms per call (hidden while the GPU is behind); "
            "launch = ms per call made back to back (host time not hidden), /gpu = launch / time.",
            "",
        ]
    for op in dict.fromkeys(row["op"] for row in rows):
        op_rows = [row for row in rows if row["op"] == op]
        first = op_rows[0]
        rate = "GB/s" if first["unit"] == BYTES else "TFLOP/s"
        lines.append(f"{op}: {meta['ops'][op]['shape']}, {first['dtype']}, {first['mode']}")
        if meta["smoke"]:
            lines.append(f"  {first['axis']:>8}  {'provider':<14}{'status':>8}{'wall ms':>10}  note")
        else:
            lines.append(
                f"  {first['axis']:>8}  {'provider':<14}{'time ms':>9}{'floor':>8}{rate:>9}{'% ceil':>8}"
                f"{'vs torch':>10}{'vs compile':>11}{'peak MiB':>10}{'host ms':>9}{'launch':>9}{'/gpu':>7}  note"
            )
        for row in op_rows:
            size = ("* " if row["headline"] else "") + str(row["size"])
            if meta["smoke"]:
                columns = f"{row['status']:>8}{_fmt(row['time_ms'], '.1f'):>10}"
            else:
                columns = (
                    f"{_fmt(row['time_ms'], '.3f'):>9}{_fmt(row['floor_ms'], '.3f'):>8}"
                    f"{_fmt(row['gbps'] if rate == 'GB/s' else row['tflops'], '.0f'):>9}"
                    f"{_fmt(row['pct_of_ceiling'], '.0f', '%'):>8}"
                    f"{_fmt(row['speedup_vs_torch'], '.2f', 'x'):>10}{_fmt(row['speedup_vs_compile'], '.2f', 'x'):>11}"
                    f"{_fmt(row['peak_mib'], '.0f'):>10}{_fmt(row['host_ms'], '.3f'):>9}"
                    f"{_fmt(row['launch_ms'], '.3f'):>9}{_fmt(row['launch_ratio'], '.2f', 'x'):>7}"
                )
            lines.append(f"  {size:>8}  {row['provider']:<14}{columns}  {_status_and_note(row)}")
        lines.append("")
    lines.append("* headline shape (docs/anchors).")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path, columns: Sequence[str] = COLUMNS) -> None:
    """``rows`` as CSV, one column each of ``columns`` (a missing or ``None`` value left empty)."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({column: "" if row.get(column) is None else row[column] for column in columns})


def write_json(rows: list[dict], meta: dict, path: Path) -> None:
    path.write_text(json.dumps({"meta": meta, "results": [{c: row[c] for c in COLUMNS} for row in rows]}, indent=1))


def write_plots(rows: list[dict], meta: dict, directory: Path, stem: str) -> list[Path]:
    """One PNG per op: time and peak memory against the swept size, one line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for op in dict.fromkeys(row["op"] for row in rows):
        op_rows = [row for row in rows if row["op"] == op and row["time_ms"] is not None]
        if not op_rows:
            continue
        panels = [("time_ms", "wall ms of one call" if meta["smoke"] else f"{meta['mode']} time (ms, median)")]
        if not meta["smoke"]:
            panels.append(("peak_mib", "peak extra memory (MiB)"))
        figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
        first = op_rows[0]
        for axis, (column, label) in zip(axes[0], panels):
            for provider in dict.fromkeys(row["provider"] for row in op_rows):
                points = [
                    (row["size"], row[column]) for row in op_rows
                    # a derived backward (full − forward) can come out <= 0 within noise: not on a log axis
                    if row["provider"] == provider and row[column] is not None and row[column] > 0
                ]
                if points:
                    axis.plot(*zip(*points), marker="o", label=provider)
            headline = next((row["size"] for row in op_rows if row["headline"]), None)
            if headline is not None:
                axis.axvline(headline, color="grey", linestyle="--", linewidth=1)
                axis.annotate("headline", (headline, 1), xycoords=("data", "axes fraction"), fontsize=8,
                              color="grey", ha="left", va="top", rotation=90)
            axis.set_xscale("log", base=2)
            if column == "time_ms":
                axis.set_yscale("log")  # eager PyTorch is often 10x slower: ratios read as distances
            sizes = sorted({row["size"] for row in op_rows})
            axis.set_xticks(sizes, [str(size) for size in sizes], rotation=30)
            axis.minorticks_off()
            axis.set_xlabel(first["axis"])
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
        title = f"{op}: {meta['ops'][op]['shape']}, {first['dtype']}, {meta['mode']}"
        if meta["smoke"]:
            title = f"SMOKE RUN, NOT A BENCHMARK (no timings)\n{title}"
        else:
            title += f"\n{meta['gpu']}"
        figure.suptitle(title, fontsize=10)
        figure.tight_layout()
        path = directory / f"{op}-{stem}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths
