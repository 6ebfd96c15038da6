"""What a launcher and its workers agree on, in one module (no TensorFlow here).

- **Environment**: the names the launcher sets in each worker's environment.
- **Exit statuses**: :class:`~tfpar.errors.ExitStatus`, and how a process's return code reads
  as one (:func:`normalized`).
- **The state layout**: where a training command keeps its state under ``--model_dir``
  (:func:`run_folder_name`) and TensorFlow's checkpoint index there.
- **The position record**: the one record, outside a checkpoint, of where the state a folder
  holds resumes (:class:`Position`, ``position.json``). A saver commits it once per committed
  save (:func:`commit_position`); the launcher, a resume line, error lines and a stop line read
  it (:func:`read_position`, :func:`last_committed`). The checkpoint's own variables stay the
  truth for a restore.
- **The worker spec**: what a worker declares of itself as it starts training
  (:class:`WorkerSpec`: the folder of its state), at the path the launcher gives in
  :data:`WORKER_SPEC_ENV` (:func:`declare`; a user's own script can call it too). The launcher
  reads it, never the worker's flags.
- **The stop record**: a small JSON file each worker writes as it stops (its status, the reason
  in one line, which workers it found unresponsive, whether the notice's state was lost), at
  the path the launcher gives in :data:`STOP_RECORD_ENV`, read after the process exited, so
  what the launcher learns never races the worker's output, and never depends on English lines.

Every record is written whole (:mod:`tfpar.atomic_io`), and every reader gives a record or
``None``, never an error: a record is help for the launcher, not a need.

Why one module of this length: it is the contract between two programs, kept in one place so
that neither side's reading of a file or a variable can drift from the other's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import stat
import threading
from collections.abc import Sequence
from typing import Any

from tfpar import atomic_io
from tfpar.errors import SIGNALLED
from tfpar.errors import ConfigError
from tfpar.errors import ExitStatus

__all__ = ["ExitStatus", "Position", "SIGNALLED", "StopRecord", "WorkerSpec",
           "commit_position", "committed_save", "declare", "last_committed", "normalized",
           "read_position", "record_stop", "restored_position", "run_folder_name"]

# -- Environment -------------------------------------------------------------------------------

TF_CONFIG_ENV = "TF_CONFIG"
"""The worker's cluster and task, as TensorFlow reads them."""
SLOT_ENV = "TFPAR_WORKER_SLOT"
"""The worker's slot in an elastic job (0 to MAX - 1), kept across restarts."""
ALL_OUTPUT_ENV = "TFPAR_ALL_WORKERS_OUTPUT"
""""1": every worker prints its progress and report (else the chief only)."""
PRIVATE_NETWORK_ENV = "TFPAR_PRIVATE_NETWORK"
""""1": the worker runs on the launcher's private loopback network."""
STOP_RECORD_ENV = "TFPAR_STOP_RECORD"
"""Where the worker writes its :class:`StopRecord` as it stops."""
WORKER_SPEC_ENV = "TFPAR_WORKER_SPEC"
"""Where the job's chief writes its :class:`WorkerSpec` as it starts training."""
RESTARTS_ENV = "TFPAR_RESTARTS"
""""1": the launcher starts the job again after a failure (restarts, or an elastic job), so the
worker must resume from its saved state (tfpar-train refuses to run without a folder for it)."""
VISIBLE_GPUS_ENV = "CUDA_VISIBLE_DEVICES"
"""The GPUs a worker may use (CUDA's own variable, which TensorFlow reads at start-up)."""


# -- Exit statuses -----------------------------------------------------------------------------

def normalized(returncode: int) -> int:
    """A process's return code as a shell reports it: ``128 + N`` for a death by signal N
    (Python's ``Popen`` gives ``-N``)."""
    return SIGNALLED - returncode if returncode < 0 else returncode


# -- The state layout --------------------------------------------------------------------------

CHECKPOINT_INDEX = "checkpoint"
"""TensorFlow's checkpoint index file in a state folder."""
_INDEX_LATEST = re.compile(r'^model_checkpoint_path: "(?:.*/)?(ckpt-(\d+))"', re.M)


def latest_in_index(text: str) -> str | None:
    """The latest checkpoint's name (``"ckpt-N"``) that a checkpoint index's text names, or
    ``None``."""
    latest = _INDEX_LATEST.search(text)
    return latest[1] if latest else None


BACKUP_METADATA = "training_metadata.json"
"""Keras's ``BackupAndRestore`` metadata in a backup folder: the file whose replacement commits
a backup."""
BACKUP_GENERATION_KEY = "tfpar_generation"
"""The number tfpar's fix of ``BackupAndRestore`` gives each backup, in its metadata."""


