"""tigon's public API as a user's typed code calls it, checked by mypy (`make typecheck`), never
run. A line ending in ``# type: ignore[...]`` is a call mypy must refuse: with
``warn_unused_ignores`` the check fails if the hints stop catching it."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tigon
from tigon import functional as F
from tigon.nn import CrossEntropyLoss, RMSNorm
from tigon.transformers import (
    AutoTigonForCausalLM,
    apply_tigon,
    apply_tigon_to_llama,
    apply_tigon_to_qwen3_moe,
    unapply_tigon,
    unapply_tigon_to_llama,
)

version: str = tigon.__version__

x = torch.randn(4, 8)
weight = torch.ones(8)
target = torch.randint(0, 8, (4,))
normed: torch.Tensor = F.rms_norm(x, weight, eps=1e-6)
loss: torch.Tensor = CrossEntropyLoss()(x, target)
norm = RMSNorm(8, eps=1e-6)
F.rms_norm(x, "weight")  # type: ignore[arg-type]

model = LlamaForCausalLM(LlamaConfig())
patched: LlamaForCausalLM = apply_tigon(model, rope=False)
same: LlamaForCausalLM = apply_tigon_to_llama(model=model, swiglu=False)
nothing: None = apply_tigon_to_qwen3_moe(experts=False)
restored: LlamaForCausalLM = unapply_tigon(model)
unapply_tigon_to_llama()
loaded = AutoTigonForCausalLM.from_pretrained("path", swiglu=False)
apply_tigon_to_llama(rope="yes")  # type: ignore[call-overload]
apply_tigon(model, rope="yes")  # type: ignore[arg-type]
