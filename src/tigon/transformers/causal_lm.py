"""One loss path for every causal LM (and vision-language model): the original forward, then
tigon's loss.

In training with ``labels``, the wrapped forward runs the model's own forward without labels and
asks the output embeddings (``lm_head``) for the loss instead of the logits: a pre-hook on
``lm_head`` computes the loss from the hidden states it receives (already cut by
``logits_to_keep``) and its weight, then hands ``lm_head`` an empty slice of them, so no ``[N, V]``
logits are built. The hook is registered once (when a model is built or patched, or else at its
first call) and stays idle unless the wrapper asks: registering nothing per call keeps the forward
traceable by ``torch.compile(fullgraph=True)``.

The loss is computed at ``lm_head``'s call because that is where every engine presents its weight
whole, with no gathering by tigon: FSDP2 unshards a module's parameters in a pre-hook registered
ahead of all others, and reshards them after its forward when ``lm_head`` is a unit of its own
(read later, the weight would be a DTensor shard); DeepSpeed ZeRO-3 gathers a parameter read
during the model's forward and registers it with the module running, whose backward gathers it
again; DDP and one process see the plain weight anyway. The fused loss computes the weight's
gradient in the forward pass, so backward never needs the weight gathered again. Under tensor
parallelism the weight stays a DTensor there: sharded along the vocabulary (``tp_plan="auto"``,
torch's ``ColwiseParallel``), the loss is vocabulary-parallel, each rank over its slice; any other
DTensor head (and, with ``cross_entropy=True``, DTensor logits) leaves the loss to the model's own
``loss_function``, with a :class:`ShardedHeadWarning`.

The loss is computed as Hugging Face's ``ForCausalLMLoss`` does, with the same options, from
those hidden states and ``lm_head``'s weight by tigon's fused linear cross entropy (or, with
``cross_entropy=True``, from the model's logits by tigon's cross entropy):

- targets: ``labels`` shifted left by one and padded with ``ignore_index`` (or ``shift_labels``
  when given); positions equal to ``ignore_index`` (default -100) count for nothing;
- reduction: the mean over counted positions, or their sum divided by ``num_items_in_batch``
  when given (the Trainer's gradient-accumulation normalisation);
- the family's logit transform, read from the (text) config: Gemma's ``final_logit_softcapping``
  becomes the kernel's ``softcap``; Granite's ``logits_scaling`` divides, and Falcon-H1's and
  MuseGlimmer's multipliers multiply, the hidden states instead of the logits;
- under autocast, the fused loss runs in the autocast dtype, as ``lm_head`` would have;
- a head converted to FP8 by torchao (``convert_to_float8_training``, its ``Float8Linear``): the
  fused loss runs the head's matmuls in FP8 by the same recipe (``fp8=`` of
  :func:`tigon.functional.fused_linear_cross_entropy`); a config that is none of torchao's three
  recipes is refused by name;
- a head sharded along the vocabulary by DeepSpeed's AutoTP (a column-parallel ``LinearLayer``):
  the loss is vocabulary-parallel over its tensor-parallel group;
- MoE models: ``router_aux_loss_coef · aux_loss`` is added, as their forward does with labels.

Everything else (the decoder, router logits, caches, hidden states, attentions) comes from the
original forward. Without labels, or in eval mode, the original forward runs unchanged and
returns logits; in training with labels the fused path returns ``logits=None``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings

import torch
from torch.distributed.tensor import DTensor, Shard

from tigon import functional as F
from tigon.transformers.families import Family
from tigon.transformers.float8 import adopt_float8_linears, is_float8_linear


def _extra_kwargs(signature: inspect.Signature) -> str | None:
    """The name of ``signature``'s ``**kwargs``, or ``None``."""
    return next(
        (name for name, param in signature.parameters.items() if param.kind is inspect.Parameter.VAR_KEYWORD), None
    )


