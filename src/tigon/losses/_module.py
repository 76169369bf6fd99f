"""What the loss modules share: a ``forward`` whose optional tensors are keyword-only, and a
clear error when they come by position."""

from __future__ import annotations

import inspect
from typing import Any

import torch


class KeywordTailLoss(torch.nn.Module):
    """A loss module whose ``forward`` takes its main tensors by position and the optional ones
    (the bias, the reference model's tensors, the old policy's log-probs...) by keyword only.

    Liger-Kernel's modules take those by position, so a call written for them would fail with
    Python's ``forward() takes 4 positional arguments but 7 were given``, naming no keyword;
    this names the class, the positional parameters and the keywords the rest go by instead.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self).forward
        # co_argcount counts the positional parameters, self included; keyword-only ones not.
        if len(args) > forward.__code__.co_argcount - 1:
            parameters = list(inspect.signature(forward).parameters.values())[1:]
            positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
            keywords = [f"{p.name}=" for p in parameters if p.kind is p.KEYWORD_ONLY]
            raise TypeError(
                f"{type(self).__name__} takes {len(positional)} positional arguments ({', '.join(positional)}) but "
                f"{len(args)} were given; the others go by keyword: {', '.join(keywords)} (Liger-Kernel's losses "
                "take them by position)"
            )
        return super().__call__(*args, **kwargs)
