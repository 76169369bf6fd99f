"""Tile sweeps of the MoE experts' kernels (tigon.ops.moe), each timed alone at Qwen3-30B-A3B's
shapes (16384 tokens, 128 experts, top-8, H 2048, I 768, bf16); ``_GPU_TILES`` comes from these.

    python benchmarks/tune_moe.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from tigon.ops import moe

MATMUL_TFLOPS = 690  # the anchors' measured bf16 matmul ceiling on the H100
TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 16384, 2048, 768, 128, 8
ROWS = TOKENS * TOP_K

CANDIDATES = {
    "gate_up": [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                for n, k, w, s in [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 2)]],
    "down": [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
             for n, k, w, s in [(256, 64, 8, 3), (256, 32, 8, 4), (128, 64, 8, 4), (128, 128, 8, 3)]],
    "down_bwd": [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                 for n, k, w, s in [(128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 8, 3), (128, 32, 8, 5)]],
    "dx": [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
           for n, k, w, s in [(256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 8, 4), (256, 32, 8, 4)]],
    "weight_grad": [dict(BLOCK_O=o, BLOCK_I=i, BLOCK_K=k, num_warps=w, num_stages=s)
                    for o, i, k, w, s in [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                                          (128, 256, 64, 8, 3), (256, 128, 64, 8, 3)]],
}


def main() -> None:
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    index = torch.softmax(torch.randn(TOKENS, EXPERTS, device=device), -1).topk(TOP_K, dim=-1).indices
    meta = moe.routing(index, EXPERTS, moe._GPU_TILES["block_m"])
    row_weight = torch.rand(ROWS, device=device)
    x = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype)
    dy = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype)
    gate_up_proj = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device, dtype=dtype) * HIDDEN**-0.5
    down_proj = torch.randn(EXPERTS, HIDDEN, INTER, device=device, dtype=dtype) * INTER**-0.5
    gate_up = torch.randn(ROWS, 2 * INTER, device=device, dtype=dtype)
    wh = torch.randn(ROWS, INTER, device=device, dtype=dtype)
    options = ("swiglu", False, False, 1.702, 7.0)

    def forward():
        return moe.moe_fwd(x, gate_up_proj, down_proj, None, None, row_weight, *meta, *options)

    def backward(dx=False, weights=False):
        return lambda: moe.moe_bwd(dy, x, gate_up_proj, down_proj, gate_up, wh, row_weight, *meta, *options,
                                   dx, weights, weights)

    # A backward kernel's time is the difference of two calls that differ by that kernel alone; the
    # forward's two kernels are timed together (the whole forward).
    unit = 2 * ROWS * HIDDEN * INTER  # FLOPs of an [S, H] x [H, I] product
    sweeps = {
        "gate_up": (forward, None, 3 * unit), "down": (forward, None, 3 * unit),
        "down_bwd": (backward(), None, unit), "dx": (backward(dx=True), backward(), 2 * unit),
        "weight_grad": (backward(weights=True), backward(), 3 * unit),
    }
    for kernel, (call, baseline, flops) in sweeps.items():
        chosen = moe._GPU_TILES[kernel]
        base_ms = do_bench(baseline) if baseline else 0.0
        results = []
        for config in CANDIDATES[kernel]:
            moe._GPU_TILES[kernel] = config
            results.append((do_bench(call) - base_ms, config))
        moe._GPU_TILES[kernel] = chosen
        print(f"\n{kernel} ({flops / 1e12:.2f} TFLOP{', whole forward' if call is forward else ''})")
        for ms, config in sorted(results, key=lambda r: r[0]):
            print(f"  {ms:7.3f} ms  {flops / ms / 1e9:5.0f} TFLOP/s  {flops / ms / 1e9 / MATMUL_TFLOPS:4.0%}  {config}")


if __name__ == "__main__":
    main()