def _latest_checkpoint(folder: str) -> str | None:
    """The latest checkpoint TensorFlow's index in ``folder`` names (``None``: no index)."""
    try:
        with _open_regular(os.path.join(folder, CHECKPOINT_INDEX)) as f:
            return latest_in_index(f.read())
    except (OSError, ValueError):
        return None


def committed_save(folder: str) -> str | None:
    """The name of the save a state folder resumes from, as its commit file says: TensorFlow's
    index's latest checkpoint (``"ckpt-N"``), or a backup's generation (``"generation-N"``;
    ``""`` for a backup Keras made alone); ``None`` where neither file is there."""
    if os.path.exists(os.path.join(folder, CHECKPOINT_INDEX)):
        return _latest_checkpoint(folder)
    metadata = _read_object(os.path.join(folder, BACKUP_METADATA))
    if metadata is None:
        return None
    generation = metadata.get(BACKUP_GENERATION_KEY)
    return f"generation-{generation}" if generation is not None else ""


def run_folder_name(strategy: str, num_devices: int) -> str:
    """The sub-folder of ``--model_dir`` where one device set's run keeps its state."""
    return f"{strategy}_{num_devices}_devices"


# -- The position record -----------------------------------------------------------------------

POSITION_FILE = "position.json"
"""The position record in a state folder: ``{"checkpoint": "ckpt-N", "epochs": E, "steps":
S}``, replaced whole after each committed save."""
LEGACY_POSITIONS_FILE = "positions.json"
"""tfpar 0.3's record of every kept checkpoint's position (``{"ckpt-N": [epochs, steps]}``),
read where a folder has no :data:`POSITION_FILE` (until 0.5.0)."""


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a saved state resumes.

    Attributes:
        epochs: Epochs finished.
        steps: Steps of the next epoch done (0: at an epoch's end).
        checkpoint: The save it is the position of (:func:`committed_save`: ``"ckpt-N"`` in
            TensorFlow's index, ``"generation-N"`` for a backup; ``""``: none saved, or a save
            not named).
        folder: The folder that holds the save.
    """

    epochs: int
    steps: int = 0
    checkpoint: str = ""
    folder: str = ""

    @property
    def pair(self) -> tuple[int, int]:
        """``(epochs finished, steps of the next epoch)``."""
        return self.epochs, self.steps

    @property
    def short(self) -> str:
        """In few words: ``"epoch 2"`` (finished) or ``"epoch 3 step 17"``."""
        return position_words(self.pair)

    @property
    def words(self) -> str:
        """In words: ``"the end of epoch 2"`` or ``"epoch 3 step 17"``."""
        return f"the end of epoch {self.epochs}" if not self.steps else self.short

    @property
    def where(self) -> str:
        """In words with its folder: ``"the end of epoch 2 in DIR"``."""
        return f"{self.words} in {self.folder}" if self.folder else self.words


def position_words(position: tuple[int, int]) -> str:
    """A position ``(epochs finished, steps of the next epoch)`` in few words: ``"epoch 2"``
    (finished) or ``"epoch 3 step 17"``."""
    epochs, steps = position
    return f"epoch {epochs}" if not steps else f"epoch {epochs + 1} step {steps}"


class _Commits:
    """This process's committed saves: how many, and the last."""

    def __init__(self):
        self.count = 0
        self.last: Position | None = None
        self.by_another = False  # Whether another process writes the last one's folder.
        self.lock = threading.Lock()


_COMMITS = _Commits()


def commit_position(folder: str, position: Position, *, write: bool = True,
                    by_another: bool = False) -> None:
    """Records that this process committed a save of ``position`` in ``folder``: writes the
    folder's position record (where ``write``: the process that writes the folder's files) and
    keeps it as this process's last commit (:func:`last_committed`). With ``by_another`` (a
    worker that saved its part to a scratch folder, the chief writing ``folder``), nothing is
    written, and the commit counts once the folder's record names it.

    Call it once per save, right after the save committed (a kill in between leaves the record
    naming the save before, which :func:`read_position` then does not take for the folder's).
    Never raises: an unwritable folder already failed the save.
    """
    position = dataclasses.replace(position, folder=folder)
    if write and not by_another:
        _write_position(position)
    with _COMMITS.lock:
        _COMMITS.count += 1
        _COMMITS.last = position
        _COMMITS.by_another = by_another


def restored_position(folder: str, position: Position) -> None:
    """Records that this process restored the save of ``position`` in ``folder`` (``(0, 0)``
    and no checkpoint: found none): the folder's position record says so from now on, where it
    did not (a folder tfpar 0.3 saved, a kill between a save's commit and its record, a fresh
    folder). Not a commit (:func:`last_committed`). Never raises."""
    position = dataclasses.replace(position, folder=folder)
    if read_position(folder) != position:
        _write_position(position)


def _write_position(position: Position) -> None:
    with contextlib.suppress(OSError, ValueError):
        atomic_io.make_dirs(position.folder)
        atomic_io.write_json(os.path.join(position.folder, POSITION_FILE), {
            "checkpoint": position.checkpoint, "epochs": position.epochs,
            "steps": position.steps})


def commits_made() -> int:
    """How many saves this process has committed so far (see :func:`last_committed`)."""
    return _COMMITS.count


def last_committed(since: int = 0) -> Position | None:
    """This process's last committed save, where it committed one after its first ``since``
    (:func:`commits_made` at some moment; 0: any). A save whose folder another process writes
    (a worker that is not the chief saved its part to a scratch folder) is held to the folder's
    record: where the writer has not committed it yet, the record's position is the one given
    (what a rerun resumes from), or none."""
    with _COMMITS.lock:
        last = _COMMITS.last if _COMMITS.count > since else None
        by_another = _COMMITS.by_another
    if last is None or not by_another:
        return last
    recorded = read_position(last.folder)
    return last if recorded is not None and recorded.pair == last.pair else recorded


def read_position(folder: str) -> Position | None:
    """The position of the state ``folder`` holds, from its position record: ``None`` where it
    has none, or the record and the save's commit file there (:func:`committed_save`) do not
    name the same save (a kill between a save's commit and its record; an index lost). A
    folder saved by tfpar 0.3 is read from its ``positions.json``. Never raises."""
    try:
        with _open_regular(os.path.join(folder, POSITION_FILE)) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            return None
        position = Position(int(data["epochs"]), int(data.get("steps", 0)),
                            str(data.get("checkpoint", "")), folder)
        if position.epochs < 0 or position.steps < 0:
            return None
    except FileNotFoundError:
        return _read_legacy_positions(folder)
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError, RecursionError):
        return None
    if (committed_save(folder) or "") != position.checkpoint:
        return None
    return position


