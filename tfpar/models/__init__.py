"""Keras model builders for the reference networks (LeNet, a modified ResNet-18), by name.

Every builder is functional Keras with deterministic, hierarchical layer names and takes
``num_classes`` and ``input_shape``; the model outputs logits.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import TYPE_CHECKING
from typing import Any

from tfpar.errors import RegistryError

if TYPE_CHECKING:
    import keras


def _lenet():
    from tfpar.models.lenet import lenet

    return lenet


def _resnet18():
    from tfpar.models.resnet import resnet18

    return resnet18


# Name -> the import of the builder of the same name. Imported on first use, so the names are
# known without importing Keras (command-line help answers at once).
_BUILDERS = {"lenet": _lenet, "resnet18": _resnet18}


def _builder(name: str):
    builder = _BUILDERS[name]()
    # Importing submodule `lenet` binds the package attribute `lenet` to the module; the
    # package's `lenet` is the builder function, as before the import was lazy.
    globals()[name] = builder
    return builder


def __getattr__(name):
    if name in _BUILDERS:  # The builder, not its module of the same name (lenet).
        return _builder(name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tfpar.models' has no attribute {name!r}")


_SUBMODULES = frozenset(m.name for m in pkgutil.iter_modules(__path__))


def available() -> list[str]:
    """Returns the names :func:`build` accepts."""
    return sorted(_BUILDERS)


def options(name: str) -> list[str]:
    """Returns the keyword options the named builder takes besides ``num_classes``,
    ``input_shape`` and ``name`` (e.g. ``synchronized_batchnorm`` for resnet18; none for lenet).

    Raises:
        RegistryError: If ``name`` is unknown.
    """
    if name not in _BUILDERS:
        raise RegistryError(f"Unknown model {name!r}. Available models: {', '.join(available())}.")
    parameters = inspect.signature(_builder(name)).parameters
    return [p for p in parameters if p not in ("num_classes", "input_shape", "name")]


def build(name: str, *, num_classes: int, input_shape: tuple[int, ...],
          **kwargs: Any) -> keras.Model:
    """Builds the named model.

    Args:
        name: One of :func:`available`.
        num_classes: Number of output logits.
        input_shape: Image shape ``(height, width, channels)``.
        **kwargs: Passed on to the builder (e.g. ``synchronized_batchnorm`` for resnet18).

    Returns:
        An uncompiled functional Keras model.

    Raises:
        RegistryError: If ``name`` is unknown, or its builder does not take an option.
    """
    unknown = sorted(set(kwargs) - set(options(name)) - {"name"})
    if unknown:
        raise RegistryError(f"Model {name!r} does not take {', '.join(unknown)}. Its options: "
                            f"{', '.join(options(name)) or 'none'}.")
    return _builder(name)(num_classes=num_classes, input_shape=tuple(input_shape), **kwargs)


__all__ = ["available", "build", "lenet", "options", "resnet18"]