def unwrappable_forward(forward) -> str | None:
    """Why tigon's loss cannot wrap ``forward`` (a head class's, unbound): a signature without
    ``labels`` or ``**kwargs``, which the wrapper reads and passes on; ``None`` when it can."""
    forward = getattr(forward, "tigon_wraps", forward)
    signature = inspect.signature(forward)
    if "labels" in signature.parameters and _extra_kwargs(signature) is not None:
        return None
    return f"declares {forward.__qualname__}{signature}, without labels or **kwargs"


def wrap_causal_lm_forward(forward, family: Family, loss: str):
    """``forward`` (a ``...ForCausalLM.forward``, unbound, which :func:`unwrappable_forward`
    accepts) with tigon's ``loss`` (``"fused_linear_cross_entropy"`` or ``"cross_entropy"``) in
    training. The result keeps the signature (the Trainer reads it to pass ``num_items_in_batch``)
    and is marked so that patching twice wraps the original again, not the wrapper."""
    forward = getattr(forward, "tigon_wraps", forward)
    signature = inspect.signature(forward)
    extra_kwargs = _extra_kwargs(signature)

    @functools.wraps(forward)
    def tigon_forward(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        labels = call.arguments.get("labels")
        if self.training and not torch.compiler.is_compiling():
            adopt_float8_linears(self)  # converted by torchao after tigon patched the model
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
            hook_head_loss(head)
            head.tigon_loss_request = request = dict(
                config=self.config, family=family, targets=targets, ignore_index=ignore_index,
                reduction=reduction, losses=[],
            )
            try:
                with _float8_logits_skipped(head):
                    output = forward(*call.args, **call.kwargs)
            finally:
                head.tigon_loss_request = None
            if len(request["losses"]) != 1:
                raise RuntimeError(
                    f"tigon: {family.head}.forward called its output embeddings {len(request['losses'])} "
                    "times, expected once; pass fused_linear_cross_entropy=False"
                )
            loss_value = request["losses"][0]
        else:
            output = forward(*call.args, **call.kwargs)
            logits = output.logits
            loss_value = None
            if not _left_to_model(family, "logits", logits, "tigon's cross entropy takes whole logits"):
                targets = targets.to(logits.device)
                loss_value = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)

        fused = loss == "fused_linear_cross_entropy" and loss_value is not None
        if loss_value is None:
            # A tensor-parallel head or logits tigon does not take: the model's loss, as its forward computes it.
            loss_kwargs.pop("return_dict")
            loss_value = self.loss_function(
                logits=output.logits, labels=labels, vocab_size=self.config.get_text_config().vocab_size,
                **loss_kwargs,
            )
        elif num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss_value.device)
            loss_value = loss_value / num_items_in_batch
        aux_loss = getattr(output, "aux_loss", None)
        if aux_loss is not None and family.aux_loss_coef is not None:
            coefficient = getattr(self.config.get_text_config(), family.aux_loss_coef)
            loss_value = loss_value + coefficient * aux_loss.to(loss_value.device)

        fields = dict(output, loss=loss_value)
        if fused:
            fields.pop("logits")  # the [B, 0, V] (or [B, 1, V]) the head was given to compute
        output = type(output)(**fields)
        return output if return_dict else output.to_tuple()

    tigon_forward.tigon_wraps = forward
    return tigon_forward


class ShardedHeadWarning(UserWarning):
    """The model's ``lm_head`` weight (or, with ``cross_entropy=True``, its logits) is a DTensor
    that tigon's loss does not take: the model computes its own loss, from the logits its
    tensor-parallel plan builds; tigon gathers nothing."""


_warned_sharded_head = False


def _left_to_model(family: Family, name: str, tensor: torch.Tensor, takes: str) -> bool:
    """Whether ``tensor`` (the head's ``weight``, or the ``logits``) is a DTensor that tigon's loss
    does not take, which leaves the loss to the model (warning once per process)."""
    global _warned_sharded_head
    if not isinstance(tensor, DTensor):
        return False
    if name == "weight" and tensor.device_mesh.ndim == 1 and tuple(tensor.placements) == (Shard(0),):
        return False
    if not _warned_sharded_head:
        _warned_sharded_head = True
        warnings.warn(
            f"tigon: {family.head}'s {'lm_head weight' if name == 'weight' else name}, a DTensor placed "
            f"{tuple(tensor.placements)} on a {tensor.device_mesh.ndim}-D mesh, and {takes}: the model computes "
            "its own loss (tigon's layers still run)",
            ShardedHeadWarning,
            stacklevel=2,
        )
    return True


