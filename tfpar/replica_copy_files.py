"""The files a save of the replicas' own copies is made of, and the list a save records of them.

Each worker writes its own replicas' copies to a binary file of its own
(``replicas-FIRST-LAST-of-TOTAL.npz``, NumPy's format, every bit kept), as PyTorch's distributed
checkpoint has each rank write its shard; a restore on the same number of replicas opens only
the file of its own replicas, one on another number reads every file for their mean. A save
lists its files (each file's name, its replicas and the fingerprints of each copy: two SipHash
values of its raw bytes), and a restore given the list reads exactly those files and refuses one
that is missing, not readable or not the one written (:class:`~tfpar.errors.DamagedStateError`,
naming the file). :mod:`tfpar.replica_copies` decides what to write and gives each replica its
copy back; this module is the format, and runs no collective.
"""

from __future__ import annotations

import contextlib
import os
import re
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tfpar import atomic_io
from tfpar.errors import DamagedStateError

#: The copies of each variable, by the variable's place in ``model.variables`` (as Keras's own
#: checkpoints match variables: two builds of one model may name layers apart): an array whose
#: first axis is the replica.
Copies = dict[int, np.ndarray]

# Two keys of SipHash (TensorFlow's ``to_hash_bucket_strong``): 126 bits of the copy's bytes.
_HASH_KEYS = ((0x7466706172, 0x636F70696573), (0x62697473, 0x666F72626974))
_HASH_BUCKETS = 2**63 - 1


def fingerprint(value: tf.Tensor) -> tf.Tensor:
    """Two int64 hashes of a copy's raw bytes: copies that differ in any bit (a permutation,
    one ulp beside a large value, ``-0.0`` against ``+0.0``) differ here but with a chance of
    about 2**-126."""
    data = tf.io.serialize_tensor(value)  # The tensor's bytes, behind its dtype and shape.
    return tf.stack([tf.strings.to_hash_bucket_strong(data, _HASH_BUCKETS, key=list(key))
                     for key in _HASH_KEYS])


_FILE = re.compile(r"^replicas-(\d+)-(\d+)-of-(\d+)\.npz$")

UNRECORDED: Any = object()
"""What a restore takes for ``files`` where the save recorded no list of its files (saves made
before the list was recorded): the files found in the folder are read as they are."""

#: A save's list of its files (see :func:`tfpar.replica_copies.write_files`): JSON-ready, so a
#: checkpoint holds it.
FileList = dict[str, Any]


def file_name(first: int, last: int, total: int) -> str:
    """The name of the file of replicas ``first`` to ``last`` of ``total``."""
    return f"replicas-{first:05d}-{last:05d}-of-{total:05d}.npz"


def fingerprint_text(prints: np.ndarray) -> str:
    """A copy's two fingerprints as one hexadecimal string."""
    return "".join(f"{int(value) & (2**64 - 1):016x}" for value in prints)


def write_own(folder: str, replica_ids: list[int], total: int,
              copies: Mapping[int, np.ndarray]) -> str:
    """Writes one worker's file: its replicas' copies (rows in the order of ``replica_ids``,
    contiguous ids of ``total``) by the variable's place; returns its path. What
    :func:`tfpar.replica_copies.write` does on each worker after the fingerprints, without a
    strategy (for benchmarks of the cost at a number of replicas this machine cannot run)."""
    arrays: dict[str, Any] = {"replica_ids": np.asarray(replica_ids, np.int64)}
    arrays.update({f"variable_{place}": value for place, value in copies.items()})
    atomic_io.make_dirs(folder)
    path = os.path.join(folder, file_name(min(replica_ids), max(replica_ids), total))
    with atomic_io.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    return path


def damaged(path: str, problem: str, received: str) -> DamagedStateError:
    """The error for the file ``path``, which ``problem`` (what a restore found)."""
    return DamagedStateError(
        f"The replicas' copies file {path} {problem}. A restore reads each file its save "
        f"wrote, as written; start over (resume=False), or use another model_dir. "
        f"Received: {received}.")


def read_own(folder: str, replica_ids: list[int], files: FileList | None = UNRECORDED
             ) -> Copies:
    """One worker's copies from ``folder``, read from the files of its replicas only: each
    variable's rows in the order of ``replica_ids``.

    Args:
        folder: The folder :func:`tfpar.replica_copies.write` wrote.
        replica_ids: This worker's replicas.
        files: The save's list of its files (:attr:`tfpar.replica_copies.Written.files`),
            which the files are held to; :data:`UNRECORDED`: the files found are read.

    Raises:
        DamagedStateError: If a file is missing, not readable, or not what was written (or,
            unrecorded, the files do not cover every replica once).
    """
    layout, _ = saved_layout(folder, files)
    wanted = set(replica_ids)
    own = [name for name, (first, last, _) in layout.items()
           if first <= max(wanted) and last >= min(wanted)]
    rows = _rows(folder, own, wanted, files)
    return {place: np.stack([by_id[i] for i in replica_ids]) for place, by_id in rows.items()}


