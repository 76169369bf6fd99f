"""``tigon bench moe``: whole mixture-of-experts blocks, forward + backward, tigon's fused experts
against transformers' experts implementations and Liger-Kernel's fused MoE.

Each block is the module transformers builds for the family (router included), with random weights
(every parameter normal with the config's ``initializer_range``, the router's too, so tokens spread
over the experts), fed ``x [1, T, H]`` of standard normal values and, in backward, a fixed
standard-normal output gradient:

- ``qwen3_moe``: ``Qwen3MoeSparseMoeBlock`` of Qwen3-30B-A3B: hidden 2048, 128 experts of width 768,
  top-8 with the top-k weights renormalised, 16384 tokens.
- ``qwen3_235b``: the same block at Qwen3-235B-A22B's sizes: hidden 4096, 128 experts of width
  1536, top-8, 8192 tokens.
- ``olmoe``: ``OlmoeSparseMoeBlock`` of OLMoE-1B-7B: hidden 2048, 64 experts of width 1024, top-8
  (not renormalised), 16384 tokens.
- ``mixtral``: ``MixtralSparseMoeBlock`` of Mixtral-8x7B: hidden 4096, 8 experts of width 14336,
  top-2, 8192 tokens.
- ``gpt_oss``: ``GptOssMLP`` of GPT-OSS-20B: hidden 2880, 32 experts of width 2880, top-4, 8192
  tokens; transposed, interleaved, biased experts with the clamped SwiGLU.

Providers, each routing the same block's experts: ``grouped_mm`` (transformers' default and the
reference), ``batched_mm`` (transformers': it gathers every (token, expert) pair's weights, so
before running it the memory it needs is estimated, :func:`batched_mm_bytes`, and the row is
skipped as out of memory when that exceeds the free memory), ``liger`` (Liger-Kernel's fused MoE,
bound to the experts module as its ``apply_liger_kernel_to_qwen3_moe`` / ``_mixtral`` does to a
built model: ``LigerExperts.forward``; Liger has no kernel for GPT-OSS's experts, so that row is
"n/a") and ``tigon`` (``experts_implementation="tigon"``, :mod:`tigon.transformers.moe`).

What is measured, per block and provider (bf16 on a GPU):

- time: the median GPU time of one forward + backward of the block (router included), timed by
  ``triton.testing.do_bench`` (CUDA events around each call, L2 flushed before each, gradients
  reset to ``None`` before each so every call allocates fresh ones as a training step with
  ``zero_grad(set_to_none=True)`` does), after one warm-up call that compiles and autotunes. A
  provider that waits on the host inside its call (a ``.item()``) pays for it, as in training.
- work: the experts' matmuls, ``18·S·H·I`` FLOPs for ``S = T·k`` (token, expert) pairs: ``6·S·H·I``
  forward (gate/up ``4·S·H·I``, down ``2·S·H·I``) and twice that backward; the router's
  ``6·T·H·E`` (under 1%) is not counted. TFLOP/s and the fraction of the bf16 matmul ceiling
  measured in the same run (an 8192³ ``torch.mm``, as ``tigon bench``).
- peak memory: ``torch.cuda.max_memory_allocated()`` over one forward + backward, its counter reset
  just before, gradients ``None`` before it: everything the step has allocated at its peak, i.e.
  the block's weights (router included), the input and the output gradient (``resident`` in the
  JSON: what is allocated before the step), plus the output, the activations saved for backward,
  the workspaces and every gradient (input, router, experts). Not counted: memory the caching
  allocator holds but has not handed out, the CUDA context.
- correctness, in the same run at the real sizes: the output and every gradient (input, router,
  experts' weights and biases) against ``grouped_mm``'s, as ``max |a − b|`` and that divided by
  ``max |b|`` (reported, not asserted: both sides are bf16 computations).

With ``--lora R``, every block's experts carry a PEFT LoRA adapter of rank ``R`` (``lora_alpha``
``2R``, both factors random) on both stacked weights (PEFT 0.21's ``target_parameters``, injected by
``peft.inject_adapter_in_model``), over frozen expert weights: LoRA fine-tuning as users run it.
The other providers then get PEFT's merged weight ``W + s·B·A`` (one ``baddbmm`` per forward, and
the full weight gradient in backward); tigon reads the factors and adds the adapter inside its
grouped matmuls (:mod:`tigon.transformers.moe`). The work counted is what LoRA training needs: the
forward, the input's gradient and the adapters', ``12·S·H·I + 6·S·R·(2H + 3I)`` FLOPs; the
gradients compared are the input's and the adapters' (PEFT leaves only its adapters trainable).

Ratios: ``vs grouped_mm`` and ``vs Liger`` are their time divided by this row's (above 1: faster).
Writes ``moe_blocks.json`` and ``moe_blocks.png`` (``moe_blocks-<blocks>.*`` for a subset of the blocks)
into ``--out`` (``tigon bench``'s folder by default: ``tigon-out/bench-<gpu>`` of the working
directory) and prints markdown tables. Each row also records the wall-clock of its first,
compiling call (``first_call_s``: Liger autotunes there).

Without a GPU (or with ``--smoke``) every block runs at tiny shapes (fp32 on the CPU, where Triton
runs its interpreter; Liger's fused MoE with its autotuning off, which needs a GPU), each provider
once: no timing or memory, the errors against ``grouped_mm`` still computed.

    tigon bench moe [--blocks qwen3_moe qwen3_235b olmoe mixtral gpt_oss] [--providers grouped_mm batched_mm liger tigon]
        [--lora R] [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import MethodType

import torch
import triton

import tigon
from tigon.bench import runner
from tigon.bench.machine import BENCH_EXTRA, default_out, require_modules, run_device, version

REFERENCE = "grouped_mm"
PROVIDERS = (REFERENCE, "batched_mm", "liger", "tigon")
LABELS = {
    "grouped_mm": "transformers grouped_mm", "batched_mm": "transformers batched_mm",
    "liger": "Liger-Kernel fused MoE", "tigon": "tigon",
}
WARMUP_MS, REP_MS = 200, 1000  # do_bench's budget per measurement: ~30 calls of a 30 ms step
COMPARE_CHUNK = 2**26  # elements compared at once (fp32 copies of 256 MiB)


@dataclass(frozen=True)
class Shape:
    """A block's sizes: ``experts`` of width ``intermediate`` over ``hidden``, ``top_k`` per token."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int
    tokens: int

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k

    @property
    def flops(self) -> int:
        """The experts' matmuls of one forward + backward (see the module docstring)."""
        return 18 * self.pairs * self.hidden * self.intermediate

    def lora_flops(self, rank: int) -> int:
        """The matmuls LoRA training needs over frozen experts: the forward and the input's gradient,
        ``12·S·H·I``, and each adapter's three pairs of thin products (``x Aᵀ``, ``·Bᵀ`` forward;
        ``g B``, ``·A``, ``dA``, ``dB`` backward): ``6·S·R·(in + out)`` over both projections."""
        return 12 * self.pairs * self.hidden * self.intermediate + 6 * self.pairs * rank * (
            2 * self.hidden + 3 * self.intermediate)


