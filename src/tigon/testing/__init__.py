"""What an installed tigon needs to check itself: the plain-PyTorch references of every op
(:mod:`tigon.testing.reference`), shared by the test suite, ``tigon check`` and the ``torch`` and
``torch.compile`` providers of ``tigon bench``."""

from tigon.testing import reference

__all__ = ["reference"]
