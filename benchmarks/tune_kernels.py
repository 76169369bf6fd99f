"""Launch-geometry sweeps of the kernels whose heuristics are tuned on the GPU (kernel time only).

Each sweep times the kernel alone (``do_bench``, L2 flushed between calls) at the headline shape
over a grid of (programs, block, warps) and prints the fastest settings with their share of the
copy ceiling; the launchers' constants come from these tables (see docs/perf-notes/).

    python benchmarks/tune_kernels.py [cross_entropy] [rms_norm] [fused_add_rms_norm] [fused_linear_cross_entropy]
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
from triton.testing import do_bench

import tigon.functional as tf
from tigon.ops import cross_entropy as ce
from tigon.ops import layer_norm as ln
from tigon.ops import rms_norm as rn

COPY_GBPS = 3019  # the anchors' measured copy ceiling on the H100


def report(name: str, results: list[tuple[float, dict]], nbytes: int, top: int = 8) -> None:
    results.sort(key=lambda r: r[0])
    floor_ms = nbytes / COPY_GBPS / 1e6
    print(f"\n{name}: floor {floor_ms:.3f} ms")
    for ms, config in results[:top]:
        print(f"  {ms:.3f} ms  {floor_ms / ms:5.0%}  {config}")


def time_config(launch) -> float | None:
    try:
        return do_bench(launch, warmup=25, rep=100, return_mode="median")
    except Exception as error:  # out of resources for this geometry
        print("   skipped:", type(error).__name__, str(error)[:80])
        return None


def tune_cross_entropy() -> None:
    n_rows, vocab = 8192, 128256
    logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    loss = torch.empty(n_rows, device="cuda", dtype=torch.float32)
    scale = torch.full((1,), 1 / n_rows, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for per_sm, block_v, warps in itertools.product((1, 2, 4, 8), (4096, 8192, 16384, 32768), (4, 8, 16, 32)):
        if block_v // (warps * 32) < 8 or block_v // (warps * 32) > 64:
            continue
        grid = (min(n_rows, sms * per_sm),)

        def launch():
            ce.cross_entropy_fwd_kernel[grid](
                logits, target, logits, scale, loss, None, n_rows, vocab, logits.stride(0), logits.stride(0), 0,
                -100, 0.0, 0.0, 1.0, HAS_SMOOTHING=False, HAS_SOFTCAP=False, STORE_Z_LOSS=False,
                COMPUTE_GRAD=True, HAS_GRAD_SCALE=True, BLOCK_V=block_v, num_warps=warps,
            )

        ms = time_config(launch)
        if ms is not None:
            results.append((ms, dict(programs_per_sm=per_sm, block_v=block_v, warps=warps)))
    report("cross_entropy fwd (loss + in-place gradient) [8192, 128256] bf16", results, 3 * logits.numel() * 2)


def tune_norm_bwd_sizes(hidden_sizes=(1024, 2048, 16384)) -> None:
    """Both norms' backward over the swept hidden sizes, where one geometry may not fit all."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for hidden in hidden_sizes:
        n_rows = 16384
        x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        dy, dx = torch.randn_like(x), torch.empty_like(x)
        _, mean, rstd = ln.layer_norm_fwd(x, w, w, 1e-5)
        results = {"layer_norm": [], "rms_norm": []}
        for per_sm, block_m, warps, stages in itertools.product((1, 2, 4), (1, 2, 4, 8, 16), (4, 8, 16), (1, 2)):
            if not 4096 <= block_m * hidden <= 32768:
                continue
            n_programs = min(triton.cdiv(n_rows, block_m), sms * per_sm)
            partial = torch.empty(n_programs, 2, hidden, device="cuda", dtype=torch.float32)
            config = dict(programs_per_sm=per_sm, block_m=block_m, warps=warps, stages=stages)

            def layer_norm():
                ln.layer_norm_bwd_kernel[(n_programs,)](
                    x, w, mean, rstd, dy, dx, partial[:, 0], partial[:, 1], n_rows, hidden,
                    hidden, hidden, hidden, partial.stride(0), HAS_WEIGHT=True, COMPUTE_DW=True, COMPUTE_DB=True,
                    BLOCK_M=block_m, BLOCK_N=hidden, NUM_STAGES=stages, num_warps=warps,
                )
                partial.sum(0)

            def rms_norm():
                rn.rms_norm_bwd_kernel[(n_programs,)](
                    x, w, rstd, dy, dy, dx, partial[:, 0], n_rows, hidden, hidden, hidden, hidden, hidden, 0.0,
                    HAS_DSUM=False, HAS_WEIGHT=True, COMPUTE_DW=True, BLOCK_M=block_m, BLOCK_N=hidden,
                    num_warps=warps,
                )
                partial[:, 0].sum(0)

            for name, launch in (("layer_norm", layer_norm), ("rms_norm", rms_norm)):
                if name == "rms_norm" and stages > 1:
                    continue
                ms = time_config(launch)
                if ms is not None:
                    results[name].append((ms, config))
        for name, found in results.items():
            report(f"{name} bwd [16384, {hidden}] bf16", found, 3 * x.numel() * 2, top=4)


