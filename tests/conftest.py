"""Without a GPU every test runs the real kernels through Triton's interpreter on CPU tensors, on
every CPU core: pyproject's addopts run the suite under pytest-xdist (``-n auto``), one worker
process per core here (each worker imports this file, and so sets TRITON_INTERPRET, before any
test module imports Triton)."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread per process, with or without xdist (so every result is the same either
    # way), and in the processes tests start. The tests' tensors are tiny: a second thread costs
    # more in hand-offs than it saves, and beside a second worker it competes for the other core
    # (measured on 2 cores: a family test 1.3-1.9x faster in wall time, half the CPU time).
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

sys.path.insert(0, os.path.dirname(__file__))


def _cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)
def pytest_make_parametrize_id(config, val, argname):
    """A dtype parameter's id is its name (``float32``, ``bfloat16``), so that ``-k`` can pick them."""
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per CPU core without a GPU; with one, a single process (0), as the
    GPU tests' shapes are sized for the whole device."""
    return 0 if torch.cuda.is_available() else _cpu_cores()


ONE_WORKER_MODULES = {"tests/ops/test_vocab_parallel.py", "tests/bench/test_parallel_bench.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist load`` (``-n``'s default) each test goes to the next free worker, except those
    of tests/distributed, which run on one worker, one module after the other: a module's fixture
    launches the training runs of all its tests once, in three processes of their own. The modules
    of :data:`ONE_WORKER_MODULES` elsewhere, whose fixtures launch process groups the same way, run
    on one worker each (on two workers, each would launch them). (xdist's
    ``--dist loadgroup`` with ``xdist_group`` marks would say the same, but under pytest 9.2 xdist
    3.8 silently stops grouping: pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            if nodeid.startswith("tests/distributed/"):
                return "tests/distributed"
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return Scheduling(config, log)


@pytest.fixture(autouse=True)
def seeded():
    """Each test starts from the same random state, whichever worker runs it and whatever ran
    there before it."""
    torch.manual_seed(0)


@pytest.fixture
def scaled_mm_calls(monkeypatch) -> list:
    """The FP8 matmuls made during the test: each ``torch._scaled_mm`` call appends its first
    operand's dtype (tigon's FP8 head and torchao's Float8Linear both look it up on ``torch``)."""
    calls = []
    scaled_mm = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


@pytest.fixture
def hugging_face_modules_restored():
    """Patching before a model is built changes Hugging Face's modeling modules for the whole
    process (and patching a model changes its module's rotary function): a test using this
    fixture starts from, and leaves behind, the modules as Hugging Face wrote them and nothing on
    tigon's record of patches, whatever ran before it (a test elsewhere may patch and not undo).
    PEFT's LoRA layers, which tigon's patches route through tigon for the whole process, start and
    end with PEFT's own forward."""
    from utils import hugging_face_original, restore_hugging_face

    restore_hugging_face(hugging_face_original())
    yield
    restore_hugging_face(hugging_face_original())
