"""What replaces a Hugging Face layer: forwards by tigon over the layer's own parameters.

Each replacement is a mixin placed in front of the Hugging Face class (see
:func:`tigon.transformers.registry.tigon_class`), so the patched layer keeps the original
``__init__``, parameter names, weight initialisation and ``isinstance`` checks; only ``forward``
changes. Settings that differ between families (the RMSNorm offset, which gate kernel) are class
attributes filled in from the family's row of :data:`tigon.transformers.families.FAMILIES`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from transformers.activations import ACT2FN

from tigon import functional as F
from tigon.ops.fp8 import Fp8Cast
from tigon.ops.gated import auto_tile_rows, gated_fp8
from tigon.ops.rms_norm import rms_norm_fp8
from tigon.transformers.adapters import mlp_projection
from tigon.transformers.float8 import float8_cast, float8_down_projection, is_float8_linear, kernels_may_cast

# Hugging Face activation names (``ACT2FN`` keys) that each gate kernel computes exactly.
GATE_ACTIVATIONS = {
    "swiglu": ("silu", "swish"),
    # The tanh approximation of GELU, whichever formula Hugging Face spells it with.
    "geglu": ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh"),
    "relu2": ("relu2",),
}
# Where Hugging Face's MLP classes keep the activation module they were built with.
ACTIVATION_ATTRIBUTES = ("act_fn", "activation_fn", "act")


class TigonRMSNorm:
    """``forward`` of a Hugging Face RMSNorm (``weight [H]``, or none) by
    :func:`tigon.functional.rms_norm`.

    ``eps_attribute`` names where the layer keeps its epsilon (``variance_epsilon`` in Llama's
    family, ``eps`` in Gemma's); ``offset = 1`` is Gemma's ``(1 + weight)``; ``casting_mode`` is
    where the result is rounded to the input dtype (see :func:`tigon.functional.rms_norm`).
    """

    eps_attribute = "variance_epsilon"
    offset = 0.0
    casting_mode = "llama"
    # (decoder layer, NormInput) where the family's table names the projections that alone read
    # this norm's output (link_norm_inputs).
    norm_input_of = None

    def forward(self, hidden_states):
        eps = getattr(self, self.eps_attribute)
        weight = getattr(self, "weight", None)
        cast = self._float8_output_cast(hidden_states)
        if cast is not None:
            return rms_norm_fp8(hidden_states, weight, float(eps), self.offset, self.casting_mode, cast)
        return F.rms_norm(hidden_states, weight, eps, self.offset, self.casting_mode)

    def _float8_output_cast(self, x) -> Fp8Cast | None:
        """The FP8 cast (:func:`float8_cast`) in which every projection reading this norm's output
        takes it, when they all are torchao ``Float8Linear`` layers of one tensorwise input cast:
        the norm's kernels then make it, and the 16-bit output is never stored. ``None`` otherwise
        (and where :func:`kernels_may_cast` says no)."""
        if self.norm_input_of is None or not kernels_may_cast(x):
            return None
        layer, norm_input = self.norm_input_of
        readers = getattr(layer, norm_input.module, None)
        casts = [float8_cast(getattr(readers, name, None), "input") for name in norm_input.projections]
        return casts[0] if casts[0] is not None and all(cast == casts[0] for cast in casts) else None


class TigonGatedRMSNorm(TigonRMSNorm):
    """``forward(hidden_states, gate)`` of the gated RMSNorms of linear-attention and Mamba mixers
    (Qwen3-Next, Qwen3.5, Falcon-H1) by :func:`tigon.functional.rms_norm_gated`: ``norm(x) · w ·
    silu(gate)``, over ``n_groups`` slices of the features where the layer has them, the gate
    before the norm where its ``norm_before_gate`` is false. Without a gate it is an RMSNorm."""

    def forward(self, hidden_states, gate=None):
        eps = getattr(self, self.eps_attribute)
        if gate is None:
            return F.rms_norm(hidden_states, self.weight, eps, casting_mode=self.casting_mode)
        # Falcon-H1's mixer gives an fp32 input and a gate in the model's dtype, which the module
        # takes in fp32: the gate widened to the input's dtype is exact.
        gate = gate.to(hidden_states.dtype)
        group_size = hidden_states.shape[-1] // getattr(self, "n_groups", 1)
        return F.rms_norm_gated(
            hidden_states, gate, self.weight, eps, group_size=group_size,
            norm_before_gate=getattr(self, "norm_before_gate", True), casting_mode=self.casting_mode,
        )


class TigonLayerNorm:
    """``forward`` of a LayerNorm over the last dimension (``torch.nn.LayerNorm``, Nemotron's
    ``(1 + weight)`` LayerNorm1P) by :func:`tigon.functional.layer_norm`. A LayerNorm over more
    than the last dimension keeps its own forward."""

    eps_attribute = "eps"
    offset = 0.0

    def forward(self, hidden_states):
        if len(self.normalized_shape) != 1:
            return super().forward(hidden_states)
        eps = getattr(self, self.eps_attribute)
        return F.layer_norm(hidden_states, self.weight, self.bias, eps, offset=self.offset)


class TigonMLP:
    """Shared by the MLP layouts: which kernel (``gate``: ``"swiglu"``, ``"geglu"``, ``"relu2"``;
    also the name of its :mod:`tigon.functional` function), and the check, once the layer is
    built, that it matches the activation module the layer was given."""

    gate = "swiglu"
    # Hugging Face's gradient_checkpointing_enable() sets these on every module that has the
    # attribute, as on its decoder layers (the MLP's layer among them).
    gradient_checkpointing = False
    _gradient_checkpointing_func = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_activation(self)

    @staticmethod
    def _writable(output: torch.Tensor, projection: torch.nn.Module) -> torch.Tensor:
        """``projection``'s output, which the gate's backward overwrites with its gradient (it
        feeds nothing else). Under torch.compile the output of torchao's ``Float8Linear`` is copied
        first: it is a view made inside a custom Function, and compile's trace refuses a backward
        that writes into one. One copy in forward costs less than a new ``[tokens, I]`` gradient
        at the backward's peak."""
        return output.clone() if torch.compiler.is_compiling() and is_float8_linear(projection) else output

    @staticmethod
    def _float8_casts(gate, down_proj, gate_proj=None, up_proj=None) -> tuple[Fp8Cast | None, tuple | None]:
        """The FP8 casts the gate makes around torchao's tensorwise ``Float8Linear`` layers
        (:func:`float8_cast`): of its output, for ``down_proj``'s input, and of its two gradients,
        for ``gate_proj``'s and ``up_proj``'s output gradients (both or neither, in one dtype and
        scale rule). None of them where :func:`kernels_may_cast` says no."""
        if not kernels_may_cast(gate):
            return None, None
        gate_cast, up_cast = float8_cast(gate_proj, "grad_output"), float8_cast(up_proj, "grad_output")
        one_rule = gate_cast is not None and up_cast is not None and (
            (gate_cast.dtype, gate_cast.power_of_2) == (up_cast.dtype, up_cast.power_of_2))
        return float8_cast(down_proj, "input"), (gate_cast, up_cast) if one_rule else None

    def _gated(self, gate, up, casts):
        """The gate over the projections' outputs, with its FP8 ``casts`` (:meth:`_float8_casts`):
        a product cast for the down projection is never stored in 16 bits, and the down
        projection keeps it in FP8 for its backward; gradients cast for the projections are
        never stored in 16 bits, and torchao casts none of them."""
        if casts == (None, None):
            return getattr(F, self.gate)(gate, up, inplace_backward=True)
        return gated_fp8(gate, up, self.gate, True, *casts)

    def _recomputed_by_checkpointing(self, x) -> bool:
        """Whether this forward runs in a layer under non-reentrant checkpointing (Hugging Face's
        default), which recomputes the layer before its backward."""
        checkpoint_options = getattr(self._gradient_checkpointing_func, "keywords", {})
        return (
            self.gradient_checkpointing and self.training and torch.is_grad_enabled()
            and checkpoint_options.get("use_reentrant") is False and self._plain_dtype_and_eager(x)
        )

    @staticmethod
    def _plain_dtype_and_eager(x) -> bool:
        """Whether the whole-MLP function may run: no autocast (it computes in ``x``'s dtype), no
        torch.compile (which recomputes by its own rules) and a plain ``x``: a DTensor (a
        tensor-parallel plan's) goes through the projections, which the plan's hooks shard."""
        return (
            not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling()
            and not isinstance(x, DTensor)
        )


class TigonGatedMLP(TigonMLP):
    """``down_proj(act(gate_proj(x)) · up_proj(x))`` with the gate fused (Llama, Gemma, Qwen...).

    Under non-reentrant checkpointing, bias-free projections, plain or with a PEFT LoRA adapter
    (no dropout), go through :func:`tigon.functional.swiglu_mlp` (or ``geglu_mlp``): the
    recomputation stops at the MLP's input and the backward recomputes the projections and their
    adapters slice by slice, the same matmuls in a fraction of the memory. Otherwise (and for
    other wrapped or hooked projections) the projections are called as modules.

    With ``tile_tokens`` set (:func:`set_mlp_tiling`), the same function runs over tiles of the
    sequence, in every layer, checkpointed or not.
    """

    tile_tokens: int | str | None = None

    def forward(self, x):
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        tiled = self.tile_tokens is not None and self._plain_dtype_and_eager(x)
        if tiled or self._recomputed_by_checkpointing(x):
            parts = [mlp_projection(linear, x) for linear in projections]
            if None not in parts:
                (gate, gate_lora), (up, up_lora), (down, down_lora) = parts
                tile_tokens = self.tile_tokens
                if tile_tokens == "auto":
                    tile_tokens = auto_tile_rows(gate.shape[0], x.element_size())
                return getattr(F, f"{self.gate}_mlp")(
                    x, gate, up, down, gate_lora=gate_lora, up_lora=up_lora, down_lora=down_lora,
                    tile_tokens=tile_tokens,
                )
        gate, up = self.gate_proj(x), self.up_proj(x)
        casts = self._float8_casts(gate, self.down_proj, self.gate_proj, self.up_proj)
        if casts[1] is None:  # the backward writes its gradients over gate and up
            gate, up = self._writable(gate, self.gate_proj), self._writable(up, self.up_proj)
        return float8_down_projection(self.down_proj, self._gated(gate, up, casts))


class TigonFusedGateUpMLP(TigonMLP):
    """The same with one ``gate_up_proj`` producing ``[gate | up]`` (Phi-3, GLM-4); the kernel
    reads both halves in place through their row stride."""

    def forward(self, x):
        gate, up = self._writable(self.gate_up_proj(x), self.gate_up_proj).chunk(2, dim=-1)
        casts = self._float8_casts(gate, self.down_proj)
        return float8_down_projection(self.down_proj, self._gated(gate, up, casts))


class TigonUngatedMLP(TigonMLP):
    """``down_proj(act(up_proj(x)))`` with the activation by tigon (Nemotron's squared ReLU)."""

    def forward(self, x):
        up = self._writable(self.up_proj(x), self.up_proj)
        return float8_down_projection(self.down_proj, getattr(F, self.gate)(up, inplace_backward=True))


class TigonClampedSwiGLUExperts(TigonMLP):
    """GPT-OSS's experts with their gate, ``(clamp(up) + 1) · clamp(gate) · sigmoid(alpha ·
    clamp(gate))`` over interleaved ``[gate, up]`` columns, by
    :func:`tigon.functional.swiglu_clamped`; the expert matmuls keep their own forward."""

    def _apply_gate(self, gate_up):
        return F.swiglu_clamped(gate_up, alpha=self.alpha, limit=self.limit)


MLP_LAYOUTS = {
    "separate": TigonGatedMLP,
    "gate_up": TigonFusedGateUpMLP,
    "up_down": TigonUngatedMLP,
    "experts": TigonClampedSwiGLUExperts,
}


def follow_gradient_checkpointing(model) -> None:
    """Give the patched MLPs of ``model`` the checkpointing settings of its layers, which Hugging
    Face set before they were patched (nothing to do when checkpointing is off)."""
    checkpoint = next(
        (
            getattr(module, "_gradient_checkpointing_func", None) for module in model.modules()
            if getattr(module, "gradient_checkpointing", False) and not isinstance(module, TigonMLP)
        ),
        None,
    )
    if checkpoint is None:
        return
    for module in model.modules():
        if isinstance(module, TigonMLP):
            module.gradient_checkpointing, module._gradient_checkpointing_func = True, checkpoint


def link_norm_inputs(model, rows) -> None:
    """Give each patched RMSNorm of ``model`` that a family's table lists (``Family.norm_inputs``)
    its decoder layer and row, through which it finds the projections that read its output.
    ``rows``: ``(tigon norm classes of a family, its NormInputs)``."""
    for layer in model.modules():
        for norm_classes, norm_inputs in rows:
            for norm_input in norm_inputs:
                norm = getattr(layer, norm_input.norm, None)
                if type(norm) in norm_classes and isinstance(norm, TigonRMSNorm):
                    norm.norm_input_of = (layer, norm_input)


def check_tile_tokens(tile_tokens) -> None:
    """Raise unless ``tile_tokens`` is a positive int, ``"auto"`` or ``None``."""
    if tile_tokens is not None and tile_tokens != "auto" and (
        isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1
    ):
        raise ValueError(f"mlp_tile_tokens must be a positive int, 'auto' or None, got {tile_tokens!r}")


def set_mlp_tiling(model, tile_tokens: int | str | None) -> None:
    """Run ``model``'s patched gated MLPs over tiles of ``tile_tokens`` tokens of the sequence, in
    forward, recomputation and backward (:func:`tigon.functional.swiglu_mlp`): one tile's
    ``[tile, I]`` intermediates exist at a time instead of the whole sequence's, exactly. ``"auto"``
    picks tiles whose ``[tile, I]`` tensor is within 256 MiB (at least 1024 tokens); ``None`` turns
    tiling off. For long sequences: at a few thousand tokens one tile holds everything anyway.

    Raises ``ValueError`` for a model without a patched MLP of separate gate, up and down
    projections (the MLPs tiling applies to), or a ``tile_tokens`` that is neither.
    """
    check_tile_tokens(tile_tokens)
    mlps = [module for module in model.modules() if isinstance(module, TigonGatedMLP)]
    if not mlps and tile_tokens is not None:
        raise ValueError(
            f"{type(model).__name__} has no MLP that tigon tiles (a patched gated MLP with gate_proj, up_proj and "
            "down_proj): patch it with apply_tigon first, with swiglu or geglu on"
        )
    for mlp in mlps:
        mlp.tile_tokens = tile_tokens


def check_activation(layer, tigon_class=None) -> None:
    """Raise unless the activation module ``layer`` was built with (``act_fn``, ``activation_fn``
    or ``act``) is one that the kernel of ``tigon_class`` (default: ``layer``'s class) computes.
    GPT-OSS's experts have their activation built in."""
    tigon_class = tigon_class or type(layer)
    if tigon_class.gate not in GATE_ACTIVATIONS:
        return
    activation = next((getattr(layer, name) for name in ACTIVATION_ATTRIBUTES if hasattr(layer, name)), None)
    if not gate_computes(tigon_class.gate, activation):
        raise ValueError(
            f"tigon's {tigon_class.gate} kernel computes {' / '.join(GATE_ACTIVATIONS[tigon_class.gate])}, but this "
            f"model's {tigon_class.tigon_replaces.__name__} uses {type(activation).__name__}: "
            f"patch with {tigon_class.gate}=False"
        )


def gate_computes(gate: str, activation) -> bool:
    """Whether the ``gate`` kernel (a key of :data:`GATE_ACTIVATIONS`) computes ``activation``, an
    activation module built by Hugging Face's ``ACT2FN``."""
    return isinstance(activation, tuple(type(ACT2FN[name]) for name in GATE_ACTIVATIONS[gate]))


# The rotary functions of Hugging Face's modeling modules, one drop-in per signature and pair
# layout. cos and sin come from the model's rotary embedding, [B, T, R] unless said otherwise; the
# first R features of each head rotate (R < D is partial rotary), the rest pass through.


def _heads_first(unsqueeze_dim, *tensors):
    """``[B, T, H, D]`` inputs (``unsqueeze_dim=2``) seen as ``[B, H, T, D]``, which tigon's RoPE
    reads with any strides; 1 (and 0, which broadcasts ``[T, R]`` tables) leave them as they are."""
    if unsqueeze_dim in (0, 1):
        return tensors
    if unsqueeze_dim == 2:
        return tuple(None if t is None else t.transpose(1, 2) for t in tensors)
    raise ValueError(f"unsqueeze_dim must be 0, 1 ([B, H, T, D] inputs) or 2 ([B, T, H, D]), got {unsqueeze_dim!r}")


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Llama's ``apply_rotary_pos_emb``: ``x · cos + rotate_half(x) · sin`` with ``rotate_half([a,
    b]) = [-b, a]``. q: ``[B, Hq, T, D]``, k: ``[B, Hk, T, D]`` (``unsqueeze_dim=1``), or ``[B, T,
    H, D]`` (``unsqueeze_dim=2``); ``[T, R]`` tables with ``unsqueeze_dim=0`` (Pixtral)."""
    q_rot, k_rot = F.rope(*_heads_first(unsqueeze_dim, q, k), cos, sin, rotary_dim=cos.shape[-1])
    return _heads_first(unsqueeze_dim, q_rot, k_rot)


def apply_rotary_pos_emb_single(x, cos, sin, unsqueeze_dim=1):
    """Gemma 4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)``: one tensor at a time."""
    (x,) = _heads_first(unsqueeze_dim, x)
    x_rot, _ = F.rope(x, None, cos, sin, rotary_dim=cos.shape[-1])
    return _heads_first(unsqueeze_dim, x_rot)[0]


def apply_rotary_pos_emb_half_table(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-OSS's: the two halves of each head rotate by ``[B, T, D/2]`` tables (one angle per pair)."""
    q_rot, k_rot = F.rope(*_heads_first(unsqueeze_dim, q, k), cos, sin, rotary_dim=2 * cos.shape[-1])
    return _heads_first(unsqueeze_dim, q_rot, k_rot)


