"""The benchmark harness behind ``tigon bench`` (also ``python -m tigon.bench``).

- :mod:`tigon.bench.command`: ``tigon bench``, the per-op sweeps; dispatches ``e2e``, ``moe``, ``longctx``, ``axolotl``, ``parallel`` and ``convergence``.
- :mod:`tigon.bench.specs`: per op, the swept sizes, the inputs of one call and its roofline work.
- :mod:`tigon.bench.providers`: tigon, torch, torch.compile and the peers, as ``{op: fn}`` tables.
- :mod:`tigon.bench.runner`: median CUDA-event timings, peak memory, the copy and matmul ceilings.
- :mod:`tigon.bench.report`: the table, CSV, JSON and plots.
- :mod:`tigon.bench.e2e`: ``tigon bench e2e``, every end-to-end number: models trained by Hugging
  Face, + Liger-Kernel, + tigon, on one GPU or under FSDP2, or under TRL (:mod:`tigon.bench.e2e_trl`);
  the models and their batches in :mod:`tigon.bench.e2e_models`.
- :mod:`tigon.bench.moe`: ``tigon bench moe``, whole MoE blocks.
- :mod:`tigon.bench.longctx`: ``tigon bench longctx``, the longest sequence each setup trains at
  batch 1 under a memory cap, and its tokens/s at each length.
- :mod:`tigon.bench.parallel`: ``tigon bench parallel``, the vocabulary-parallel loss and training
  under tensor and expert parallelism, on several GPUs.
- :mod:`tigon.bench.convergence`: ``tigon bench convergence``, bf16 against torchao's float8 recipes
  on a small Llama and a synthetic corpus.
- :mod:`tigon.bench.processes`: e2e's and longctx's setups each in a child process of its own.
- :mod:`tigon.bench.machine`: what they share: the device, the versions, the memory counters and the
  default results folder (``tigon-out/`` of the working directory).

Imports run one way: command → e2e → e2e_trl → e2e_models; command → longctx → e2e, report;
command → moe → runner; e2e, longctx, parallel → processes; parallel → e2e; all → machine.
The ``torch`` and ``torch.compile`` providers call :mod:`tigon.testing.reference`.
"""

from tigon.bench.command import main

__all__ = ["main"]