@dataclass(frozen=True)
class Block:
    """A family's MoE block as transformers builds it.

    Attributes:
        title: the model it comes from.
        module: the family's folder in ``transformers.models``.
        config_class, block_class: names in that module (its configuration and modeling files).
        fields: the config fields holding ``(experts, top_k, hidden, intermediate)``.
        shape, smoke: the benchmarked and the smoke run's sizes.
        config: other config fields, as the model's released config sets them.
        liger_missing: why Liger-Kernel has no fused MoE for these experts (``None``: it has).
    """

    title: str
    module: str
    config_class: str
    block_class: str
    fields: tuple[str, str, str, str]
    shape: Shape
    smoke: Shape
    config: dict = field(default_factory=dict)
    liger_missing: str | None = None


_QWEN3_MOE = Block(
    "Qwen3-30B-A3B", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
    ("num_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size"),
    Shape(experts=128, top_k=8, hidden=2048, intermediate=768, tokens=16384),
    Shape(experts=8, top_k=4, hidden=32, intermediate=24, tokens=16),
    config=dict(norm_topk_prob=True),
)
BLOCKS = {
    "qwen3_moe": _QWEN3_MOE,
    "qwen3_235b": replace(
        _QWEN3_MOE, title="Qwen3-235B-A22B",
        shape=Shape(experts=128, top_k=8, hidden=4096, intermediate=1536, tokens=8192),
        smoke=Shape(experts=8, top_k=4, hidden=48, intermediate=32, tokens=16),
    ),
    "olmoe": Block(
        "OLMoE-1B-7B", "olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock",
        ("num_experts", "num_experts_per_tok", "hidden_size", "intermediate_size"),
        Shape(experts=64, top_k=8, hidden=2048, intermediate=1024, tokens=16384),
        Shape(experts=6, top_k=3, hidden=32, intermediate=40, tokens=16),
    ),
    "mixtral": Block(
        "Mixtral-8x7B", "mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
        ("num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size"),
        Shape(experts=8, top_k=2, hidden=4096, intermediate=14336, tokens=8192),
        Shape(experts=4, top_k=2, hidden=48, intermediate=32, tokens=16),
    ),
    "gpt_oss": Block(
        "GPT-OSS-20B", "gpt_oss", "GptOssConfig", "GptOssMLP",
        ("num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size"),
        Shape(experts=32, top_k=4, hidden=2880, intermediate=2880, tokens=8192),
        Shape(experts=6, top_k=2, hidden=32, intermediate=24, tokens=16),
        liger_missing=(
            "Liger-Kernel has no kernel for GPT-OSS's experts (transposed, interleaved, biased, clamped "
            "SwiGLU): its apply_liger_kernel_to_gpt_oss leaves them to transformers"
        ),
    ),
}


