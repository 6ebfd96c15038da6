"""absl flags derived from config dataclasses (:mod:`tfpar.config_fields`): one flag per field,
its type, default, help and allowed values taken from the class, and the values read back into
the class, which checks them.

Types map to flags as ``bool`` -> ``DEFINE_bool``, ``int`` -> ``DEFINE_integer``, ``float`` ->
``DEFINE_float``, ``str`` -> ``DEFINE_string`` (``DEFINE_enum`` with choices), ``tuple[T, ...]``
-> ``DEFINE_list`` of ``T`` (``--name=a,b``). A sweep (:func:`define_sweep`) makes each field a
list flag of values to measure in turn.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Iterable
from typing import Any

from absl import flags

from tfpar import config_fields
from tfpar.errors import ConfigError

FLAGS = flags.FLAGS


def _fields(cls: type, exclude: Iterable[str]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in set(exclude)]


def _kind(hint: Any) -> tuple[type, bool]:
    """``(scalar type, is a list)`` of a field's type hint (``None`` in a union dropped)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        # A number or a word (e.g. an int or "auto"): a string flag the class converts.
        hint = str if str in kinds else kinds[0]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def _help(cls: type, f: dataclasses.Field) -> str:
    text = config_fields.descriptions(cls).get(f.name)
    if not text:
        raise TypeError(f"{cls.__name__}'s docstring does not describe {f.name} under "
                        "Attributes: every field's description is its flag's help.")
    return text


def define(cls: type, *, exclude: Iterable[str] = (), module_name: str | None = None,
           flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """Defines a flag for every field of dataclass ``cls`` but those in ``exclude``.

    Args:
        cls: The config dataclass.
        exclude: Fields that get no flag.
        module_name: The module the flags belong to (``--help`` lists them under it, and
            :func:`tfpar.cli.common.run_main` makes them the program's); the caller's if unset.
        flag_values: Where to define them.

    Returns:
        The names of the flags defined.
    """
    module_name = module_name or sys._getframe(1).f_globals["__name__"]
    hints = typing.get_type_hints(cls)
    names = []
    for f in _fields(cls, exclude):
        scalar, is_list = _kind(hints[f.name])
        default = config_fields.default_of(cls, f.name)
        allowed = config_fields.choices_of(f)
        name, text = config_fields.flag_of(f), _help(cls, f)
        if is_list:
            flags.DEFINE_list(name, None if default is None else [str(v) for v in default],
                              text, flag_values=flag_values, module_name=module_name)
        elif scalar is bool:
            flags.DEFINE_bool(name, default, text, flag_values=flag_values,
                              module_name=module_name)
        elif allowed is not None:
            flags.DEFINE_enum(name, default, list(allowed), text, flag_values=flag_values,
                              module_name=module_name)
        elif scalar is int:
            flags.DEFINE_integer(name, default, text, flag_values=flag_values,
                                 module_name=module_name)
        elif scalar is float:
            flags.DEFINE_float(name, default, text, flag_values=flag_values,
                               module_name=module_name)
        else:
            flags.DEFINE_string(name, None if default is None else str(default), text,
                                flag_values=flag_values, module_name=module_name)
        names.append(name)
    return names


def define_sweep(cls: type, *, exclude: Iterable[str] = (), module_name: str | None = None,
                 flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """Defines, for every field of ``cls`` but those in ``exclude``, a list flag of values to
    measure in turn (unset: the field's default).

    Returns:
        The names of the flags defined.
    """
    module_name = module_name or sys._getframe(1).f_globals["__name__"]
    names = []
    for f in _fields(cls, exclude):
        allowed = config_fields.choices_of(f)
        text = (f"Values to sweep{' (of ' + ', '.join(allowed) + ')' if allowed else ''}; "
                f"{config_fields.default_of(cls, f.name)!r} if unset. {_help(cls, f)}")
        flags.DEFINE_list(config_fields.flag_of(f), None, text, module_name=module_name,
                          flag_values=flag_values)
        names.append(config_fields.flag_of(f))
    return names


def _parse(flag: str, scalar: type, text: str) -> Any:
    if scalar is str:
        return text
    try:
        return scalar(text)
    except ValueError:
        kind = "integers" if scalar is int else "numbers"
        raise ConfigError(f"--{flag} takes a comma list of {kind}. Received: "
                          f"{text!r}.") from None


def values(cls: type, *, exclude: Iterable[str] = (),
           flag_values: flags.FlagValues = FLAGS) -> dict[str, Any]:
    """Returns ``{field: value}`` of the flags :func:`define` made for ``cls`` (lists as tuples
    of the field's element type; the class checks the values when it is built)."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in _fields(cls, exclude):
        flag = config_fields.flag_of(f)
        value = flag_values[flag].value
        scalar, is_list = _kind(hints[f.name])
        if is_list and value is not None:
            value = tuple(_parse(flag, scalar, v) for v in value)
        found[f.name] = value
    return found


def sweep_values(cls: type, *, exclude: Iterable[str] = (),
                 flag_values: flags.FlagValues = FLAGS) -> dict[str, list[Any]]:
    """Returns ``{field: values}`` of the sweep flags that were set, each value checked by
    building ``cls`` with it.

    Raises:
        TfparError: For a value ``cls`` does not allow (naming the flag).
    """
    hints = typing.get_type_hints(cls)
    found = {}
    for f in _fields(cls, exclude):
        flag = config_fields.flag_of(f)
        if flag_values[flag].value is None:
            continue
        scalar, _ = _kind(hints[f.name])
        found[f.name] = [_parse(flag, scalar, v) for v in flag_values[flag].value or ()]
        for value in found[f.name]:
            cls(**{f.name: value})
    return found


def flag_names(cls: type) -> dict[str, str]:
    """``{field: flag}`` for the fields whose flag has another name (errors name the flag)."""
    return {f.name: config_fields.flag_of(f) for f in dataclasses.fields(cls)
            if config_fields.flag_of(f) != f.name}
