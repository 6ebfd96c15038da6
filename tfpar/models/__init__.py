"""Keras model builders for the seeds' networks, looked up by name.

Every builder is functional Keras with deterministic, hierarchical layer names and takes
``num_classes`` and ``input_shape``; the model outputs logits.
"""

from __future__ import annotations

from typing import Callable

import keras

from tfpar.errors import RegistryError
from tfpar.models.lenet import lenet
from tfpar.models.resnet import resnet18

_BUILDERS: dict[str, Callable[..., keras.Model]] = {"lenet": lenet, "resnet18": resnet18}


def available() -> list[str]:
    """Returns the names :func:`build` accepts."""
    return sorted(_BUILDERS)


def build(name: str, *, num_classes: int, input_shape: tuple[int, ...],
          **kwargs) -> keras.Model:
    """Builds the named model.

    Args:
        name: One of :func:`available`.
        num_classes: Number of output logits.
        input_shape: Image shape ``(height, width, channels)``.
        **kwargs: Passed on to the builder (e.g. ``synchronized_batchnorm`` for resnet18).

    Returns:
        An uncompiled functional Keras model.

    Raises:
        RegistryError: If ``name`` is unknown.
    """
    if name not in _BUILDERS:
        raise RegistryError(f"Unknown model {name!r}. Available models: {', '.join(available())}.")
    return _BUILDERS[name](num_classes=num_classes, input_shape=tuple(input_shape), **kwargs)


__all__ = ["available", "build", "lenet", "resnet18"]
