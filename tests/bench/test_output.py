"""Where the bench commands write without --out: under the working directory, never into the
package's checkout; and the bench modules' imports, which run one way (command → e2e, moe → machine)."""

import ast
import json
import time
from pathlib import Path

import pytest

import tigon.bench
from tigon.bench import main
from tigon.bench.machine import default_out

BENCH = Path(tigon.bench.__file__).resolve().parent
CHECKOUT = BENCH.parents[2]


def _written_since(start: float, folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file() and path.stat().st_mtime >= start]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory outside the checkout; after the test, nothing of the checkout's results
    or tigon-out folders is newer than its start."""
    start = time.time() - 1
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for folder in (CHECKOUT / "tigon-out", CHECKOUT / "benchmarks" / "results"):
        if folder.is_dir():
            assert not _written_since(start, folder), f"written into the checkout: {_written_since(start, folder)}"


def test_default_folder_is_under_the_working_directory(elsewhere):
    assert default_out(True, None) == elsewhere / "tigon-out" / "bench-smoke"
    assert default_out(True, "NVIDIA H100 80GB HBM3") == elsewhere / "tigon-out" / "bench-smoke"
    assert default_out(False, "NVIDIA H100 80GB HBM3") == elsewhere / "tigon-out" / "bench-nvidia-h100-80gb-hbm3"


def test_smoke_sweep_writes_under_the_working_directory(elsewhere):
    assert main(["rms_norm", "--smoke", "--quick", "--providers", "torch"]) == 0
    saved = json.loads((elsewhere / "tigon-out" / "bench-smoke" / "bench-bf16-full-quick.json").read_text())
    assert {row["provider"] for row in saved["results"]} == {"torch"}


@pytest.mark.slow
def test_e2e_smoke_run_writes_under_the_working_directory(elsewhere):
    # Hugging Face's setup alone, in one child process: ~10 s, mostly imports.
    assert main(["e2e", "--smoke", "--setups", "hf", "--warmup", "0", "--steps", "1"]) == 0
    record = json.loads((elsewhere / "tigon-out" / "bench-smoke" / "e2e_llama.json").read_text())
    assert (elsewhere / "tigon-out" / "bench-smoke" / "e2e_llama.png").is_file()
    (result,) = record["results"]
    assert result["setup"] == "hf" and "error" not in result and record["smoke"]


def _bench_imports(path: Path) -> set[str]:
    """The tigon.bench modules ``path`` imports, at its top or inside a function."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "tigon.bench":
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tigon.bench."):
            imported.add(node.module.removeprefix("tigon.bench."))
        elif isinstance(node, ast.Import):
            imported |= {a.name.removeprefix("tigon.bench.") for a in node.names if a.name.startswith("tigon.bench.")}
    return imported - {"main"}


def test_bench_modules_import_each_other_one_way():
    modules = [path for path in BENCH.glob("*.py") if path.stem not in ("__init__", "__main__")]
    graph = {path.stem: _bench_imports(path) for path in modules}
    assert graph["machine"] == set()
    assert "command" not in set().union(*(graph[name] for name in graph if name != "command"))
    # No cycle: repeatedly drop the modules that import none of those left.
    left = dict(graph)
    while left:
        leaves = [name for name, imports in left.items() if not imports & set(left)]
        assert leaves, f"an import cycle among {sorted(left)}"
        for name in leaves:
            del left[name]
