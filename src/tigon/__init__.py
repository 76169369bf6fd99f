"""tigon: Triton kernels for faster, lighter LLM training.

Without a CUDA device, Triton can only execute kernels through its interpreter, which must be
switched on before any kernel is defined: importing tigon does that (``TRITON_INTERPRET=1``)
unless the variable is already set, so every op also runs, slowly, on CPU tensors. Triton's own
library functions, decorated in compiled mode if a library imported Triton first (transformers,
PEFT, TRL, ``torch._inductor``), are re-decorated for the interpreter, so the import order does not
matter. Under the interpreter, fp32 → bf16 casts are made to round to nearest even, as on the GPU.

A torch or triton newer than the newest release tigon is tested with gets an
:class:`UntestedVersionWarning` (:mod:`tigon._versions`), and runs.
"""

import os

import numpy
import torch
import triton

from tigon._versions import UntestedVersionWarning, check_interpreter_numpy, warn_if_newer

warn_if_newer("torch", torch.__version__)
warn_if_newer("triton", triton.__version__)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    check_interpreter_numpy(triton.__version__, numpy.__version__)
    from tigon._interpreter import interpret_triton_library, round_bf16_casts_to_nearest

    interpret_triton_library()
    round_bf16_casts_to_nearest()

from tigon import functional, nn  # noqa: E402

__version__ = "0.1.0"
__all__ = ["functional", "nn", "UntestedVersionWarning", "__version__"]