class Unavailable(Exception):
    """A provider that cannot run this block here, and why (a result, not a failure)."""


class NoRoom(Exception):
    """batched_mm's estimated memory exceeds what is free."""


def batched_mm_bytes(shape: Shape, itemsize: int) -> int:
    """What transformers' ``batched_mm`` allocates beyond the block's other tensors: it gathers
    each pair's weights, gate/up ``[S, 2I, H]`` and down ``[S, H, I]``, keeps both for backward,
    and backward adds a gradient as large as one of them while they live: ``4·S·I·H`` elements."""
    return 4 * shape.pairs * shape.intermediate * shape.hidden * itemsize


def build_block(block: Block, shape: Shape, device, dtype) -> torch.nn.Module:
    """``block``'s module at ``shape`` in ``dtype`` on ``device``, every parameter drawn from
    ``N(0, initializer_range²)`` after ``torch.manual_seed(0)``."""
    package = f"transformers.models.{block.module}"
    config_class = getattr(importlib.import_module(f"{package}.configuration_{block.module}"), block.config_class)
    block_class = getattr(importlib.import_module(f"{package}.modeling_{block.module}"), block.block_class)
    sizes = (shape.experts, shape.top_k, shape.hidden, shape.intermediate)
    config = config_class(**dict(zip(block.fields, sizes)), **block.config)
    torch.manual_seed(0)
    with torch.device(device):
        module = block_class(config).to(dtype)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, config.initializer_range)
    return module


def add_lora(module: torch.nn.Module, rank: int) -> None:
    """PEFT's LoRA of ``rank`` on ``module``'s stacked expert weights, both factors random (as after
    some training: PEFT's zero ``B`` would hide the adapter's term); PEFT freezes every other
    parameter (the experts' and the router's)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    inject_adapter_in_model(config, module)


def _experts(module: torch.nn.Module) -> torch.nn.Module:
    """The block's experts module, under PEFT's adapter wrappers if any."""
    experts = module.experts
    return experts.get_base_layer() if hasattr(experts, "get_base_layer") else experts


def _liger_forward(block: Block, on_gpu: bool):
    """Liger's experts forward (``LigerExperts.forward``), or :class:`Unavailable` saying why not."""
    if block.liger_missing:
        raise Unavailable(block.liger_missing)
    if not on_gpu:
        # Liger's fused MoE autotunes with CUDA events; this pins each kernel to one config instead.
        # Read when its kernels' module is first imported.
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
    try:
        from liger_kernel.ops import fused_moe_kernels
        from liger_kernel.transformers.swiglu import LigerExperts
    except ImportError as error:
        raise Unavailable(f"liger-kernel is not installed ({error})") from error
    if not on_gpu and not fused_moe_kernels._AUTOTUNE_DISABLED:
        raise Unavailable("Liger's fused MoE autotunes on a GPU; without one it needs LIGER_FUSED_MOE_AUTOTUNE=0 "
                          "before liger_kernel is imported")
    return LigerExperts.forward