def _read_legacy_positions(folder: str) -> Position | None:
    latest = _latest_checkpoint(folder)
    try:
        with _open_regular(os.path.join(folder, LEGACY_POSITIONS_FILE)) as f:
            positions = json.load(f)
        epochs, steps = positions[latest]
        return Position(int(epochs), int(steps), str(latest), folder)
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError, RecursionError):
        return None


# -- The worker spec ---------------------------------------------------------------------------

MAX_GRACE_SECONDS = 86400.0
"""The longest grace budget a worker may declare (a day)."""

@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker declares of itself to its launcher (the job's chief: the workers run one
    command).

    Attributes:
        folder: The folder of the training state it restored and saves (its position record
            is there; ``""``: none declared).
        grace_seconds: The longest it takes from a preemption notice to its exit (``None``:
            none declared; the launcher assumes the default budget).
        replicas_per_worker: The replicas (devices) each worker trains on (``None``: not
            declared).
        virtual_replicas: The shards of a world-size-invariant job (0: not one): it runs only
            on a number of replicas that divides them.
    """

    folder: str = ""
    grace_seconds: float | None = None
    replicas_per_worker: int | None = None
    virtual_replicas: int = 0

    def worker_counts(self, minimum: int, maximum: int) -> tuple[int, ...] | None:
        """The numbers of workers, from ``minimum`` to ``maximum``, the job may run with: for a
        world-size-invariant job, those whose replicas divide its shards; ``None``: any."""
        if not self.virtual_replicas or not self.replicas_per_worker:
            return None
        return tuple(n for n in range(minimum, maximum + 1)
                     if self.virtual_replicas % (n * self.replicas_per_worker) == 0)

    @classmethod
    def read(cls, path: str) -> WorkerSpec | None:
        """The spec at ``path``; ``None`` where there is none or it is not one."""
        data = _read_object(path)
        if data is None:
            return None
        # Each field on its own: one that is not what a worker declares is not declared.
        folder = data.get("folder")
        grace = _number(data.get("grace_seconds"), float, 0.0, MAX_GRACE_SECONDS)
        replicas = _number(data.get("replicas_per_worker"), int, 1)
        virtual = _number(data.get("virtual_replicas"), int, 0)
        return cls(folder if isinstance(folder, str) else "", grace, replicas, virtual or 0)


_declared: dict[str, Any] = {}


def declare(*, folder: str | None = None, grace_seconds: float | None = None,
            replicas_per_worker: int | None = None,
            virtual_replicas: int | None = None) -> WorkerSpec:
    """Declares what this process is to its launcher (:class:`WorkerSpec`), adding to what it
    declared before: written where the launcher asked (:data:`WORKER_SPEC_ENV`, given to the
    job's chief; nothing without one). tfpar declares for you: its savers their folder as they
    restore, a preemption notice's watch its grace budget, a strategy built through
    :mod:`tfpar.strategies` its replicas and shards. A script with savers or signal handling of
    its own declares the same way.

    Args:
        folder: The folder of the training state, where its position record is.
        grace_seconds: The longest it takes from a preemption notice to its exit.
        replicas_per_worker: The replicas each worker of the job trains on.
        virtual_replicas: The shards of a world-size-invariant job (0: not one).

    Returns:
        Everything this process declared so far.
    """
    for name, value, kind, least, most in (
            ("grace_seconds", grace_seconds, float, 0.0, MAX_GRACE_SECONDS),
            ("replicas_per_worker", replicas_per_worker, int, 1, None),
            ("virtual_replicas", virtual_replicas, int, 0, None)):
        if value is not None and _number(value, kind, least, most) is None:
            raise ConfigError(f"A worker spec's {name} must be a number from {least:g} "
                              f"{f'to {most:g}' if most else 'up'}"
                              f"{' (above 0)' if kind is float else ''}. Received: {value!r}.")
    given = {"folder": os.path.abspath(folder) if folder is not None else None,
             "grace_seconds": grace_seconds, "replicas_per_worker": replicas_per_worker,
             "virtual_replicas": virtual_replicas}
    _declared.update({name: value for name, value in given.items() if value is not None})
    spec = WorkerSpec(**_declared)
    path = os.environ.get(WORKER_SPEC_ENV)
    if path:
        with contextlib.suppress(OSError, ValueError):
            atomic_io.write_json(path, dataclasses.asdict(spec))
    return spec


# -- The stop record ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StopRecord:
    """What a worker says of its end.

    Attributes:
        status: Its exit status.
        reason: Why, in one line.
        unresponsive: The workers (indices) it found had stopped answering.
        work_lost: A preemption notice stopped it, but its state could not be saved within
            the grace budget: a rerun resumes at the folder's position and the training done
            since is lost (the preempted status is the same, so that the job is requeued).
    """

    status: int
    reason: str = ""
    unresponsive: tuple[int, ...] = ()
    work_lost: bool = False

    def write(self, path: str) -> None:
        """Writes it to ``path`` at once and whole (a reader sees all of it or nothing)."""
        atomic_io.write_text(path, json.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, path: str) -> StopRecord | None:
        """The record at ``path``; ``None`` where there is none or it is not one."""
        data = _read_object(path)
        if data is None:
            return None
        try:
            return cls(status=int(data["status"]), reason=str(data.get("reason", "")),
                       unresponsive=tuple(int(i) for i in data.get("unresponsive", ())),
                       work_lost=bool(data.get("work_lost", False)))
        except (ValueError, KeyError, TypeError, ArithmeticError):
            return None


def record_stop(status: int, reason: str = "", unresponsive: Sequence[int] = (),
                work_lost: bool = False) -> None:
    """Writes this process's :class:`StopRecord` where its launcher asked (nothing when it was
    not started by one). Never raises: a record is help for the launcher, not a need."""
    path = os.environ.get(STOP_RECORD_ENV)
    if not path:
        return
    with contextlib.suppress(OSError, ValueError):
        StopRecord(int(status), reason, tuple(unresponsive), work_lost).write(path)


def _number(value: Any, kind: type, least: float, most: float | None = None) -> Any:
    """``value`` as an ``int`` or a finite ``float`` from ``least`` (above it, for a float) to
    ``most``; ``None`` where it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or (kind is int and value != int(value)):
        return None
    number = kind(value)
    if number < least or (kind is float and number == least) or (
            most is not None and number > most):
        return None
    return number


def _open_regular(path: str):  # noqa: ANN202 - a text file object.
    """Opens ``path`` for reading where it is a regular file (a FIFO or a device would block a
    reader for ever); raises ``OSError`` otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.fdopen(fd, encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def _read_object(path: str) -> dict[str, Any] | None:
    """The JSON object in the file at ``path``; ``None`` where there is none."""
    try:
        with _open_regular(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):  # RecursionError: arrays nested too deep.
        return None
    return data if isinstance(data, dict) else None
