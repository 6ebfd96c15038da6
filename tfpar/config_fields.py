"""Config dataclasses declared once: each field's default, its allowed values and its
description, from which the command-line programs derive their flags
(:mod:`tfpar.cli.config_flags`).

A config class is a frozen dataclass whose docstring's ``Attributes:`` section (Google style)
describes every field: that text is the flag's help. :func:`field` adds what a flag needs
beyond the type and default: the allowed values (``choices``: a tuple, or a function returning
one, such as a registry's ``available``) and, where it differs, the flag's name. The class
checks its values itself (``__post_init__``), so a value is checked the same way whether it
comes from a flag or from Python. No TensorFlow; of tfpar, only :mod:`tfpar.errors`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from tfpar.errors import TfparError

Choices = Sequence[str] | Callable[[], Sequence[str]]

_CHOICES = "tfpar.choices"
_FLAG = "tfpar.flag"


def field(default: Any = dataclasses.MISSING, *, choices: Choices | None = None,
          flag: str | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with what its flag needs.

    Args:
        default: The default value.
        choices: The allowed values, or a function returning them (evaluated when the flags
            are defined and when the value is checked).
        flag: The flag's name where it differs from the field's.
        default_factory: As for :func:`dataclasses.field`.

    Returns:
        The ``dataclasses.field``.
    """
    metadata = {_CHOICES: choices, _FLAG: flag}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def choices_of(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The allowed values of field ``f``, or ``None`` when any value of its type is."""
    allowed = f.metadata.get(_CHOICES)
    if allowed is None:
        return None
    return tuple(allowed() if callable(allowed) else allowed)


def flag_of(f: dataclasses.Field) -> str:
    """The name of the flag that sets field ``f``."""
    return f.metadata.get(_FLAG) or f.name


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (for signatures that share it)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def plain_text(text: str) -> str:
    """``text`` without reStructuredText's markup, for a terminal or a flag table:
    ``:class:`tfpar.x.Y``` becomes ``tfpar.x.Y``, ````code```` becomes ``code`` and a
    literal block's ``::`` a colon."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = text.replace("``", "")
    return re.sub(r"(?<=\w)::(?=\s|$)", ":", text, flags=re.MULTILINE)


def descriptions(cls: type) -> dict[str, str]:
    """Each field's description, from the ``Attributes:`` section of ``cls``'s docstring, as
    one line of plain text (:func:`plain_text`)."""
    doc = inspect.getdoc(cls) or ""
    match = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)*)", doc, re.MULTILINE)
    if not match:
        return {}
    found: dict[str, list[str]] = {}
    current = None
    for line in match.group(1).splitlines():
        item = re.match(r"^    (\w+)(?: \(.*?\))?: (.*)$", line)
        if item:
            current = item.group(1)
            found[current] = [item.group(2)]
        elif current and line.startswith("        "):
            found[current].append(line.strip())
    return {name: plain_text(" ".join(lines)) for name, lines in found.items()}


def check_choices(config: Any, error: type[TfparError]) -> None:
    """Raises ``error`` for the first field of dataclass instance ``config`` whose value is
    not one of its choices."""
    for f in dataclasses.fields(config):
        allowed = choices_of(f)
        value = getattr(config, f.name)
        if allowed is not None and value not in allowed:
            raise error(f"{{argument}} must be one of {', '.join(allowed)}. "
                        f"Received: {{argument}}={value!r}.", argument=f.name)


def normalise_count_or(config: Any, name: str, word: str, error: type[TfparError]) -> None:
    """Makes field ``name`` of frozen dataclass instance ``config`` an integer when it is a
    string of digits (``"8"``, as a flag gives it), then raises ``error`` unless it is an
    integer >= 1 or the string ``word`` (``"auto"``)."""
    value = getattr(config, name)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
        object.__setattr__(config, name, value)
    if not (value == word or (isinstance(value, int) and not isinstance(value, bool)
                              and value >= 1)):
        raise error(f"{{argument}} must be an integer >= 1 or {word!r}. "
                    f"Received: {{argument}}={value!r}.", argument=name)