def saved_layout(folder: str, files: FileList | None = UNRECORDED
                 ) -> tuple[dict[str, tuple[int, int, int]], int]:
    """The files of a save by name (their first and last replica, and of how many), and the
    number of replicas that saved (0: none saved): those of ``files`` where the save listed
    them, else those found in ``folder``.

    Raises:
        DamagedStateError: If the files found do not cover every replica once.
    """
    if files is None:
        return {}, 0
    if files is not UNRECORDED:
        layout = {name: (entry["replica_ids"][0], entry["replica_ids"][-1], files["replicas"])
                  for name, entry in files["files"].items()}
        return layout, int(files["replicas"])
    layout = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in os.listdir(folder):
            match = _FILE.match(name)
            if match:
                first, last, total = (int(group) for group in match.groups())
                layout[name] = (first, last, total)
    if not layout:
        return layout, 0
    totals = {total for _, _, total in layout.values()}
    covered = sorted(i for first, last, _ in layout.values() for i in range(first, last + 1))
    if len(totals) != 1 or covered != list(range(next(iter(totals)))):
        raise DamagedStateError(
            f"The replicas' copies in {folder} do not cover each replica once "
            f"({', '.join(sorted(layout))}). A restore needs one file for each worker of the "
            "save; start over (resume=False), or use another model_dir. Received: "
            f"{len(layout)} file(s) for {len(covered)} replica(s).")
    return layout, totals.pop()


def read_mean(folder: str, files: FileList | None = UNRECORDED) -> Copies:
    """The mean of every replica's saved copy of each variable in ``folder``, summed in float64
    in the replicas' order (the same on every worker), one row each: what each replica of
    another number of replicas starts from (an elastic job that shrank or grew).

    Args:
        folder: The folder :func:`tfpar.replica_copies.write` wrote.
        files: The save's list of its files, as :func:`tfpar.replica_copies.read` takes it.

    Raises:
        DamagedStateError: If a file is missing, not readable, or not what was written (or,
            unrecorded, the files do not cover every replica once, or hold other variables).
    """
    layout, saved_total = saved_layout(folder, files)
    rows = _rows(folder, sorted(layout, key=lambda name: layout[name][0]), None, files)
    means = {}
    for place, by_id in rows.items():
        total = np.zeros(next(iter(by_id.values())).shape, np.float64)
        for i in sorted(by_id):
            total += by_id[i]
        means[place] = (total / saved_total).astype(by_id[i].dtype)[None]
    return means


# What loading a damaged file raises: truncated (BadZipFile), empty (EOFError), not NumPy's
# (ValueError), a member missing (KeyError), a member cut short (ValueError, zlib.error).
_UNREADABLE = (OSError, EOFError, LookupError, ValueError, TypeError, zipfile.BadZipFile,
               zlib.error)


def _load(path: str) -> tuple[list[int], dict[int, np.ndarray]]:
    """A file's replica ids and its copies by the variable's place.

    Raises:
        DamagedStateError: If it is missing or not readable.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            replica_ids = [int(i) for i in data["replica_ids"]]
            copies = {int(key[len("variable_"):]): data[key] for key in data.files
                      if key.startswith("variable_")}
    except FileNotFoundError:
        raise damaged(path, "saved with this state is missing", "no such file") from None
    except _UNREADABLE as e:
        raise damaged(path, "is not readable", f"{type(e).__name__}: {e}") from None
    return replica_ids, copies


def _rows(folder: str, names: list[str], ids: set[int] | None,
          files: FileList | None = UNRECORDED) -> dict[int, dict[int, np.ndarray]]:
    """Each saved variable's copies in the files ``names``, by place and replica id (only the
    replicas in ``ids``, or all), each file held to the save's list where there is one."""
    rows: dict[int, dict[int, np.ndarray]] = {}
    places: set[int] | None = None
    for name in names:
        path = os.path.join(folder, name)
        replica_ids, copies = _load(path)
        first, last = (int(group) for group in name[len("replicas-"):].split("-")[:2])
        if replica_ids != list(range(first, last + 1)):
            raise damaged(path, f"holds the copies of other replicas than its name says "
                           f"({first} to {last})", f"replicas {replica_ids}")
        for place, value in copies.items():
            if value.shape[:1] != (len(replica_ids),):
                raise damaged(path, f"holds {value.shape[:1]} rows of variable {place} for "
                               f"{len(replica_ids)} replicas", f"shape {value.shape}")
        if files is not UNRECORDED and files is not None:
            listed = files["files"][name]["variables"]
            if sorted(copies) != sorted(int(place) for place in listed):
                raise damaged(path, "is not the one its save wrote: it holds other variables",
                               f"variables {sorted(copies)}, saved "
                               f"{sorted(int(place) for place in listed)}")
            for place, value in copies.items():
                found = [fingerprint_text(p) for p in _fingerprints_of(value)]
                if found != listed[str(place)]:
                    raise damaged(path, "is not the one its save wrote: its copies differ "
                                   "from those saved (another save's or another worker's "
                                   "file)", f"the copies of variable {place} with other "
                                   "fingerprints")
        elif places is None:
            places = set(copies)
        elif places != set(copies):
            raise damaged(path, "holds other variables than the other files of its save",
                           f"variables {sorted(copies)}, others {sorted(places)}")
        for place, value in copies.items():
            for row, replica in enumerate(replica_ids):
                if ids is None or replica in ids:
                    rows.setdefault(place, {})[replica] = value[row]
    return rows


def _fingerprints_of(rows: np.ndarray) -> np.ndarray:
    """The fingerprints of each row (one replica's copy) of a file's variable, as
    :func:`tfpar.replica_copies.write_files` recorded them."""
    return np.stack([fingerprint(tf.constant(row)).numpy() for row in rows])


def decode_json(data: Mapping[str, Any]) -> Copies:
    """The copies of a save made before :func:`tfpar.replica_copies.write` (tfpar 0.3's JSON),
    for its restore.

    Raises:
        ValueError: If ``data`` is not such copies.
    """
    try:
        return {int(place): np.asarray(entry["values"], dtype=entry["dtype"]).reshape(
            entry["shape"]) for place, entry in data.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"Not saved replicas' copies ({type(e).__name__}: {e}).") from None
