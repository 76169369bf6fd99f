"""Without a GPU every test runs the real kernels through Triton's interpreter on CPU tensors, on
every CPU core: pyproject's addopts run the suite under pytest-xdist (``-n auto``), one worker
process per core here (each worker imports this file, and so sets TRITON_INTERPRET, before any
test module imports Triton)."""

import os
import sys

if "PYTEST_XDIST_WORKER" in os.environ:
    # The workers share the cores, each with torch's intra-op threads (one per core, as in a single
    # process, so that every result is the same with or without xdist). OpenMP's threads spin for a
    # while after each parallel region; beside another busy worker they would spin on its core,
    # which made the suite several times slower. Read by OpenMP when torch loads it, so set before.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))


def _cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per CPU core without a GPU; with one, a single process (0), as the
    GPU tests' shapes are sized for the whole device."""
    return 0 if torch.cuda.is_available() else _cpu_cores()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist load`` (``-n``'s default) each test goes to the next free worker, except those
    of tests/distributed, which run on one worker, one module after the other: a module's fixture
    launches the training runs of all its tests once, in three processes of their own. (xdist's
    ``--dist loadgroup`` with ``xdist_group`` marks would say the same, but under pytest 9.2 xdist
    3.8 silently stops grouping: pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return "tests/distributed" if nodeid.startswith("tests/distributed/") else nodeid

    return Scheduling(config, log)


@pytest.fixture(autouse=True)
def seeded():
    """Each test starts from the same random state, whichever worker runs it and whatever ran
    there before it."""
    torch.manual_seed(0)


@pytest.fixture
def hugging_face_modules_restored():
    """Patching before a model is built changes Hugging Face's modeling modules for the whole
    process (and patching a model changes its module's rotary function): a test using this
    fixture leaves behind the modules as Hugging Face wrote them. PEFT's LoRA layers, which tigon's
    patches route through tigon for the whole process, start and end with PEFT's own forward."""
    from utils import hugging_face_state, restore_hugging_face

    state = hugging_face_state()
    restore_hugging_face(state)
    yield
    restore_hugging_face(state)
