"""The classes tigon's layers take: ``Tigon<Original>``, a Hugging Face (or torchao) class with a
tigon mixin in front of it, made once per pair.

The lowest module of :mod:`tigon.transformers`: the patcher and the layer modules that change a
module's class in place (:mod:`tigon.transformers.float8`) both make their classes here, so that a
module patched twice, or by both, gets the one class.
"""

from __future__ import annotations

_DERIVED: dict[tuple[type, type], type] = {}


def tigon_class(original: type, mixin: type, **settings) -> type:
    """``Tigon<Original>``: ``original`` with ``mixin``'s forward and ``settings`` as class
    attributes, made once per pair so that instances patched twice share one class."""
    if (original, mixin) not in _DERIVED:
        attributes = {**settings, "tigon_replaces": original, "__module__": __name__}
        _DERIVED[original, mixin] = type(f"Tigon{original.__name__}", (mixin, original), attributes)
    return _DERIVED[original, mixin]
