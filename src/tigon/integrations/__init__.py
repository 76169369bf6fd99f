"""Where tigon plugs into other libraries' interfaces: thin adapters over :mod:`tigon.transformers`,
one per library, no kernel logic.

- :mod:`tigon.integrations.axolotl`: Axolotl's plugin (``plugins: [tigon.integrations.axolotl.TigonPlugin]``).
- :mod:`tigon.integrations.llamafactory`: LLaMA-Factory's kernel plugin and launcher.

Importing ``tigon`` imports none of them, and none of those libraries is a dependency of tigon: an
adapter imports its library when it is itself imported, by that library or by the user. What the
adapters share lives here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def tigon_layer_counts(model: nn.Module) -> dict[str, int]:
    """How many modules of ``model`` are of each of tigon's classes, by class name: what an
    adapter logs to show which layers run on tigon's kernels."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if type(module).__module__.startswith("tigon."):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return counts
