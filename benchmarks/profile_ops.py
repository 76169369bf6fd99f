"""Where the time of one forward + backward goes, per op, at the headline shapes (GPU only).

For each op and provider: the harness's median (``tigon bench``), the GPU time of the kernels
alone (``torch.profiler``, summed per step, with every kernel listed), and the host time of one
step's Python and launches (read with the GPU idle, so nothing waits). When the harness's time
is well above the kernels', the GPU sat waiting for the host.

    python benchmarks/profile_ops.py [OPS...] [--providers tigon liger]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from tigon.bench import runner
from tigon.bench.providers import load_providers
from tigon.bench.specs import OPS

STEPS = 5


def kernel_times(step) -> tuple[float, list[tuple[str, float]]]:
    """GPU ms per step, and each kernel's ms per step."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    per_kernel = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:70]] += event.device_time / 1e3 / STEPS
    return sum(per_kernel.values()), per_kernel.most_common(6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ops", nargs="*")
    parser.add_argument("--providers", nargs="+", default=["tigon", "liger"])
    parser.add_argument("--host-profile", action="store_true", help="also print cProfile's top host functions")
    args = parser.parse_args()
    tables, _ = load_providers(args.providers, on_gpu=True)
    l2_bytes = runner.l2_cache_bytes(torch.device("cuda"))
    for op in args.ops or list(OPS):
        spec = OPS[op]
        dims = spec.sweep.shape_dims(spec.sweep.headline)
        for name, table in tables.items():
            if op not in table:
                continue
            fn = table[op]
            torch.manual_seed(0)
            cases = runner.input_sets(lambda: spec.build(dims, torch.bfloat16, torch.device("cuda")), l2_bytes)
            runner._full_step(fn, cases[0])
            bench_ms, _ = runner._time_full(fn, cases)

            def step():
                runner._clear_grads(cases[:1])
                runner._full_step(fn, cases[0])

            gpu_ms, kernels = kernel_times(step)
            cpu_ms = runner._host_ms(step)
            print(f"{op:28s} {name:8s} bench {bench_ms:7.3f} ms  kernels {gpu_ms:7.3f} ms  host {cpu_ms:6.3f} ms")
            for kernel, ms in kernels:
                print(f"{'':40s}{ms:7.3f}  {kernel}")
            if args.host_profile:
                profiler = cProfile.Profile()
                profiler.runcall(lambda: [step() for _ in range(50)])
                pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
            del cases
            runner._release_memory()


if __name__ == "__main__":
    main()