def tune_rms_norm_bwd(with_residual: bool) -> None:
    n_rows, hidden = 16384, 4096
    x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    dy, dsum, dx = torch.randn_like(x), torch.randn_like(x), torch.empty_like(x)
    _, _, rstd = rn.rms_norm_fwd(x, None, w, 1e-6, 0.0, "llama")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for per_sm, block_m, warps in itertools.product((1, 2, 4, 8), (1, 2, 4), (4, 8, 16)):
        n_programs = min(triton.cdiv(n_rows, block_m), sms * per_sm)
        partial = torch.empty(n_programs, hidden, device="cuda", dtype=torch.float32)

        def launch():
            rn.rms_norm_bwd_kernel[(n_programs,)](
                x, w, rstd, dy, dsum, dx, partial, n_rows, hidden, hidden, hidden, hidden, hidden, 0.0,
                HAS_DSUM=with_residual, HAS_WEIGHT=True, COMPUTE_DW=True,
                BLOCK_M=block_m, BLOCK_N=hidden, num_warps=warps,
            )
            partial.sum(0)

        ms = time_config(launch)
        if ms is not None:
            results.append((ms, dict(programs_per_sm=per_sm, block_m=block_m, warps=warps)))
    tensors = 4 if with_residual else 3
    name = "fused_add_rms_norm" if with_residual else "rms_norm"
    report(f"{name} bwd [16384, 4096] bf16", results, tensors * x.numel() * 2)


def tune_fused_linear_chunks() -> None:
    """Time and peak extra memory of forward + backward against the chunk's memory budget."""
    n_rows, hidden, vocab = 8192, 4096, 128256
    x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,), device="cuda")
    floor_ms = 6 * n_rows * hidden * vocab / 694e12 * 1e3
    print(f"\nfused_linear_cross_entropy x [8192, 4096], W [128256, 4096] bf16: floor {floor_ms:.2f} ms")
    for budget_mib in (64, 128, 256, 384, 512, 1024):

        def step():
            x.grad = w.grad = None
            tf.fused_linear_cross_entropy(x, w, target, chunk_memory_bytes=budget_mib * 2**20).backward()

        step()
        torch.cuda.synchronize()
        x.grad = w.grad = None
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak_mib = (torch.cuda.max_memory_allocated() - before) / 2**20
        ms = do_bench(step, warmup=25, rep=200, return_mode="median")
        print(f"  chunk {budget_mib:5d} MiB: {ms:.2f} ms ({floor_ms / ms:.0%} of the matmul ceiling), peak {peak_mib:.0f} MiB")


SWEEPS = {
    "cross_entropy": tune_cross_entropy,
    "rms_norm": lambda: tune_rms_norm_bwd(False),
    "fused_add_rms_norm": lambda: tune_rms_norm_bwd(True),
    "fused_linear_cross_entropy": tune_fused_linear_chunks,
    "norm_sizes": tune_norm_bwd_sizes,
}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(SWEEPS):
        SWEEPS[name]()
