"""One loss path for every causal LM: the original forward, then tigon's loss.

In training with ``labels``, the wrapped forward runs the model's own forward without labels while
a pre-hook on the output embeddings (``lm_head``) keeps the hidden states it receives (already
cut by ``logits_to_keep``) and hands it an empty slice instead, so no ``[N, V]`` logits are
built. The hook is registered once (when a model is built or patched, or else at its first call)
and stays idle unless the wrapper asks for the input: registering nothing per call keeps the
forward traceable by ``torch.compile(fullgraph=True)``.

The loss is then computed as Hugging Face's ``ForCausalLMLoss`` does, with the same options, from
those hidden states and ``lm_head``'s weight by tigon's fused linear cross entropy (or, with
``cross_entropy=True``, from the model's logits by tigon's cross entropy):

- targets: ``labels`` shifted left by one and padded with ``ignore_index`` (or ``shift_labels``
  when given); positions equal to ``ignore_index`` (default -100) count for nothing;
- reduction: the mean over counted positions, or their sum divided by ``num_items_in_batch``
  when given (the Trainer's gradient-accumulation normalisation);
- the family's logit transform: Gemma 2/3's ``final_logit_softcapping`` becomes the kernel's
  ``softcap``; Granite's ``logits_scaling`` divides the hidden states instead of the logits;
- under autocast, the fused loss runs in the autocast dtype, as ``lm_head`` would have;
- MoE models: ``router_aux_loss_coef · aux_loss`` is added, as their forward does with labels.

Everything else (the decoder, router logits, caches, hidden states, attentions) comes from the
original forward. Without labels, or in eval mode, the original forward runs unchanged and
returns logits; in training with labels the fused path returns ``logits=None``.
"""

from __future__ import annotations

import functools
import inspect

import torch

from tigon import functional as F
from tigon.transformers.families import Family

def wrap_causal_lm_forward(forward, family: Family, loss: str):
    """``forward`` (a ``...ForCausalLM.forward``, unbound) with tigon's ``loss``
    (``"fused_linear_cross_entropy"`` or ``"cross_entropy"``) in training. The result keeps the
    signature (the Trainer reads it to pass ``num_items_in_batch``) and is marked so that patching
    twice wraps the original again, not the wrapper."""
    forward = getattr(forward, "tigon_wraps", forward)
    signature = inspect.signature(forward)
    extra_kwargs = next(
        (name for name, param in signature.parameters.items() if param.kind is inspect.Parameter.VAR_KEYWORD), None
    )
    if "labels" not in signature.parameters or extra_kwargs is None:
        raise TypeError(
            f"tigon: {family.causal_lm}.forward{signature} takes no `labels` or no **kwargs; "
            "this transformers version is not supported by tigon's loss patch: pass "
            "fused_linear_cross_entropy=False, cross_entropy=False"
        )

    @functools.wraps(forward)
    def tigon_forward(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        labels = call.arguments.get("labels")
        if labels is None or not self.training:
            return forward(self, *args, **kwargs)

        loss_kwargs = call.arguments.setdefault(extra_kwargs, {})
        return_dict = loss_kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        loss_kwargs["return_dict"] = True
        call.arguments["labels"] = None
        ignore_index = loss_kwargs.get("ignore_index", -100)
        targets = loss_kwargs.get("shift_labels")
        if targets is None:
            # Position t predicts token t + 1; the last position has nothing to predict.
            targets = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        num_items_in_batch = loss_kwargs.get("num_items_in_batch")
        reduction = "mean" if num_items_in_batch is None else "sum"

        if loss == "fused_linear_cross_entropy":
            head = output_embeddings(self, family)
            keep_head_input(head)
            head.tigon_kept_input = kept = []
            try:
                output = forward(*call.args, **call.kwargs)
            finally:
                head.tigon_kept_input = None
            if len(kept) != 1:
                raise RuntimeError(
                    f"tigon: {family.causal_lm}.forward called its output embeddings {len(kept)} times, "
                    "expected once; pass fused_linear_cross_entropy=False"
                )
            loss_value = _fused_loss(self.config, family, kept[0], head, targets, ignore_index, reduction)
        else:
            output = forward(*call.args, **call.kwargs)
            logits = output.logits
            targets = targets.to(logits.device)
            loss_value = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)

        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss_value.device)
            loss_value = loss_value / num_items_in_batch
        aux_loss = getattr(output, "aux_loss", None)
        if aux_loss is not None and family.aux_loss_coef is not None:
            loss_value = loss_value + getattr(self, family.aux_loss_coef) * aux_loss.to(loss_value.device)

        fields = dict(output, loss=loss_value)
        if loss == "fused_linear_cross_entropy":
            fields.pop("logits")  # the empty [B, 0, V] the head was given to compute
        output = type(output)(**fields)
        return output if return_dict else output.to_tuple()

    tigon_forward.tigon_wraps = forward
    return tigon_forward


def keep_head_input_after_init(post_init, family: Family):
    """``post_init`` (which every Hugging Face model calls at the end of ``__init__``) followed by
    :func:`keep_head_input`, so that models built after a patch have the hook from the start."""
    post_init = getattr(post_init, "tigon_wraps", post_init)

    @functools.wraps(post_init)
    def post_init_then_keep_head_input(self):
        post_init(self)
        keep_head_input(output_embeddings(self, family))

    post_init_then_keep_head_input.tigon_wraps = post_init
    return post_init_then_keep_head_input


def output_embeddings(model, family: Family):
    """``model``'s ``lm_head``, checked to be a plain linear layer whose weight gives the logits."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise RuntimeError(f"tigon: {family.causal_lm} has no output embeddings with a weight to fuse the loss with")
    if hasattr(head, "base_layer"):
        # A PEFT adapter on lm_head adds a term the fused loss would not see.
        raise RuntimeError(
            "tigon: the output embeddings carry an adapter (e.g. LoRA on lm_head); the fused loss uses "
            "only the base weight: pass fused_linear_cross_entropy=False"
        )
    return head


def keep_head_input(head) -> None:
    """Register, once, the pre-hook through which the wrapped forward takes ``head``'s input."""
    if not hasattr(head, "tigon_kept_input"):
        head.tigon_kept_input = None
        head.register_forward_pre_hook(_keep_input_when_asked)


def _keep_input_when_asked(head, args):
    """While ``head.tigon_kept_input`` is a list, append the input to it and hand ``head`` an empty
    slice of it (no positions), so that it computes no logits; otherwise change nothing."""
    kept = head.tigon_kept_input
    if kept is None:
        return None
    hidden_states = args[0]
    kept.append(hidden_states)
    return (hidden_states.narrow(-2, 0, 0), *args[1:])


def _fused_loss(config, family: Family, hidden_states, head, targets, ignore_index, reduction):
    weight, bias = head.weight, getattr(head, "bias", None)
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        # The model's lm_head would have run in the autocast dtype: so does the fused loss.
        dtype = torch.get_autocast_dtype(device_type)
        hidden_states, weight = hidden_states.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if family.logit_divisor is not None:
        # logits / s = (h / s) · Wᵀ: dividing the hidden states costs [N, H], not [N, V].
        hidden_states = hidden_states / getattr(config, family.logit_divisor)
    softcap = getattr(config, family.logit_softcap) if family.logit_softcap is not None else None
    return F.fused_linear_cross_entropy(
        hidden_states, weight, targets.to(hidden_states.device), bias,
        ignore_index=ignore_index, reduction=reduction, softcap=softcap,
    )
