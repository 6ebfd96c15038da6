"""One way to patch an attribute of a TensorFlow or Keras class for the length of a ``with``
block: the attribute the class itself held is put back after (an inherited one is removed
again, so the class reads its base's), however the block ends. Every temporary class patch of
the workarounds in this package goes through :func:`attribute_set`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_ABSENT = object()


@contextlib.contextmanager
def attribute_set(owner: type, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block, and what it was after.

    Args:
        owner: The class patched.
        name: The attribute.
        value: Its value inside the block.
    """
    before = owner.__dict__.get(name, _ABSENT)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if before is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, before)
