"""The benchmark harness behind ``tigon bench`` (also ``python -m tigon.bench``).

- :mod:`tigon.bench.specs`: per op, the swept sizes, the inputs of one call and its roofline work.
- :mod:`tigon.bench.providers`: tigon, torch, torch.compile and the peers, as ``{op: fn}`` tables.
- :mod:`tigon.bench.runner`: median CUDA-event timings, peak memory, the copy and matmul ceilings.
- :mod:`tigon.bench.report`: the table, CSV, JSON and plots.

The ``torch`` and ``torch.compile`` providers call :mod:`tigon.testing.reference`.
"""

from tigon.bench.command import main

__all__ = ["main"]
