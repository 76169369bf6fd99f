"""The benchmark harness: the smoke run end to end, the roofline against the anchors' floors, and
the measuring logic driven by a stand-in for the GPU timer (so it runs without a GPU)."""

import csv
import dataclasses
import json

import pytest
import torch

from tigon.bench import main, runner
from tigon.bench.providers import PROVIDERS
from tigon.bench.report import COLUMNS
from tigon.bench.specs import OPS
from utils import DEVICE, ON_GPU


def test_smoke_run_writes_results(tmp_path):
    ops, providers = ["rms_norm", "cross_entropy"], ["tigon", "torch"]
    assert main([*ops, "--smoke", "--providers", *providers, "--out", str(tmp_path)]) == 0

    with (tmp_path / "bench-bf16-full.csv").open() as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert tuple(reader.fieldnames) == COLUMNS
    expected = {(op, size, provider) for op in ops for size in OPS[op].smoke.sizes for provider in providers}
    assert {(row["op"], int(row["size"]), row["provider"]) for row in rows} == expected
    assert all(row["status"] == "smoke" and row["smoke"] == "True" for row in rows)
    assert all(row["gbps"] == row["pct_of_ceiling"] == "" for row in rows), "a smoke run claims no rates"
    assert sum(row["headline"] == "True" for row in rows) == len(ops) * len(providers)

    saved = json.loads((tmp_path / "bench-bf16-full.json").read_text())
    assert saved["meta"]["smoke"] is True and saved["meta"]["ceilings"] is None
    assert set(saved["meta"]["ops"]) == set(ops)
    assert [tuple(row) for row in saved["results"]] == [COLUMNS] * len(rows)
    for op in ops:
        assert (tmp_path / f"{op}-bf16-full.png").is_file()


def test_missing_or_unusable_provider_is_skipped(tmp_path, capsys):
    # cce needs a GPU and is not a test dependency: either way it must be skipped, not fatal.
    assert main(["swiglu", "--smoke", "--quick", "--providers", "torch", "cce", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "bench-bf16-full-quick.json").read_text())
    if "cce" not in saved["meta"]["providers"]:
        assert "cce" in saved["meta"]["skipped_providers"]
        assert "skipping provider cce" in capsys.readouterr().out
    assert {row["provider"] for row in saved["results"]} == {"torch"}  # cce has no swiglu


@pytest.mark.parametrize(
    "op, unit_rate, floor_ms",
    [  # docs/anchors: ceilings 3019 GB/s and 694 TFLOP/s, floors of the headline shapes
        ("rms_norm", 3019e6, 0.22),
        ("rope", 3019e6, 0.22),
        ("swiglu", 3019e6, 1.24),
        ("cross_entropy", 3019e6, 2.09),
        ("fused_linear_cross_entropy", 694e9, 37.2),
    ],
)
def test_roofline_matches_anchor_floors(op, unit_rate, floor_ms):
    sweep = OPS[op].sweep
    work = OPS[op].work_for(sweep.shape_dims(sweep.headline), 2, "full")
    assert work / unit_rate == pytest.approx(floor_ms, rel=0.02)  # the anchors quote 2-3 digits


@pytest.fixture
def fake_device_timing(monkeypatch):
    """The GPU timers replaced by three calls of the step: the GPU time is popped from the queue
    this returns (host time 0.01 ms), the launch-inclusive time is 0.25 ms above the larger of
    the two; without a GPU the CUDA memory counters are stubbed (1 MiB peak)."""
    times = []

    def run_step(step, cases):
        for _ in range(3):
            for leaf in (leaf for case in cases for leaf in case.leaves()):
                leaf.grad = None
            step()

    def median_ms(step, cases):
        run_step(step, cases)
        return times.pop(0), 0.01

    def back_to_back_ms(step, cases, per_call_ms):
        run_step(step, cases)
        return per_call_ms + 0.25

    monkeypatch.setattr(runner, "_median_ms", median_ms)
    monkeypatch.setattr(runner, "_back_to_back_ms", back_to_back_ms)
    if not ON_GPU:
        for name, value in (("synchronize", None), ("reset_peak_memory_stats", None),
                            ("memory_allocated", 0), ("max_memory_allocated", 2**20)):
            monkeypatch.setattr(torch.cuda, name, lambda *args, _value=value: _value)
    return times


