"""Where the GPU time of one end-to-end training step goes, by kernel (GPU only).

Builds the 4-layer Llama-3-8B-shaped model of ``tigon bench e2e`` for each setup (``hf``,
``liger`` or ``tigon``; ``+lora`` adds PEFT LoRA r 16 on every linear layer of the decoder),
times a few steps, then profiles one: GPU time per kernel class (matmul, attention, Triton,
elementwise, optimizer) and the longest kernels. Each setup runs in its own process.

    python benchmarks/profile_step.py [hf+lora tigon+lora tigon ...] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import time

import torch

from tigon.bench.e2e_models import build_model

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KERNEL_CLASSES = (
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "splitk")),
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("multi_tensor", "adam", "fused_adam")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "copy", "fill", "cat", "index", "where")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(key in lowered for key in keys):
            return label
    return "triton/other"


def run_child(setup: str, top: int, batch: int, seq_len: int) -> None:
    base, _, variant = setup.partition("+")
    model = build_model(base, 4)
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def step():
        tokens = torch.randint(0, 128256, (batch, seq_len), device="cuda", generator=generator)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per_kernel, counts, per_class = collections.Counter(), collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms = event.device_time / 1e3
            per_kernel[event.name[:90]] += ms
            counts[event.name[:90]] += 1
            per_class[kernel_class(event.name)] += ms
    print(f"== {setup}: {seconds * 1e3:.1f} ms/step, {batch * seq_len / seconds:,.0f} tokens/s, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, kernels {sum(per_kernel.values()):.1f} ms")
    for label, ms in per_class.most_common():
        print(f"   {label:14s} {ms:8.2f} ms")
    for name, ms in per_kernel.most_common(top):
        print(f"   {ms:8.2f} ms {counts[name]:5d}x  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setups", nargs="*", default=["hf+lora", "tigon+lora", "tigon"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child, args.top, args.batch, args.seq_len)
        return 0
    for setup in args.setups:
        subprocess.run([sys.executable, __file__, "--child", setup, "--top", str(args.top),
                        "--batch", str(args.batch), "--seq-len", str(args.seq_len)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
