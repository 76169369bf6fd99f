"""Post-training losses computed from hidden states and the LM head, without the logits.

Preference optimisation (:mod:`tigon.losses.preference`): DPO, CPO, SimPO, ORPO, KTO.
"""

from tigon.losses.preference import (
    FusedLinearCPOLoss,
    FusedLinearDPOLoss,
    FusedLinearKTOLoss,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
    fused_linear_cpo,
    fused_linear_dpo,
    fused_linear_kto,
    fused_linear_orpo,
    fused_linear_sequence_logps,
    fused_linear_simpo,
)

__all__ = [
    "FusedLinearCPOLoss",
    "FusedLinearDPOLoss",
    "FusedLinearKTOLoss",
    "FusedLinearORPOLoss",
    "FusedLinearSimPOLoss",
    "fused_linear_cpo",
    "fused_linear_dpo",
    "fused_linear_kto",
    "fused_linear_orpo",
    "fused_linear_sequence_logps",
    "fused_linear_simpo",
]
