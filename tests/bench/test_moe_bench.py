"""tigon bench moe: the smoke run end to end (tiny blocks, every provider once, errors against
grouped_mm), the timed path driven by a stand-in for do_bench, and the work and memory figures."""

import json

import pytest
import torch
import triton.testing
from transformers.integrations.moe import grouped_mm_experts_forward

from tigon.bench import main, moe
from utils import DEVICE, ON_GPU, pick

SMOKE_DTYPE = pick(torch.float32, torch.bfloat16)  # as the smoke run computes: fp32 on the CPU
# max |tigon − grouped_mm| / max |grouped_mm| of the output and of every gradient.
MAX_REL = pick(1e-5, 3e-2)


@pytest.mark.slow
def test_smoke_run_writes_results(tmp_path, monkeypatch, capsys):
    # ~15 s on the CPU: Liger's and tigon's kernels through Triton's interpreter.
    # Qwen3-MoE takes Liger's fused MoE; GPT-OSS's transposed, interleaved, biased experts do not;
    # OLMoE's top-k weights are not renormalised.
    blocks = ["qwen3_moe", "olmoe", "gpt_oss"]
    monkeypatch.chdir(tmp_path)  # without --out, the results go under the working directory
    assert main(["moe", "--smoke", "--blocks", *blocks]) == 0
    out = tmp_path / "tigon-out" / "bench-smoke"
    saved = json.loads((out / "moe_blocks-qwen3_moe-olmoe-gpt_oss.json").read_text())  # a subset names its files
    rows = {(row["block"], row["provider"]): row for row in saved["results"]}
    assert (out / "moe_blocks-qwen3_moe-olmoe-gpt_oss.png").is_file()
    assert saved["meta"]["smoke"] and set(saved["meta"]["blocks"]) == set(blocks)
    assert set(rows) == {(block, provider) for block in blocks for provider in moe.PROVIDERS}
    for block in blocks:
        for provider in ("grouped_mm", "batched_mm", "tigon"):
            row = rows[block, provider]
            assert row["status"] == "smoke" and row["time_ms"] is None, row
            assert row["dtype"] == str(SMOKE_DTYPE).removeprefix("torch.")
        errors = rows[block, "tigon"]["errors"]
        # The output, the input's, router's and experts' gradients (GPT-OSS's biases too).
        assert {"output", "d hidden_states", "d experts.gate_up_proj", "d experts.down_proj"} <= set(errors)
        assert len(errors) == (8 if block == "gpt_oss" else 5)
        for name, error in errors.items():
            assert error["max_rel"] < MAX_REL, (block, name, error)
        assert rows[block, "grouped_mm"]["errors"] == {}  # the reference
    assert rows["gpt_oss", "liger"]["status"] == "n/a" and "GPT-OSS" in rows["gpt_oss", "liger"]["note"]
    liger = rows["qwen3_moe", "liger"]
    if liger["status"] == "n/a":  # not installed, or imported earlier with its GPU autotuning on
        assert "liger-kernel is not installed" in liger["note"] or "LIGER_FUSED_MOE_AUTOTUNE" in liger["note"]
    else:
        assert liger["status"] == "smoke" and all(e["max_rel"] < MAX_REL for e in liger["errors"].values()), liger
    table = capsys.readouterr().out
    assert "SMOKE RUN" in table and "| tigon |" in table and "Against grouped_mm" in table