def output_embeddings(model, family: Family):
    """``model``'s ``lm_head``, checked to be a plain linear layer whose weight gives the logits."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise RuntimeError(f"tigon: {family.head} has no output embeddings with a weight to fuse the loss with")
    if hasattr(head, "base_layer"):
        # A PEFT adapter on lm_head adds a term the fused loss would not see.
        raise RuntimeError(
            "tigon: the output embeddings carry an adapter (e.g. LoRA on lm_head); the fused loss uses "
            "only the base weight: pass fused_linear_cross_entropy=False"
        )
    return head


def hook_head_loss(head: torch.nn.Module) -> None:
    """Register, once, the pre-hook through which the wrapped forward gets ``head``'s loss, and
    keep it the last of ``head``'s pre-hooks: it must see the input as the others leave it, a
    tensor-parallel plan's registered after tigon patched the model among them (torch's
    ``ColwiseParallel`` gathers a sequence-sharded input there)."""
    if not hasattr(head, "tigon_loss_request"):
        head.tigon_loss_request = None
        head.tigon_loss_hook = head.register_forward_pre_hook(_loss_when_asked)
    hooks = head._forward_pre_hooks
    if not torch.compiler.is_compiling() and next(reversed(hooks)) != head.tigon_loss_hook.id:
        hooks.move_to_end(head.tigon_loss_hook.id)


def unhook_head_loss(head: torch.nn.Module) -> None:
    """Remove what :func:`hook_head_loss` added to ``head`` (nothing if it added nothing)."""
    if hasattr(head, "tigon_loss_hook"):
        head.tigon_loss_hook.remove()
        del head.tigon_loss_hook, head.tigon_loss_request


def _loss_when_asked(head, args):
    """While ``head.tigon_loss_request`` is set, append to its ``losses`` the loss of ``head``'s
    input and weight, and hand ``head`` an empty slice of the input (no positions), so that it
    computes no logits; or, for a DTensor weight the fused loss does not take, append ``None`` and
    let ``head`` compute the logits for the model's own loss. Otherwise change nothing."""
    request = head.tigon_loss_request
    if request is None:
        return None
    takes = "tigon's fused loss takes a head sharded along the vocabulary, (Shard(0),) on a 1-D mesh"
    if _left_to_model(request["family"], "weight", head.weight, takes):
        request["losses"].append(None)  # the head computes the logits, as its plan says
        return None
    hidden_states = args[0]
    request["losses"].append(
        _fused_loss(
            request["config"], request["family"], hidden_states, head, request["targets"],
            request["ignore_index"], request["reduction"],
        )
    )
    # Any head but a plain nn.Linear or torchao's (which skips its forward, see
    # _float8_logits_skipped) is given one position: DTensor's sharding propagation of the linear
    # divides by an empty dimension, and a wrapper's collectives (DeepSpeed's gathered output) need
    # not take empty tensors. Their [B, 1, V] logits are dropped like the empty ones.
    plain = type(head) is torch.nn.Linear or is_float8_linear(head)
    positions = 0 if plain and not isinstance(head.weight, DTensor) else 1
    return (hidden_states.narrow(-2, 0, positions), *args[1:])


@contextlib.contextmanager
def _float8_logits_skipped(head: torch.nn.Module):
    """While the wrapped forward runs, a torchao ``Float8Linear`` head whose loss tigon computed
    returns empty logits without running its forward: torchao would cast the whole weight to FP8
    for logits that are dropped, in eager through two fp32 copies of it (4 GiB at Llama-3's
    vocabulary, the training step's peak). A head left to compute its logits runs as it is, through
    whatever forward it had (a hook's, such as accelerate's, is put back afterwards)."""
    if not is_float8_linear(head):
        yield
        return
    own_forward = vars(head).get("forward")
    head_forward = head.forward

    def forward(input):
        losses = head.tigon_loss_request["losses"]
        if losses and losses[-1] is not None:
            return input.new_empty((*input.shape[:-1], head.out_features))
        return head_forward(input)

    head.forward = forward
    try:
        yield
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward


def _fused_loss(config, family: Family, hidden_states, head, targets, ignore_index, reduction):
    weight, bias = head.weight, getattr(head, "bias", None)
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        # The model's lm_head would have run in the autocast dtype: so does the fused loss.
        dtype = torch.get_autocast_dtype(device_type)
        hidden_states, weight = hidden_states.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    config = config.get_text_config()
    # logits / s = (h / s) · Wᵀ: scaling the hidden states costs [N, H], not [N, V].
    if family.logit_divisor is not None:
        hidden_states = hidden_states / getattr(config, family.logit_divisor)
    if family.logit_multiplier is not None:
        hidden_states = hidden_states * getattr(config, family.logit_multiplier)
    softcap = getattr(config, family.logit_softcap) if family.logit_softcap is not None else None
    return F.fused_linear_cross_entropy(
        hidden_states, weight, targets.to(hidden_states.device), bias,
        ignore_index=ignore_index, reduction=reduction, softcap=softcap, fp8=head_fp8_recipe(head),
        process_group=autotp_vocab_group(head),
    )


def autotp_vocab_group(head: torch.nn.Module):
    """The tensor-parallel group of a head that DeepSpeed's AutoTP sharded along the vocabulary
    (its column-parallel ``LinearLayer``: each rank's ``weight`` a slice of the rows, in rank
    order), whose loss is then vocabulary-parallel; ``None`` for any other head."""
    layers = sys.modules.get("deepspeed.module_inject.layers")
    if layers is None or not isinstance(head, layers.LinearLayer):
        return None
    group = getattr(head, "mp_group", None)
    return group if group is not None and getattr(head, "tp_world_size", 1) > 1 else None


# The fields of torchao's Float8LinearConfig that set how each matmul operand is scaled and cast.
FLOAT8_SCALING_FIELDS = (
    "cast_config_input", "cast_config_input_for_grad_weight", "cast_config_weight", "cast_config_weight_for_grad_input",
    "cast_config_grad_output", "cast_config_grad_output_for_grad_weight", "round_scales_to_power_of_2",
)


def _float8_scaling(config) -> dict:
    """What decides a torchao float8 config's numbers: how each operand is cast. How FSDP
    all-gathers the weight, or whether a matmul accumulates fast, does not make another recipe."""
    return {name: getattr(config, name) for name in FLOAT8_SCALING_FIELDS}


@functools.cache
def _recipe_scalings() -> dict[str, dict]:
    """Each recipe tigon's fused loss computes in FP8, and its scaling (built once, not per step)."""
    from torchao.float8 import Float8LinearConfig

    from tigon.ops.fp8 import RECIPES

    return {recipe: _float8_scaling(Float8LinearConfig.from_recipe_name(recipe)) for recipe in RECIPES}


def head_fp8_recipe(head: torch.nn.Module) -> str | None:
    """The torchao float8 recipe of a head that ``convert_to_float8_training`` converted (its
    ``Float8Linear``), ``None`` for any other head. Raises ``ValueError`` for a config other than
    torchao's ``tensorwise``, ``rowwise`` and ``rowwise_with_gw_hp`` recipes."""
    if not is_float8_linear(head):
        return None
    scaling = _float8_scaling(head.config)
    for recipe, recipe_scaling in _recipe_scalings().items():
        if scaling == recipe_scaling:
            return recipe
    raise ValueError(
        f"lm_head is a torchao Float8Linear whose casts {scaling} are none of the recipes tigon's fused "
        f"loss computes in FP8 ({', '.join(_recipe_scalings())}): convert with one of them, leave lm_head out "
        "of the conversion (module_filter_fn), or patch with fused_linear_cross_entropy=False"
    )