def _tigon_case(op, size):
    spec = OPS[op]
    dims = spec.smoke.shape_dims(size)
    return PROVIDERS["tigon"].load()[op], lambda: spec.build(dims, torch.float32, DEVICE)


@pytest.mark.parametrize("mode", ["forward", "backward", "full"])
def test_measure_times_each_mode(fake_device_timing, mode):
    fn, build = _tigon_case("rms_norm", 96)
    fake_device_timing.append(0.5)
    result = runner.measure(fn, build, mode, grads_in_forward=False, l2_bytes=1)
    assert (result.status, result.time_ms, result.host_ms, result.launch_ms, result.notes) == ("ok", 0.5, 0.01, 0.75, [])
    assert result.peak_mib > 0


def test_backward_of_grads_in_forward_is_full_minus_forward(fake_device_timing):
    fn, build = _tigon_case("cross_entropy", 500)
    fake_device_timing.extend([3.0, 1.0])  # full, then forward
    result = runner.measure(fn, build, "backward", grads_in_forward=True, l2_bytes=1)
    assert (result.status, result.time_ms, result.notes) == ("ok", 2.0, [f"{runner.DERIVED_BACKWARD_NOTE} (gradients written during forward)"])
    assert result.launch_ms == pytest.approx(2.0)  # (3.0 + 0.25) - (1.0 + 0.25)


def test_launch_inclusive_time_and_ratio_are_reported(fake_device_timing, tmp_path, monkeypatch, capsys):
    from tigon.bench import command, report

    fake_device_timing.extend([0.5, 0.25])  # tigon, then torch
    monkeypatch.setattr(command, "run_device", lambda smoke: (False, DEVICE, "Test GPU"))
    monkeypatch.setattr(runner, "measure_ceilings", lambda device: runner.Ceilings(3000.0, 700.0))
    monkeypatch.setattr(runner, "l2_cache_bytes", lambda device: 1)
    monkeypatch.setattr(report, "write_plots", lambda *args: [])
    argv = ["rms_norm", "--quick", "--providers", "tigon", "torch", "--out", str(tmp_path)]
    spec = command.OPS["rms_norm"]
    monkeypatch.setitem(command.OPS, "rms_norm", dataclasses.replace(spec, sweep=spec.smoke))  # CPU-sized
    assert command.main(argv) == 0

    rows = {row["provider"]: row for row in json.loads((tmp_path / "bench-bf16-full-quick.json").read_text())["results"]}
    assert (rows["tigon"]["launch_ms"], rows["tigon"]["launch_ratio"]) == (0.75, 1.5)
    assert (rows["torch"]["launch_ms"], rows["torch"]["launch_ratio"]) == (0.5, 2.0)
    with (tmp_path / "bench-bf16-full-quick.csv").open() as handle:
        assert next(csv.DictReader(handle))["launch_ratio"] == "1.5"
    table = capsys.readouterr().out
    assert "launch" in table and "1.50x" in table and "2.00x" in table


def test_smoke_run_records_no_launch_time(tmp_path):
    assert main(["rms_norm", "--smoke", "--quick", "--providers", "tigon", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "bench-bf16-full-quick.json").read_text())["results"]
    assert row["status"] == "smoke" and row["launch_ms"] is None and row["launch_ratio"] is None


def test_failing_provider_is_recorded_not_raised(fake_device_timing):
    def broken(args):
        raise ValueError("no kernel for this shape")

    _, build = _tigon_case("rms_norm", 96)
    result = runner.measure(broken, build, "full", grads_in_forward=False, l2_bytes=1)
    assert result.status == "error" and "no kernel for this shape" in result.notes[0]


def test_input_sets_exceed_four_times_l2():
    _, build = _tigon_case("rms_norm", 96)
    set_bytes = build().nbytes()
    assert len(runner.input_sets(build, l2_bytes=set_bytes)) == 4
    assert len(runner.input_sets(build, l2_bytes=set_bytes // 8)) == 1
    assert len(runner.input_sets(build, l2_bytes=100 * set_bytes)) == runner.MAX_INPUT_SETS


@pytest.mark.skipif(ON_GPU, reason="without a GPU, the end-to-end benchmark refuses by name")
def test_e2e_without_a_gpu_says_why(capsys):
    assert main(["e2e", "--lora"]) == 1
    assert "tigon bench e2e trains on a GPU" in capsys.readouterr().out
