"""Post-training losses computed from hidden states and the LM head, without the logits.

Preference optimisation (:mod:`tigon.losses.preference`): DPO, CPO, SimPO, ORPO, KTO.
Distillation (:mod:`tigon.losses.distillation`): KL divergence, generalized JSD, total variation
distance, and the JSD of two models' heads computed without their logits.
RL (:mod:`tigon.losses.grpo`): the GRPO family (GRPO, BNPO, Dr. GRPO, DAPO, CISPO, SAPO, LUSPO,
GSPO's sequence-level ratios) from the policy's hidden states and head.
"""

from tigon.losses.distillation import (
    FusedLinearJSDLoss,
    JSDLoss,
    KLDivLoss,
    TVDLoss,
    fused_linear_jsd,
    jsd,
    kl_div,
    tvd,
)
from tigon.losses.grpo import FusedLinearGRPOLoss, fused_linear_grpo
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
    "FusedLinearJSDLoss",
    "JSDLoss",
    "KLDivLoss",
    "TVDLoss",
    "fused_linear_jsd",
    "jsd",
    "kl_div",
    "tvd",
    "FusedLinearGRPOLoss",
    "fused_linear_grpo",
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
