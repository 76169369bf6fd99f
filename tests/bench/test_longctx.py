"""tigon bench longctx: the length search against a fake "fits(T)" (doubling, clipping to
--max-tokens, bisecting to --step), out-of-memory and error bookkeeping in a setup's process, the
options it refuses, and (slow) its smoke run: every setup through its own process on a tiny model,
the JSON, CSV and plot it writes."""

import csv
import json

import pytest
import torch
from utils import DEVICE

from tigon.bench import longctx, main
from tigon.bench.longctx import COLUMNS, SETUPS, measure_lengths, search_lengths

STEP = 16384


def fits_below(limit: int, tried: list[int]):
    """A fake ``fits(T)``: true up to ``limit`` tokens; records each length asked."""

    def fits(seq_len: int) -> bool:
        tried.append(seq_len)
        return seq_len <= limit

    return fits


def test_search_doubles_then_bisects_to_the_step():
    tried: list[int] = []
    assert search_lengths(fits_below(100_000, tried), STEP, STEP, 524288) == (98304, 114688)
    assert tried == [16384, 32768, 65536, 131072, 98304, 114688]


def test_search_clips_its_last_doubling_to_max_tokens():
    tried: list[int] = []
    # 100000 rounds down to 6 steps; everything fits: the search ends there, nothing failed.
    assert search_lengths(fits_below(10**9, tried), STEP, STEP, 100_000) == (98304, None)
    assert tried == [16384, 32768, 65536, 98304]
    tried.clear()
    assert search_lengths(fits_below(90_000, tried), STEP, STEP, 100_000) == (81920, 98304)
    assert tried == [16384, 32768, 65536, 98304, 81920]


def test_search_when_the_start_fails():
    tried: list[int] = []
    assert search_lengths(fits_below(1000, tried), 2 * STEP, STEP, 524288) == (0, 2 * STEP)
    assert tried == [2 * STEP]


@pytest.mark.parametrize(("start", "step", "max_tokens"), [(16, 16, 1000), (48, 16, 512), (4, 4, 4), (8, 4, 300)])
def test_search_finds_the_longest_that_fits_trying_each_length_once(start, step, max_tokens):
    for limit in range(max_tokens + 2 * step):
        tried: list[int] = []
        longest, failed = search_lengths(fits_below(limit, tried), start, step, max_tokens)
        grid = range(start, max_tokens // step * step + 1, step)
        fitting = [t for t in grid if t <= limit]
        assert longest == max(fitting, default=0), limit
        assert failed == next((t for t in grid if t > limit), None), limit
        assert len(tried) == len(set(tried)) and all(t % step == 0 and start <= t <= max_tokens for t in tried)


def test_given_lengths_run_in_order_until_one_fails():
    tried: list[int] = []
    assert measure_lengths(fits_below(70_000, tried), [131072, 32768, 65536, 98304]) == (65536, 98304)
    assert tried == [32768, 65536, 98304]


def smoke_args(*argv: str):
    parser, args = longctx.parse_args(["--smoke", *argv])
    longctx.resolve_sizes(parser, args)
    return args


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), MemoryError("pinned host memory"),
                                   RuntimeError("a kernel failed")])
def test_a_failed_length_ends_the_search_and_is_recorded(monkeypatch, error):
    """Hugging Face's setup on the tiny model, in this process, its steps replaced by one that runs
    out of memory (or fails otherwise) above 64 tokens."""

    def steps(step, seq_len, warmup, steps, device):
        if seq_len > 64:
            raise error
        return {"tokens_per_second": 1.0, "peak_memory_gib": None, "losses": [1.0]}

    monkeypatch.setattr(longctx, "time_steps", steps)
    progress: list[int] = []
    args = smoke_args("--max-tokens", "1024")
    result = longctx.run_setup(args, "hf", DEVICE.type, lambda so_far: progress.append(len(so_far["measurements"])))
    longctx.summarize(result)
    statuses = [(row["seq_len"], row["status"]) for row in result["measurements"]]
    assert result["complete"]
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        # 32 and 64 train, 128 runs out of memory, and so does 96 between them: the search ends there.
        failed = "out of memory" if isinstance(error, torch.OutOfMemoryError) else "out of host memory"
        assert statuses == [(32, "ok"), (64, "ok"), (128, failed), (96, failed)]
        assert "error" not in result and progress == [1, 1, 2, 2, 3, 3, 4, 4]
        assert (result["longest_seq_len"], result["first_failed_seq_len"]) == (64, 96)
    else:
        # Any other error ends the setup at once, recorded with the length it failed at.
        assert statuses == [(32, "ok"), (64, "ok"), (128, "error")]
        assert result["error"] == "RuntimeError: a kernel failed" and progress == [1, 1, 2, 2, 3]
        assert (result["longest_seq_len"], result["first_failed_seq_len"]) == (64, 128)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--start", "100", "--step", "64"], "--start must be a multiple of --step (64), got 100"),
        (["--start", "131072", "--max-tokens", "65536"], "--start (131072) is above --max-tokens (65536)"),
        (["--lora", "--full"], "not allowed with argument"),
        (["--cap-gib", "0"], "--cap-gib takes a positive number of GiB"),
        (["--steps", "0"], "--steps takes at least 1"),
    ],
)
def test_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["longctx", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_run_writes_each_setups_lengths_or_why_not(tmp_path):
    # Each available setup in a child process of its own (~10 s each, mostly imports).
    assert main(["longctx", "--smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "longctx_llama_lora.json").read_text())
    assert (tmp_path / "longctx_llama_lora.png").stat().st_size > 0
    assert record["smoke"] and record["config"]["layers"] == 2
    assert [result["setup"] for result in record["results"]] == list(SETUPS)
    for result in record["results"]:
        if "skipped" in result:  # Liger-Kernel where it is not installed
            assert result["measurements"] == [] and result["longest_seq_len"] == 0
            continue
        assert "error" not in result, result.get("traceback")
        # The search from 32 in steps of 32 up to 64: two lengths, both trained.
        assert [row["seq_len"] for row in result["measurements"]] == [32, 64]
        assert (result["longest_seq_len"], result["first_failed_seq_len"]) == (64, None)
        assert all(row["tokens_per_second"] > 0 for row in result["measurements"])
        if result["setup"] == "tigon-offload":
            assert all(row["host_memory_gib"] > 0 for row in result["measurements"])
    with (tmp_path / "longctx_llama_lora.csv").open() as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert tuple(reader.fieldnames or ()) == COLUMNS
    assert {row["setup"] for row in rows} == set(SETUPS)
    assert all(row["status"] == "ok" or (row["status"] == "skipped" and row["note"]) for row in rows)
