"""Package namespaces whose names are imported on first use.

tfpar must not import TensorFlow before the CPU can be split into logical devices, and its
command line must answer ``--help`` without importing TensorFlow at all. So a package's
``__init__`` names what it offers (``tfpar.data.load``, ``tfpar.strategies.get``) without
importing the modules that define it: :func:`install` gives the package a module
``__getattr__`` (PEP 562) that imports a name's module when the name is first read, and makes
every submodule reachable as an attribute (``tfpar.allreduce.algorithms``).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Mapping


def install(package: str, names: Mapping[str, str] | None = None) -> None:
    """Makes ``names`` and every submodule of ``package`` importable on first use.

    Call it at the end of the package's ``__init__``: ``install(__name__, {"load":
    "loading"})`` makes ``package.load`` the ``load`` of ``package.loading``.

    Args:
        package: The package's ``__name__``.
        names: Public name to the submodule (relative to ``package``) that defines it.
    """
    names = dict(names or {})
    module = sys.modules[package]
    submodules = frozenset(m.name for m in pkgutil.iter_modules(module.__path__))

    def __getattr__(name: str):
        if name in names:
            value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(names) | submodules)

    setattr(module, "__getattr__", __getattr__)  # noqa: B010 (a module's, not a method)
    setattr(module, "__dir__", __dir__)  # noqa: B010
    if names:
        setattr(module, "__all__",  # noqa: B010
                sorted(set(getattr(module, "__all__", ())) | set(names)))
