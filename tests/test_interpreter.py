"""Under Triton's interpreter, fp32 → bf16 casts round to nearest even, as the GPU's do, and the
kernels run whatever imported Triton before tigon."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tigon.functional as tf
from tigon._interpreter import _fp32_to_bf16_bits
from utils import ON_GPU


def test_bits_match_torch_rounding():
    finfo = torch.finfo(torch.float32)
    special = [0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), finfo.max, -finfo.max, finfo.tiny, 1e-40]
    # Exact ties between two bf16 values (1 + 2^-8 and 1 + 3·2^-8) and values just beside them.
    ties = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, np.nextafter(np.float32(1.0 + 2.0**-8), np.float32(2.0))]
    values = torch.cat([torch.tensor(special + ties), torch.randn(10_000) * 1e3, torch.randn(10_000) * 1e-30])
    expected = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(_fp32_to_bf16_bits(values.numpy()), expected)


def test_nan_stays_nan():
    values = np.array([np.nan, -np.nan], dtype=np.float32)
    assert torch.from_numpy(_fp32_to_bf16_bits(values).view(np.int16)).view(torch.bfloat16).isnan().all()


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs only without a GPU")
def test_kernel_rounds_like_eager():
    # RMSNorm with Llama's casting rounds x·rstd to bf16, multiplies by the weight and rounds again:
    # eager PyTorch rounds to nearest, so the kernel's output must be bit-identical.
    x = torch.randn(37, 300, dtype=torch.bfloat16)
    weight = torch.rand(300, dtype=torch.bfloat16) + 0.5
    x32 = x.float()
    eager = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(tf.rms_norm(x, weight, eps=1e-6), eager)


# Each imports Triton (transformers through its integrations, torch._inductor through its runtime)
# before tigon can switch the interpreter on. A fresh process: this one imported tigon long ago.
FIRST_IMPORTS = ["from transformers import LlamaForCausalLM", "import peft", "import trl", "import torch._inductor"]


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs only without a GPU")
@pytest.mark.parametrize("first_import", FIRST_IMPORTS)
def test_import_order_does_not_matter(first_import):
    script = f"""
{first_import}
import triton.language
import torch
import tigon.functional as tf
x = torch.randn(5, 40)
weight = torch.rand(40) + 0.5
expected = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
torch.testing.assert_close(tf.rms_norm(x, weight, eps=1e-6), expected)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
