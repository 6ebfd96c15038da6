"""Every file operation of tfpar's saves, in one place: atomic writes, renames, removals.

Each writer writes a temporary file in the destination's folder, flushes it to disk and
renames it over the destination (``os.replace`` is atomic on POSIX and Windows), so a reader
sees the old complete file or the new one.

The savers (checkpoints, ``BackupAndRestore``'s fix, each worker's replicas' copies, the
progress and stop records) make every change to their folders through this module: the
functions here, and :func:`external_writes` around what TensorFlow or Keras write themselves.
Inside :func:`recording`, each operation is also recorded (:class:`Operation`), in order and
with the bytes written, so that a test can rebuild the files a kill at any point of a save
leaves, as ALICE (OSDI'14) and CrashMonkey (OSDI'18) do, and hold the restore to them. Outside
it, recording costs one test of an empty list.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
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


@dataclasses.dataclass(frozen=True)
class Operation:
    """One change a save made to the file system, as a kill can cut it.

    Attributes:
        kind: ``"write"`` (``path`` now holds ``data``), ``"rename"`` (``path`` replaces
            ``target``), ``"remove"`` (the file ``path``), ``"remove_dir"`` (the folder
            ``path``, empty by then) or ``"make_dirs"``.
        path: The file or folder, absolute.
        target: Where a rename goes.
        data: What a write wrote.
        atomic: Whether a kill leaves the operation done or not done, never in between (a
            write's temporary file, or TensorFlow's files, which it renames into place); a
            non-atomic write can be left partly done.
        by: Who made it: ``"tfpar"``, or the library tfpar let write (``"tensorflow"``,
            ``"keras"``).
    """

    kind: str
    path: str
    target: str = ""
    data: bytes = b""
    atomic: bool = True
    by: str = "tfpar"


_recordings: list[list[Operation]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[Operation]]:
    """Records every operation of the savers inside it (in this process), in order.

    Yields:
        The list the operations are appended to.
    """
    operations: list[Operation] = []
    _recordings.append(operations)
    try:
        yield operations
    finally:
        _recordings.remove(operations)


def _record(operation: Operation) -> None:
    for operations in _recordings:
        operations.append(operation)


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, recorded."""
    if _recordings and not os.path.isdir(path):
        _record(Operation("make_dirs", os.path.abspath(path)))
    os.makedirs(path, exist_ok=True)


def replace(source: str, destination: str) -> None:
    """Renames ``source`` over ``destination`` in one step (``os.replace``), recorded."""
    os.replace(source, destination)
    _record(Operation("rename", os.path.abspath(source), os.path.abspath(destination)))


def remove(path: str) -> None:
    """Removes the file ``path`` (``os.remove``, which raises as it does), recorded."""
    os.remove(path)
    _record(Operation("remove", os.path.abspath(path)))


def remove_tree(path: str) -> None:
    """Removes the folder ``path`` and everything in it, if it is there (errors ignored, as
    ``shutil.rmtree(path, ignore_errors=True)``); recorded as each file's removal, then each
    folder's, deepest first, as a kill inside it can leave part of it."""
    if _recordings and os.path.isdir(path):
        for folder, _, names in os.walk(path, topdown=False):
            for name in sorted(names):
                _record(Operation("remove", os.path.abspath(os.path.join(folder, name))))
            _record(Operation("remove_dir", os.path.abspath(folder)))
    shutil.rmtree(path, ignore_errors=True)


def _snapshot(folder: str) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder`` (absolute path): its modification time and bytes."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.abspath(os.path.join(root, name))
            with contextlib.suppress(OSError):
                with open(path, "rb") as f:
                    files[path] = (os.stat(path).st_mtime_ns, f.read())
    return files


@contextlib.contextmanager
def external_writes(folder: str, by: str, whole: Callable[[str], bool] = lambda name: False,
                    order: Callable[[str], int] = lambda name: 0) -> Iterator[None]:
    """Around a library's own writes to ``folder`` (TensorFlow's checkpoint files, Keras's
    backup files), which tfpar does not make one by one: inside :func:`recording`, what changed
    in ``folder`` is recorded as that library's operations, the files written in the order
    they were (their modification times, then ``order``), then the files removed.

    Args:
        folder: The folder the library writes in.
        by: The library (``"tensorflow"``, ``"keras"``).
        whole: Whether the library writes the file of this name whole or not at all (renamed
            into place, as TensorFlow does its ``checkpoint`` index and data files); the
            others are written in place, and a kill can leave them partly written.
        order: The rank of a file of this name in the order the library writes its files,
            for files whose modification times tie (the kernel's clock ticks every few
            milliseconds).
    """
    if not _recordings:
        yield
        return
    before = _snapshot(folder)
    yield
    after = _snapshot(folder)
    written = sorted((mtime, order(os.path.basename(path)), path)
                     for path, (mtime, data) in after.items()
                     if before.get(path, (None, None))[1] != data)
    for _, _, path in written:
        _record(Operation("write", path, data=after[path][1],
                          atomic=whole(os.path.basename(path)), by=by))
    for path in sorted(set(before) - set(after)):
        _record(Operation("remove", path, by=by))


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
            if _recordings:  # A kill while it was written leaves part of it.
                _record(Operation("write", os.path.abspath(tmp), data=f.read(), atomic=False))
        replace(tmp, path)
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
