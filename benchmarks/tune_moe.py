"""Tile sweeps of the MoE experts' kernels (tigon.ops.moe), each timed alone at a block's shapes
from ``tigon bench moe`` (default Qwen3-30B-A3B's: 16384 tokens, 128 experts, top-8, H 2048, I 768;
bf16); ``_GPU_TILES`` comes from these. ``block_m`` (shared by every row kernel) is swept first,
each kernel's own tile after it at the best ``block_m``.

    python benchmarks/tune_moe.py [--block qwen3_moe|qwen3_235b|olmoe|mixtral|gpt_oss]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from tigon.bench.moe import BLOCKS
from tigon.ops import moe

MATMUL_TFLOPS = 690  # the anchors' measured bf16 matmul ceiling on the H100

CANDIDATES = {
    "gate_up": [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                for n, k, w, s in [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 2),
                                   (64, 64, 4, 5)]],
    "down": [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
             for n, k, w, s in [(256, 64, 8, 3), (256, 32, 8, 4), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 4)]],
    "down_bwd": [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                 for n, k, w, s in [(128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 8, 3), (128, 32, 8, 5), (64, 64, 4, 4),
                                    (128, 64, 8, 3)]],
    "dx": [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
           for n, k, w, s in [(256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 8, 4), (256, 32, 8, 4), (128, 128, 8, 3)]],
    "weight_grad": [dict(BLOCK_O=o, BLOCK_I=i, BLOCK_K=k, num_warps=w, num_stages=s)
                    for o, i, k, w, s in [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                                          (128, 256, 64, 8, 3), (256, 128, 64, 8, 3)]],
}
BLOCK_M = (64, 128, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", choices=list(BLOCKS), default="qwen3_moe")
    shape = BLOCKS[parser.parse_args().block].shape
    tokens, hidden, inter, experts, top_k = shape.tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k
    rows = tokens * top_k
    print(f"{shape}: {rows // experts} rows per expert on average")
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    index = torch.softmax(torch.randn(tokens, experts, device=device), -1).topk(top_k, dim=-1).indices
    row_weight = torch.rand(rows, device=device)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    dy = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gate_up_proj = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) * hidden**-0.5
    down_proj = torch.randn(experts, hidden, inter, device=device, dtype=dtype) * inter**-0.5
    gate_up = torch.randn(rows, 2 * inter, device=device, dtype=dtype)
    wh = torch.randn(rows, inter, device=device, dtype=dtype)
    options = ("swiglu", False, False, 1.702, 7.0)
    meta = None

    def route():
        nonlocal meta
        meta = moe.routing(index, experts, moe._GPU_TILES["block_m"])

    def forward():
        return moe.moe_fwd(x, gate_up_proj, down_proj, None, None, row_weight, *meta, *options)

    def backward(dx=False, weights=False):
        return lambda: moe.moe_bwd(dy, x, gate_up_proj, down_proj, gate_up, wh, row_weight, *meta, *options,
                                   dx, weights, weights)

    def whole():
        forward()
        backward(True, True)()

    unit = 2 * rows * hidden * inter  # FLOPs of an [S, H] x [H, I] product
    print(f"\nblock_m (forward + backward, {9 * unit / 1e12:.2f} TFLOP)")
    timed = []
    for block_m in BLOCK_M:
        moe._GPU_TILES["block_m"] = block_m
        route()
        try:
            timed.append((do_bench(whole), block_m))
        except Exception as error:  # noqa: BLE001  (a tile too large for shared memory)
            print(f"  block_m {block_m}: {type(error).__name__}")
    for ms, block_m in sorted(timed):
        print(f"  {ms:7.3f} ms  {9 * unit / ms / 1e9:5.0f} TFLOP/s  block_m {block_m}")
    moe._GPU_TILES["block_m"] = min(timed)[1]
    route()

    # A backward kernel's time is the difference of two calls that differ by that kernel alone; the
    # forward's two kernels are timed together (the whole forward).
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
            try:
                results.append((do_bench(call) - base_ms, config))
            except Exception as error:  # noqa: BLE001
                print(f"  {config}: {type(error).__name__}")
        moe._GPU_TILES[kernel] = chosen
        print(f"\n{kernel} ({flops / 1e12:.2f} TFLOP{', whole forward' if call is forward else ''})")
        for ms, config in sorted(results, key=lambda r: r[0]):
            print(f"  {ms:7.3f} ms  {flops / ms / 1e9:5.0f} TFLOP/s  {flops / ms / 1e9 / MATMUL_TFLOPS:4.0%}  {config}")


if __name__ == "__main__":
    main()
