"""Package namespaces whose names are imported on first use.

tfpar must not import TensorFlow before the CPU can be split into logical devices, and its
command line must answer ``--help`` without importing TensorFlow at all. So a package's
``__init__`` names what it offers (``tfpar.data.load``, ``tfpar.strategies.get``) without
importing the modules that define it: :func:`install` gives the package a module
``__getattr__`` (PEP 562) that imports a name's module when the name is first read, and makes
every submodule reachable as an attribute (``tfpar.allreduce.algorithms``).

A deprecated alias module (its docstring begins with :data:`DEPRECATED_MARK`) stays
importable until its announced removal but is left out of the package's ``dir()``, so that
completion and listings show only the current names.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types
import warnings
from collections.abc import Mapping

DEPRECATED_MARK = '"""Deprecated since '
"""How a deprecated alias module's source begins (its docstring names the replacement)."""


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
        current = {m for m in submodules if not _deprecated(module, m)}
        return sorted((set(vars(module)) - submodules) | set(names) | current)

    setattr(module, "__getattr__", __getattr__)  # noqa: B010 (a module's, not a method)
    setattr(module, "__dir__", __dir__)  # noqa: B010
    if names:
        setattr(module, "__all__",  # noqa: B010
                sorted(set(getattr(module, "__all__", ())) | set(names)))


def warn_deprecated_alias(message: str) -> None:
    """Warns, from a deprecated alias module's body, that it is deprecated: a
    ``DeprecationWarning`` attributed to the code that imported it, past the import system and
    a namespace's ``__getattr__`` (``from tfpar.callbacks import preemption`` imports through
    both), so that Python's default filters show it where that code is a script's own.

    Args:
        message: What is deprecated and what replaces it.
    """
    level = 2  # 1: this function; 2: the alias module's body.
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not ("importlib" in name and "_bootstrap" in name):  # warnings skips these.
            level += 1
            if "importlib" not in name and name != __file__:
                break
        frame = frame.f_back
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _deprecated(package, submodule: str) -> bool:
    """Whether ``package.submodule`` is a deprecated alias (read from its source's first
    characters, without importing it)."""
    for base in package.__path__:
        for path in (f"{base}/{submodule}.py", f"{base}/{submodule}/__init__.py"):
            try:
                with open(path, encoding="utf-8") as f:
                    return f.read(len(DEPRECATED_MARK)) == DEPRECATED_MARK
            except OSError:
                continue
    return False
