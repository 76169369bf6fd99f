"""Sweep launch parameters of the RMSNorm backward kernel at the headline shape (scratch tuning)."""
import torch, triton
from tigon.ops import rms_norm as R

N, H = 16384, 4096
x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x)
_, _, rstd = R.rms_norm_fwd(x, None, w, 1e-6, 0.0, "llama")
dx = torch.empty_like(x)
floor_ms = 3 * N * H * 2 / 3.0e12 * 1e3
sms = torch.cuda.get_device_properties(0).multi_processor_count
results = []
for per_sm in (1, 2, 4, 8, 16):
    for block_m in (1, 2, 4):
        for warps in (4, 8, 16):
            progs = min(triton.cdiv(N, block_m), sms * per_sm)
            part = torch.empty(progs, H, device="cuda", dtype=torch.float32)
            def f():
                R.rms_norm_bwd_kernel[(progs,)](x, w, rstd, dy, dy, dx, part, N, H, H, H, H, H, 0.0,
                    HAS_DSUM=False, HAS_WEIGHT=True, COMPUTE_DW=True, BLOCK_M=block_m, BLOCK_N=H, num_warps=warps)
                part.sum(0)
            try:
                t = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
            except Exception as e:
                print(per_sm, block_m, warps, "failed", type(e).__name__); continue
            results.append((t, per_sm, block_m, warps))
results.sort()
for t, per_sm, block_m, warps in results[:12]:
    print(f"bwd {t:.3f} ms ({floor_ms/t*100:.0f}% of ceiling) programs/SM {per_sm} rows/program {block_m} warps {warps}")