def apply_rotary_emb_complex_bhtd(xq, xk, freqs_cis):
    """DeepSeek V2's ``apply_rotary_emb``: interleaved pairs ``(x[2i], x[2i+1])`` as complex
    numbers times ``freqs_cis [B, T, D/2]``; xq, xk: ``[B, H, T, D]``."""
    return F.rope(xq, xk, freqs_cis.real, freqs_cis.imag, rotary_dim=xq.shape[-1], interleaved=True)


def apply_rotary_emb_complex_bthd(xq, xk, freqs_cis):
    """Llama 4's ``apply_rotary_emb``: the same over ``[B, T, H, D]`` inputs."""
    q_rot, k_rot = F.rope(
        xq.transpose(1, 2), xk.transpose(1, 2), freqs_cis.real, freqs_cis.imag,
        rotary_dim=xq.shape[-1], interleaved=True,
    )
    return q_rot.transpose(1, 2), k_rot.transpose(1, 2)


def apply_rotary_pos_emb_deepseek_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """DeepSeek V3's ``apply_rotary_pos_emb_interleave``: interleaved pairs in, rotated by the first
    half of the table, written out de-interleaved (``[evens | odds]``)."""
    half = cos.shape[-1] // 2
    q_rot, k_rot = F.rope(
        *_heads_first(unsqueeze_dim, q, k), cos[..., :half], sin[..., :half], rotary_dim=cos.shape[-1],
        interleaved=True, deinterleave_output=True,
    )
    return _heads_first(unsqueeze_dim, q_rot, k_rot)


