"""The Axolotl plugin that ``tigon bench axolotl`` adds to each run it times:
``plugins: [tigon.bench.axolotl_timer.StepTimerPlugin]``.

Its trainer callback synchronizes the device at the end of every optimizer step and records the
step's wall time, its peak memory allocated and its logged loss; when training ends it prints them
(``RESULT`` lines of :mod:`tigon.bench.processes`, read by the command that started ``axolotl
train``). The peak is read at each step's end and the largest kept: Axolotl resets PyTorch's peak
counter each time it logs its memory metrics. Imports Axolotl: loaded only inside an Axolotl run.
"""

from __future__ import annotations

import time

import torch
from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

from tigon.bench.processes import print_result


class StepTimer(TrainerCallback):
    """Per optimizer step: seconds (device synchronized), peak GiB allocated and the loss the
    trainer logged."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.peaks: list[float] = []
        self.losses: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated() / 2**30)
        self.seconds.append(time.perf_counter() - self._start)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_train_end(self, args, state, control, **kwargs):
        print_result({"step_seconds": self.seconds, "losses": self.losses, "peak_gib": max(self.peaks, default=None)})


class StepTimerPlugin(BasePlugin):
    """Adds :class:`StepTimer` to Axolotl's trainer."""

    def add_callbacks_post_trainer(self, cfg, trainer):
        return [StepTimer()]
