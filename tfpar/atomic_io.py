"""Writing result files atomically: a reader sees the old complete file or the new one.

Each writer writes a temporary file in the destination's folder, flushes it to disk and
renames it over the destination (``os.replace`` is atomic on POSIX and Windows).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from tfpar.errors import ConfigError


def check_writable(path: str) -> None:
    """Raises unless a file can be written at ``path``, before any work is done.

    Raises:
        ConfigError: If the folder does not exist, is not a folder, or is not writable, or
            ``path`` is a folder.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"Output path {path!r} is a directory; give a file path such as "
                          f"{os.path.join(path, 'results.json')!r}.")
    if not os.path.isdir(folder):
        raise ConfigError(f"The folder of output path {path!r} does not exist: {folder!r}. "
                          "Create it first or choose an existing folder.")
    # Actually create a file there: permission bits say nothing for root, nor about a
    # read-only or full file system.
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".probe",
                                     dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"The folder of output path {path!r} is not writable: {folder!r} "
                          f"({e.strerror}). Choose a folder you can write to.") from None


def check_writable_dir(path: str, what: str) -> None:
    """Creates folder ``path`` if needed and raises unless a file can be written in it.

    Args:
        path: The folder.
        what: What it is for, for the message (e.g. ``"model_dir"``).

    Raises:
        ConfigError: If ``path`` is a file, or the folder cannot be created or written.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a file; give a folder (it is created if "
                          "missing).")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{what} {path!r} cannot be written ({e.strerror}). Choose a folder "
                          "you can write to.") from None


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path to write; renames it over ``path`` if the block succeeds.

    On an exception (including ``KeyboardInterrupt``) the temporary file is removed and
    ``path`` is left as it was.

    Args:
        path: The destination file.

    Yields:
        The temporary path, in the same folder as ``path``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def json_safe(value: Any) -> Any:
    """Returns ``value`` with every NaN or infinite float replaced by ``None``.

    JSON has no NaN or Infinity (Python writes bare ``NaN``, which other languages' parsers
    reject); a diverged run's losses are written as ``null``.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: str, value: Any) -> None:
    """Writes ``value`` as indented, strict JSON to ``path`` atomically (NaN as ``null``)."""
    write_text(path, json.dumps(json_safe(value), indent=2, sort_keys=True, allow_nan=False)
               + "\n")
