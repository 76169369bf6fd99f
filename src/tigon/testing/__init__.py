"""What an installed tigon needs to check itself: the plain-PyTorch references of every op
(:mod:`tigon.testing.reference`), shared by the test suite, ``tigon check`` and the ``torch`` and
``torch.compile`` providers of ``tigon bench``, and the tolerances both checks hold the ops to."""

import torch

from tigon.testing import reference

__all__ = ["TOLERANCE", "reference"]

# Relative error ‖actual − truth‖ / ‖truth‖ allowed per dtype, against a truth computed in fp64
# from the same input values: one rounding of the output to the dtype, plus fp32 accumulation.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
