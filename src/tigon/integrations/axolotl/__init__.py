"""tigon as an Axolotl plugin: tigon's kernels in ``axolotl train`` from YAML keys.

In an Axolotl config::

    plugins:
      - tigon.integrations.axolotl.TigonPlugin
    tigon_rope: true
    tigon_rms_norm: true
    tigon_glu_activation: true
    tigon_fused_linear_cross_entropy: true
    tigon_lora: true                  # with adapter: lora or qlora
    tigon_moe_experts: true           # mixture-of-experts models
    tigon_memory_budget_gib: 70       # optional: the memory planner

The keys are :class:`TigonArgs`; :class:`TigonPlugin` says which of Axolotl's hooks apply them.
Importing this package imports Axolotl (the plugin subclasses its ``BasePlugin``); ``import tigon``
does not.
"""

from tigon.integrations.axolotl.args import TigonArgs
from tigon.integrations.axolotl.plugin import CheckpointingPlanCallback, TigonPlugin

__all__ = ["CheckpointingPlanCallback", "TigonArgs", "TigonPlugin"]
