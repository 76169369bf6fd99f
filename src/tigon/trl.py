"""tigon inside TRL's trainers: TRL's fused LM head computed by tigon.

TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``,
tested with TRL 1.16) compute every loss from per-token log-probabilities made by TRL's fused LM
head: ``trl.trainer.utils.add_fused_lm_head`` gives the model a forward that runs the backbone and
then ``trl.trainer.utils._ChunkedLogProbFunction.apply(hidden [N, H], weight [V, H], bias, targets
[N], temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)``. :func:`patch_trl`
puts :func:`tigon.functional.fused_linear_logprobs` behind that name. Everything around it stays
TRL's: which rows are scored (only the labelled ones on GPUs), the label shift, FSDP2's gather of a
DTensor head, ZeRO-3's gather of the head's weight for the forward, PEFT, temperature, softcap,
logit scale, and the losses. A backward that recomputes gathers the weight again through TRL's
own ``maybe_gather_lm_head_ctx``, as TRL's head does.

Usage, before the trainer is built::

    apply_tigon(model)      # tigon's RMSNorm, SwiGLU and RoPE in the decoder
    patch_trl()             # tigon's kernel in TRL's fused LM head
    trainer = SFTTrainer(model=model, ...)

The kernel's cost depends on the loss (see :mod:`tigon.ops.fused_linear_logprobs`): a loss that
is a sum or mean of the log-probs (SFT's NLL) can have its gradients computed in the forward pass
(``6·N·H·V`` FLOPs), any other (GRPO's, DPO's) needs a recomputing backward (``8·N·H·V``). The
head learns which one it serves: it computes gradients in the forward pass until a backward shows
a gradient that differs between tokens, or one reaching the entropy, and from then on recomputes.
Either way the gradients are exact; a wrong guess costs one step's extra matmuls. Learning reads
the gradient on the host, so it is skipped where the host may not wait (CUDA-graph capture,
torch.compile): there the guess stays as it was and the kernel checks it on the device, turning
the gradients of a broken guess into NaN (see :mod:`tigon.ops.fused_linear_logprobs`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

import tigon.functional as tf
from tigon.ops._launch import host_sync_allowed
from tigon.ops.fused_linear_logprobs import uniform_grad

try:
    import trl
    import trl.trainer.utils as _trl_utils
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("tigon.trl needs TRL (pip install 'trl>=1.16')") from error

# TRL's fused LM head as :func:`patch_trl` replaces it: the forward that add_fused_lm_head gives a
# model, calling _ChunkedLogProbFunction by its module's name (TRL 1.16). Older TRLs have a
# _ChunkedLogProbFunction of another contract, which each trainer imports under its own name:
# replacing it would change nothing, so there patch_trl says so and leaves TRL's head.
HAS_FUSED_HEAD = hasattr(_trl_utils, "add_fused_lm_head") and hasattr(_trl_utils, "_ChunkedLogProbFunction")
TRL_HEAD = getattr(_trl_utils, "_ChunkedLogProbFunction", None)


class TRLHeadMissingWarning(UserWarning):
    """The installed TRL has no fused LM head for :func:`patch_trl` to put tigon's kernel behind."""


__all__ = ["TRLHeadMissingWarning", "TigonLogProbHead", "is_patched", "patch_trl", "unpatch_trl"]


class TigonLogProbHead:
    """Drop-in for ``trl.kernels.ChunkedLogProbFunction``: :meth:`apply` takes its arguments and
    returns its 5-tuple ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``.

    ``chunk_size`` (TRL's vocabulary tile) is ignored: tigon chunks the tokens by a memory budget.
    The head runs in the autocast dtype when autocast is on, else in ``hidden``'s dtype, as TRL's.
    """

    # Whether the next call computes gradients in its forward pass (see the module docstring).
    grad_in_forward = True

    @classmethod
    def apply(
        cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
        temperature: float, chunk_size: int, final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
        outputs: Sequence[tf.LogprobField] = ("log_probs",),
    ) -> tf.LogprobFields:
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
        fields = tf.fused_linear_logprobs(
            hidden.to(dtype), weight.to(dtype), targets, None if bias is None else bias.to(dtype),
            temperature=temperature, softcap=final_logit_softcapping, logit_scale=logit_scale, outputs=outputs,
            grad_in_forward=cls.grad_in_forward,
            # TRL's own head passes (weight, bias) so, bias None included; its hint says Parameters.
            backward_context=lambda: _trl_utils.maybe_gather_lm_head_ctx(weight, bias),  # type: ignore[arg-type]
        )
        log_probs, entropy = fields[:2]
        if log_probs is not None and log_probs.requires_grad and cls.grad_in_forward:
            log_probs.register_hook(lambda grad: cls._observe_log_probs_grad(grad, targets))
        if entropy is not None and entropy.requires_grad and cls.grad_in_forward:
            entropy.register_hook(cls._observe_entropy_grad)
        return fields

    @classmethod
    def _observe_log_probs_grad(cls, grad: torch.Tensor, targets: torch.Tensor) -> None:
        # Reading the answer on the host is a sync: where none is allowed (CUDA-graph capture,
        # torch.compile) the head keeps its guess, and the op's backward checks it on the device
        # (a broken promise gives NaN gradients, never silently wrong ones).
        if not host_sync_allowed(grad):
            return
        if uniform_grad(grad.reshape(-1).float(), targets.reshape(-1), -100) is None:
            cls.grad_in_forward = False

    @classmethod
    def _observe_entropy_grad(cls, grad: torch.Tensor) -> None:
        cls.grad_in_forward = False


def patch_trl() -> None:
    """From now on, every TRL fused LM head (``fused_lm_head=True`` forwards) runs tigon's kernel.

    Call it before or after building the trainer; :func:`unpatch_trl` restores TRL's head. With a
    TRL older than 1.16 (no ``add_fused_lm_head``) it patches nothing and warns
    (:class:`TRLHeadMissingWarning`): the trainers keep computing their log-probs their own way,
    and tigon's layers (:func:`tigon.transformers.apply_tigon`) still apply."""
    if not HAS_FUSED_HEAD:
        warnings.warn(
            f"tigon.trl.patch_trl: TRL {trl.__version__} has no fused LM head (trl.trainer.utils.add_fused_lm_head, "
            "TRL >= 1.16), so tigon's kernel does not replace it and its trainers keep their own log-probs; "
            "tigon's layers (apply_tigon) still apply. pip install 'trl>=1.16' for tigon's head",
            TRLHeadMissingWarning, stacklevel=2,
        )
        return
    TigonLogProbHead.grad_in_forward = True
    _trl_utils._ChunkedLogProbFunction = TigonLogProbHead  # type: ignore[misc, assignment]


def unpatch_trl() -> None:
    """Restore TRL's own fused LM head."""
    if HAS_FUSED_HEAD:
        _trl_utils._ChunkedLogProbFunction = TRL_HEAD  # type: ignore[misc, assignment]


def is_patched() -> bool:
    return HAS_FUSED_HEAD and _trl_utils._ChunkedLogProbFunction is TigonLogProbHead
