"""Without a GPU every test runs the real kernels through Triton's interpreter on CPU tensors."""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))