def apply_rotary_pos_emb_glm(q, k, cos, sin, unsqueeze_dim=1):
    """GLM-4's: interleaved pairs of the first ``R`` features, pair ``i`` rotated by entry ``i`` of
    the table's first half."""
    half = cos.shape[-1] // 2
    q_rot, k_rot = F.rope(
        *_heads_first(unsqueeze_dim, q, k), cos[..., :half], sin[..., :half], rotary_dim=cos.shape[-1],
        interleaved=True,
    )
    return _heads_first(unsqueeze_dim, q_rot, k_rot)


def apply_rotary_pos_emb_glm4v(q, k, cos, sin, unsqueeze_dim=1):
    """GLM-4V's: interleaved pairs, the table given per feature (each angle repeated for the two
    members of its pair, which read it at their even entry)."""
    q_rot, k_rot = F.rope(
        *_heads_first(unsqueeze_dim, q, k), cos[..., ::2], sin[..., ::2], rotary_dim=cos.shape[-1],
        interleaved=True,
    )
    return _heads_first(unsqueeze_dim, q_rot, k_rot)


def apply_rotary_pos_emb_deepseek_v4(x, cos, sin, unsqueeze_dim=1):
    """DeepSeek V4's: interleaved pairs of the last ``2 · cos.shape[-1]`` features of each head
    (laid out ``[nope | rope]``), one angle per pair; the leading features pass through."""
    (x,) = _heads_first(unsqueeze_dim, x)
    x_rot, _ = F.rope(x, None, cos, sin, rotary_dim=2 * cos.shape[-1], interleaved=True, rotary_last=True)
    return _heads_first(unsqueeze_dim, x_rot)[0]


ROPE_FORMS = {
    "rotate_half": apply_rotary_pos_emb,
    "single": apply_rotary_pos_emb_single,
    "half_table": apply_rotary_pos_emb_half_table,
    "complex_bhtd": apply_rotary_emb_complex_bhtd,
    "complex_bthd": apply_rotary_emb_complex_bthd,
    "deepseek_interleave": apply_rotary_pos_emb_deepseek_interleave,
    "glm": apply_rotary_pos_emb_glm,
    "glm4v": apply_rotary_pos_emb_glm4v,
    "deepseek_v4": apply_rotary_pos_emb_deepseek_v4,
}