def test_timed_path_computes_rates_ratios_and_skips_batched_mm(tmp_path, monkeypatch):
    times = [4.0, 2.0]  # grouped_mm's, then the stand-in Liger's (batched_mm is skipped before it is timed)

    def do_bench(fn, warmup, rep, grad_to_none, return_mode):
        assert return_mode == "median"
        for _ in range(2):  # as do_bench: accumulating calls, then one with fresh gradients
            fn()
        for tensor in grad_to_none:
            tensor.grad = None
        fn()
        return times.pop(0)

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(moe, "_free_bytes", lambda device: 1024)  # 1 KiB free: batched_mm cannot fit
    # transformers' grouped_mm standing in for Liger's fused MoE: a peer that runs, quickly.
    monkeypatch.setattr(moe, "_liger_forward", lambda block, on_gpu: grouped_mm_experts_forward)
    block = moe.BLOCKS["qwen3_moe"]
    rows = moe.run_block("qwen3_moe", ["grouped_mm", "batched_mm", "liger"], DEVICE, SMOKE_DTYPE, block.smoke,
                         timed=True, matmul_tflops=1e-6)
    by_provider = {row["provider"]: row for row in rows}
    reference, batched, liger = by_provider["grouped_mm"], by_provider["batched_mm"], by_provider["liger"]
    assert (reference["status"], reference["time_ms"]) == ("ok", 4.0)
    assert reference["tflops"] == pytest.approx(block.smoke.flops / 4e9)
    assert reference["fraction_of_ceiling"] == pytest.approx(reference["tflops"] / 1e-6)
    assert reference["speedup_vs_grouped_mm"] == 1.0 and reference["speedup_vs_liger"] == 0.5
    assert (liger["status"], liger["speedup_vs_grouped_mm"], liger["speedup_vs_liger"]) == ("ok", 2.0, 1.0)
    assert max(error["max_rel"] for error in liger["errors"].values()) < MAX_REL
    assert batched["status"] == "oom" and "would need" in batched["note"] and batched["time_ms"] is None
    if ON_GPU:
        assert reference["peak_gib"] > reference["resident_gib"] > 0
    else:
        assert reference["peak_gib"] is None
    meta = {"smoke": False, "gpu": "stand-in", "device": "cpu", "dtype": "fp32", "matmul_tflops": 1e-6,
            "blocks": {"qwen3_moe": moe.block_meta("qwen3_moe", block.smoke)}}
    table = moe.format_tables(rows, meta)
    assert "| Liger-Kernel fused MoE | 2.00 |" in table and "oom: out of memory (would need" in table
    moe.plot(rows, meta, tmp_path / "moe_blocks.png")
    assert (tmp_path / "moe_blocks.png").is_file()


def test_work_and_batched_mm_memory_of_the_qwen3_block():
    shape = moe.BLOCKS["qwen3_moe"].shape
    # 18·S·H·I: 3.7 TFLOP for 16384 tokens × top-8, H 2048, I 768.
    assert shape.flops == pytest.approx(3.71e12, rel=1e-3)
    # batched_mm's first gather alone, [S, 2I, H] in bf16, is the 768 GiB an H100 was asked for;
    # with the down gather and a gradient, twice that.
    assert shape.pairs * 2 * shape.intermediate * shape.hidden * 2 == 768 * 2**30
    assert moe.batched_mm_bytes(shape, 2) == 1536 * 2**30


def test_lora_smoke_run_compares_the_adapters_gradients(tmp_path):
    # PEFT's target_parameters LoRA on the experts: grouped_mm gets PEFT's merged weight, tigon the
    # factors; the adapters' gradients are what is compared, the frozen experts get none.
    pytest.importorskip("peft", minversion="0.21")
    assert main(["moe", "--smoke", "--blocks", "qwen3_moe", "--providers", "tigon", "--lora", "4",
                 "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "moe_blocks-qwen3_moe-lora4.json").read_text())
    shape = moe.BLOCKS["qwen3_moe"].smoke
    assert saved["meta"]["blocks"]["qwen3_moe"]["flops"] == shape.lora_flops(4)
    tigon = next(row for row in saved["results"] if row["provider"] == "tigon")
    assert tigon["lora_rank"] == 4 and tigon["flops"] == shape.lora_flops(4)
    adapters = [name for name in tigon["errors"] if "lora_" in name]
    assert len(adapters) == 4 and not any("experts.gate_up_proj" in name for name in tigon["errors"])
    for name, error in tigon["errors"].items():
        assert error["max_rel"] < MAX_REL, (name, error)


def test_lora_flops_count_the_forward_the_input_gradient_and_the_adapters():
    shape = moe.Shape(experts=4, top_k=2, hidden=8, intermediate=6, tokens=3)
    pairs = 6
    frozen = 6 * pairs * 8 * 6 * 2  # forward 6·S·H·I, the input's gradient as much again
    adapters = 6 * pairs * 16 * ((8 + 12) + (6 + 8))  # per projection 6·S·R·(in + out)
    assert shape.lora_flops(16) == frozen + adapters
    with pytest.raises(SystemExit):
        moe.parse_args(["--lora", "0"])