@contextlib.contextmanager
def routed(module: torch.nn.Module, block: Block, provider: str, on_gpu: bool):
    """``module``'s experts computed by ``provider`` inside the ``with``."""
    experts = _experts(module)
    if provider == "liger":
        experts.forward = MethodType(_liger_forward(block, on_gpu), experts)
        try:
            yield
        finally:
            del experts.forward
        return
    experts.config._experts_implementation = provider
    if provider != "tigon":
        yield
        return
    # As apply_tigon sets it up: tigon's experts registered, and PEFT's LoRA layers routed to them.
    from tigon.transformers.lora import patch_peft, unpatch_peft
    from tigon.transformers.moe import register

    register()
    patch_peft()
    try:
        yield
    finally:
        unpatch_peft()


def _step(module: torch.nn.Module, x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    output = module(x)
    output = output[0] if isinstance(output, tuple) else output  # GptOssMLP returns (output, router scores)
    output.backward(grad_output)
    return output


def _clear_grads(leaves: dict[str, torch.Tensor]) -> None:
    for tensor in leaves.values():
        tensor.grad = None


def _compared(output: torch.Tensor, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The tensors checked against the reference: the output and the gradient of every leaf."""
    return {"output": output.detach(), **{f"d {name}": tensor.grad for name, tensor in leaves.items()}}


def _errors(actual: torch.Tensor | None, truth: torch.Tensor | None) -> dict | None:
    """``max |actual − truth|`` and that over ``max |truth|``, compared in fp32 chunks on
    ``actual``'s device (``truth`` may live on the host)."""
    if actual is None or truth is None:
        return None
    flat_actual, flat_truth = actual.reshape(-1), truth.reshape(-1)
    max_abs = max_truth = 0.0
    for start in range(0, flat_actual.numel(), COMPARE_CHUNK):
        a = flat_actual[start:start + COMPARE_CHUNK].float()
        t = flat_truth[start:start + COMPARE_CHUNK].to(a.device, torch.float32)
        max_abs = max(max_abs, (a - t).abs().max().item())
        max_truth = max(max_truth, t.abs().max().item())
    return {"max_abs": max_abs, "max_rel": max_abs / max_truth if max_truth else None}


def _free_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _check_room(needed: int, device: torch.device) -> None:
    """:class:`NoRoom` when ``needed`` bytes exceed the device's free memory (unknown on the CPU)."""
    free = _free_bytes(device)
    if free is not None and needed > free:
        raise NoRoom(f"out of memory (would need {needed / 2**30:,.0f} GiB for its gathered weights, "
                     f"{free / 2**30:,.0f} GiB free)")


def _run_provider(module, block, shape, provider, x, grad_output, leaves, reference, timed) -> dict:
    """One provider on one block: its status, time (when ``timed``), peak memory (on a GPU) and
    errors against ``reference`` (filled in place when ``provider`` is the reference)."""
    on_gpu = x.device.type == "cuda"
    row = {"status": "ok" if timed else "smoke", "note": "", "time_ms": None, "first_call_s": None, "wall_ms": None,
           "peak_gib": None, "resident_gib": None, "errors": {}}
    compared = None
    try:
        with routed(module, block, provider, on_gpu):
            if provider == "batched_mm":
                _check_room(batched_mm_bytes(shape, x.element_size()), x.device)
            _clear_grads(leaves)
            if timed:
                start = time.perf_counter()
                _step(module, x, grad_output)  # compiles and autotunes
                _clear_grads(leaves)
                row["first_call_s"] = time.perf_counter() - start
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                row["resident_gib"] = torch.cuda.memory_allocated() / 2**30
            start = time.perf_counter()
            output = _step(module, x, grad_output)
            if on_gpu:
                torch.cuda.synchronize()
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row["wall_ms"] = (time.perf_counter() - start) * 1e3
            compared = _compared(output, leaves)
            del output
            if provider == REFERENCE:
                reference.update({name: None if t is None else t.to("cpu", copy=True) for name, t in compared.items()})
            elif reference:
                row["errors"] = {name: _errors(t, reference[name]) for name, t in compared.items() if name in reference}
            compared = None
            _clear_grads(leaves)
            if timed:
                row["time_ms"] = triton.testing.do_bench(
                    lambda: _step(module, x, grad_output), warmup=WARMUP_MS, rep=REP_MS,
                    grad_to_none=list(leaves.values()), return_mode="median",
                )
    except Unavailable as why:
        row.update(status="n/a", note=str(why))
    except NoRoom as why:
        row.update(status="oom", note=str(why))
    except torch.OutOfMemoryError as error:
        row.update(status="oom", note=f"out of memory: {runner._first_line(error)}")
    except Exception as error:  # a provider failing on one block must not end the run
        row.update(status="error", note=f"{type(error).__name__}: {runner._first_line(error)}")
    finally:
        del compared
        _clear_grads(leaves)
        runner._release_memory()
    if row["status"] not in ("ok", "smoke"):
        row.update(time_ms=None, peak_gib=None, errors={})
    return row


def run_block(name: str, providers: list[str], device, dtype, shape: Shape, timed: bool,
              matmul_tflops: float | None, lora_rank: int | None = None) -> list[dict]:
    """Every provider on block ``name`` at ``shape`` (with ``lora_rank``, a LoRA adapter on its
    experts: :func:`add_lora`): one result row each, the reference first; ``timed`` False is the
    smoke run's single call per provider."""
    block = BLOCKS[name]
    module = build_block(block, shape, device, dtype)
    if lora_rank:
        add_lora(module, lora_rank)
    x = torch.randn(1, shape.tokens, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    grad_output = torch.randn(1, shape.tokens, shape.hidden, device=device, dtype=dtype)
    leaves = {"hidden_states": x, **{n: p for n, p in module.named_parameters() if p.requires_grad}}
    reference: dict[str, torch.Tensor | None] = {}
    rows = []
    for provider in sorted(providers, key=PROVIDERS.index):
        row = {"block": name, "provider": provider, "label": LABELS[provider], "tokens": shape.tokens,
               "dtype": str(dtype).removeprefix("torch."), "smoke": not timed, "lora_rank": lora_rank,
               "flops": shape.lora_flops(lora_rank) if lora_rank else shape.flops,
               **_run_provider(module, block, shape, provider, x, grad_output, leaves, reference, timed)}
        rows.append(row)
        measured = [f"{row['time_ms']:.2f} ms"] if row["time_ms"] else []
        measured += [f"peak {row['peak_gib']:.2f} GiB"] if row["peak_gib"] else []
        print(f"{name} {provider}: " + ", ".join([row["status"], *measured, *[row["note"]] * bool(row["note"])]),
              file=sys.stderr, flush=True)
    del module, x, grad_output, leaves, reference
    runner._release_memory()
    _add_ratios(rows, matmul_tflops)
    return rows


def _add_ratios(rows: list[dict], matmul_tflops: float | None) -> None:
    times = {row["provider"]: row["time_ms"] for row in rows if row["time_ms"]}
    peaks = {row["provider"]: row["peak_gib"] for row in rows if row["peak_gib"]}
    for row in rows:
        time_ms = row["time_ms"]
        row["tflops"] = row["flops"] / (time_ms * 1e9) if time_ms else None
        row["fraction_of_ceiling"] = row["tflops"] / matmul_tflops if row["tflops"] and matmul_tflops else None
        for other in (REFERENCE, "liger"):
            row[f"speedup_vs_{other}"] = times[other] / time_ms if time_ms and other in times else None
        has_peaks = row["peak_gib"] and REFERENCE in peaks
        row[f"memory_vs_{REFERENCE}"] = row["peak_gib"] / peaks[REFERENCE] if has_peaks else None


def block_meta(name: str, shape: Shape, lora_rank: int | None = None) -> dict:
    """What the JSON, the tables and the plot say of block ``name`` run at ``shape``."""
    return {"title": BLOCKS[name].title, "block_class": BLOCKS[name].block_class, **asdict(shape),
            "lora_rank": lora_rank, "flops": shape.lora_flops(lora_rank) if lora_rank else shape.flops}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_tables(rows: list[dict], meta: dict) -> str:
    """Per block, the markdown tables of speed and memory, and of errors against grouped_mm."""
    lines = []
    if meta["smoke"]:
        lines += ["SMOKE RUN: tiny shapes, one forward + backward per provider, no timings or memory; "
                  "the errors against grouped_mm are real.", ""]
    else:
        lines += [f"{meta['gpu']}, {meta['dtype']}, forward + backward of the whole block (router included); "
                  f"bf16 matmul ceiling {meta['matmul_tflops']:.0f} TFLOP/s measured in this run. "
                  "Peak = max allocated during the step, weights and gradients included.", ""]
    for name in dict.fromkeys(row["block"] for row in rows):
        block, block_rows = meta["blocks"][name], [row for row in rows if row["block"] == name]
        lora = f", LoRA r {block['lora_rank']} on frozen experts" if block.get("lora_rank") else ""
        heading = (f"### {block['title']} ({block['block_class']}): {block['tokens']} tokens, {block['experts']} "
                   f"experts, top-{block['top_k']}, H {block['hidden']}, I {block['intermediate']}{lora}: "
                   f"{block['flops'] / 1e12:.3g} TFLOP per forward + backward")
        if meta["matmul_tflops"]:
            heading += f", {block['flops'] / (meta['matmul_tflops'] * 1e9):.1f} ms at the ceiling"
        lines += [heading, ""]
        lines += ["| provider | time (ms) | TFLOP/s | of ceiling | vs grouped_mm | vs Liger | peak (GiB) | status |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for row in block_rows:
            status = row["status"] + (f": {row['note']}" if row["note"] else "")
            lines.append(
                f"| {row['label']} | {_fmt(row['time_ms'], '.2f')} | {_fmt(row['tflops'], '.0f')} "
                f"| {_fmt(row['fraction_of_ceiling'], '.0%')} | {_fmt(row['speedup_vs_grouped_mm'], '.2f')} "
                f"| {_fmt(row['speedup_vs_liger'], '.2f')} | {_fmt(row['peak_gib'], '.2f')} | {status} |"
            )
        checked = [row for row in block_rows if row["errors"]]
        if checked:
            names = list(checked[0]["errors"])
            lines += ["", "Against grouped_mm, max abs error / max relative error (max |a − b| / max |b|):", "",
                      "| provider | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
            for row in checked:
                cells = [
                    "-" if error is None else f"{error['max_abs']:.2e} / {_fmt(error['max_rel'], '.2e')}"
                    for error in (row["errors"].get(n) for n in names)
                ]
                lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Time and peak memory per provider, one column of panels per block; rows that did not run
    are marked by their status."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(row["block"] for row in rows))
    colors = {"grouped_mm": "tab:gray", "batched_mm": "tab:brown", "liger": "tab:blue", "tigon": "tab:orange"}
    panels = (("time_ms", "time (ms)", ".1f"), ("peak_gib", "peak memory (GiB)", ".2f"))
    fig, axes = plt.subplots(len(panels), len(names), figsize=(4.5 * len(names), 7), squeeze=False)
    for column, name in enumerate(names):
        block_rows = [row for row in rows if row["block"] == name]
        labels = [row["provider"] for row in block_rows]
        for (key, title, spec), ax in zip(panels, axes[:, column]):
            values = [row[key] or 0.0 for row in block_rows]
            ax.bar(labels, values, color=[colors[label] for label in labels])
            for i, row in enumerate(block_rows):
                text = format(row[key], spec) if row[key] else row["status"]
                if key == "time_ms" and row["speedup_vs_grouped_mm"] and row["provider"] != REFERENCE:
                    text += f"\n{row['speedup_vs_grouped_mm']:.2f}x"
                ax.annotate(text, (i, values[i]), ha="center", va="bottom", fontsize=8)
            if key == "time_ms" and meta["matmul_tflops"]:
                floor_ms = meta["blocks"][name]["flops"] / (meta["matmul_tflops"] * 1e9)
                ax.axhline(floor_ms, color="black", linestyle="--", linewidth=0.8,
                           label=f"at the matmul ceiling: {floor_ms:.1f} ms")
                ax.legend(fontsize=7, loc="upper right")
            ax.set_title(f"{meta['blocks'][name]['title']}: {title}", fontsize=10)
            ax.tick_params(axis="x", labelsize=8)
            ax.margins(y=0.2)
    what = "smoke run, no timings" if meta["smoke"] else f"{meta['dtype']}, forward + backward, router included"
    fig.suptitle(f"MoE blocks, {what} — {meta['gpu'] or meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tigon bench moe",
        description="Whole MoE blocks (Qwen3-30B-A3B, Mixtral-8x7B, GPT-OSS-20B), forward + backward: tigon's fused "
        "experts against transformers' grouped_mm and batched_mm and Liger-Kernel's fused MoE; time, peak memory, "
        "TFLOP/s and errors against grouped_mm. Without a GPU, a tiny smoke run that times nothing.",
    )
    parser.add_argument("--blocks", nargs="+", choices=list(BLOCKS), default=list(BLOCKS), metavar="BLOCK",
                        help=f"the families' MoE blocks: {', '.join(BLOCKS)} (default: all)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS), metavar="PROVIDER",
                        help=f"{', '.join(PROVIDERS)} (default: all); grouped_mm, the reference of the errors and "
                        "ratios, always runs")
    parser.add_argument("--lora", type=int, metavar="R",
                        help="a PEFT LoRA adapter of rank R on both stacked expert weights, over frozen experts")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, one call each, no timings (the default without a GPU)")
    parser.add_argument("--out", type=Path, help="results folder (default: tigon-out/bench-<gpu> of the working "
                        "directory, tigon-out/bench-smoke for smoke runs; committed results: --out "
                        "benchmarks/results/<gpu>)")
    args = parser.parse_args(argv)
    args.providers = list(dict.fromkeys([REFERENCE, *args.providers]))
    args.blocks = [name for name in BLOCKS if name in args.blocks]
    if args.lora is not None and args.lora < 1:
        parser.error(f"--lora takes a rank >= 1, got {args.lora}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    require_modules("tigon bench moe", BENCH_EXTRA)
    smoke, device, gpu = run_device(args.smoke)
    on_gpu = gpu is not None
    # Triton's interpreter on the CPU has no bf16 for some of Liger's operations: the smoke run is fp32 there.
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        print("No CUDA device: running the MoE blocks at tiny shapes through Triton's interpreter on the CPU, "
              "in fp32. It checks the harness and the providers; it measures no timings.")
    matmul_tflops = None
    if not smoke:
        matmul_tflops = runner.measure_ceilings(device).matmul_tflops
        print(f"{gpu}: bf16 matmul {matmul_tflops:.0f} TFLOP/s", file=sys.stderr, flush=True)
    rows = []
    for name in args.blocks:
        block = BLOCKS[name]
        rows += run_block(name, args.providers, device, dtype, block.smoke if smoke else block.shape, not smoke,
                          matmul_tflops, args.lora)
    meta = {
        "smoke": smoke, "gpu": gpu, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "matmul_tflops": matmul_tflops,
        "versions": {"tigon": tigon.__version__, "torch": torch.__version__, "triton": triton.__version__,
                     "transformers": version("transformers"), "liger-kernel": version("liger-kernel")},
        "timing": None if smoke else (
            f"triton.testing.do_bench median (warm-up {WARMUP_MS} ms, {REP_MS} ms of calls, L2 flushed and "
            "gradients reset to None before each call) after one compiling call"
        ),
        "peak_memory": None if smoke else (
            "torch.cuda.max_memory_allocated over one forward + backward, reset just before: weights (router "
            "included), input, output gradient (resident_gib), output, saved activations, workspaces, all gradients"
        ),
        "errors": "max |a - b| and max |a - b| / max |b| against grouped_mm's output and gradients",
        "blocks": {name: block_meta(name, BLOCKS[name].smoke if smoke else BLOCKS[name].shape, args.lora)
                   for name in args.blocks},
    }
    out = args.out or default_out(smoke, gpu)
    out.mkdir(parents=True, exist_ok=True)
    stem = "moe_blocks" + ("" if args.blocks == list(BLOCKS) else "-" + "-".join(args.blocks))
    stem += f"-lora{args.lora}" if args.lora else ""
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    plot(rows, meta, out / f"{stem}.png")
    print(format_tables(rows, meta))
    print(f"wrote {stem}.json and {stem}.png to {out} in {time.perf_counter() - started:.0f} s")
    # Peers failing are results; tigon failing is a failure of the run.
    return 1 if any(row["provider"] == "tigon" and row["status"] == "error" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
