"""What the launcher and its workers agree on, in one place (no TensorFlow here).

- **Environment**: the names the launcher sets in each worker's environment.
- **Exit statuses**: :class:`~tfpar.errors.ExitStatus`, and how a process's return code reads
  as one (:func:`normalized`).
- **The state layout**: where a training command keeps its state under ``--model_dir``
  (:func:`run_folder_name`), the file of saved positions that
  :class:`~tfpar.callbacks.EpochCheckpoint` writes beside TensorFlow's checkpoint index, and the
  reader of the position saved there (:func:`saved_position`), shared by both sides.
- **The stop record**: a small JSON file each worker writes as it stops (its status, the reason
  in one line, which workers it found unresponsive, the position it saved), at the path the
  launcher gives it in :data:`STOP_RECORD_ENV`. The launcher reads it after the process exited,
  so what it learns never races the worker's output, and never depends on English lines.
- **The progress record**: where the job's chief resumed and the last position it saved since,
  and in which folder (:class:`ProgressRecord`, from :mod:`tfpar.progress_record`, which the
  savers below this package write), at the path the launcher gives in
  :data:`PROGRESS_RECORD_ENV`. The launcher learns the job's progress from it alone, whatever
  folder, strategy or device count the command chose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Sequence

from tfpar import atomic_io
from tfpar.errors import SIGNALLED
from tfpar.errors import ExitStatus
from tfpar.progress_record import PROGRESS_RECORD_ENV
from tfpar.progress_record import ProgressRecord
from tfpar.progress_record import record_progress

__all__ = ["ExitStatus", "PROGRESS_RECORD_ENV", "ProgressRecord", "SIGNALLED",
           "record_progress"]

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
POSITIONS_FILE = "positions.json"
"""tfpar's positions file in a state folder: ``{"ckpt-N": [epochs finished, steps of the next
epoch]}``, written before the checkpoint it names."""
_INDEX_LATEST = re.compile(r'^model_checkpoint_path: "(?:.*/)?(ckpt-(\d+))"', re.M)


def latest_in_index(text: str) -> str | None:
    """The latest checkpoint's name (``"ckpt-N"``) that a checkpoint index's text names, or
    ``None``."""
    latest = _INDEX_LATEST.search(text)
    return latest[1] if latest else None


def run_folder_name(strategy: str, num_devices: int) -> str:
    """The sub-folder of ``--model_dir`` where one device set's run keeps its state."""
    return f"{strategy}_{num_devices}_devices"


def saved_position(folder: str) -> tuple[int, int] | None:
    """The position of the latest checkpoint in one state folder: ``(epochs finished, steps of
    the next epoch)``, or ``None`` where none is saved (or it is not tfpar's: no positions
    file, so its number says nothing about epochs)."""
    try:
        with open(os.path.join(folder, CHECKPOINT_INDEX), encoding="utf-8") as f:
            latest = latest_in_index(f.read())
        with open(os.path.join(folder, POSITIONS_FILE), encoding="utf-8") as f:
            positions = json.load(f)
    except (OSError, ValueError):
        return None
    if latest is None or not isinstance(positions, dict) or latest not in positions:
        return None
    epochs, steps = positions[latest]
    return int(epochs), int(steps)


def last_saved_position(model_dir: str, runs: Sequence[str] = ("",)) -> tuple[int, int]:
    """The furthest position saved in ``model_dir``'s folders ``runs`` (``""``: the folder
    itself), ``(0, 0)`` for none."""
    positions = [saved_position(os.path.join(model_dir, run)) for run in runs]
    return max([(0, 0), *(p for p in positions if p is not None)])


# -- The stop record ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StopRecord:
    """What a worker says of its end.

    Attributes:
        status: Its exit status.
        reason: Why, in one line.
        unresponsive: The workers (indices) it found had stopped answering.
        position: The position it saved last, ``(epochs finished, steps of the next epoch)``.
        work_lost: A preemption notice stopped it, but its state could not be saved within
            the grace budget: a rerun resumes at ``position`` and the training done since is
            lost (the preempted status is the same, so that the job is requeued).
    """

    status: int
    reason: str = ""
    unresponsive: tuple[int, ...] = ()
    position: tuple[int, int] | None = None
    work_lost: bool = False

    def write(self, path: str) -> None:
        """Writes it to ``path`` at once and whole (a reader sees all of it or nothing)."""
        atomic_io.write_text(path, json.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, path: str) -> StopRecord | None:
        """The record at ``path``; ``None`` where there is none or it is not one."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict):  # JSON, but not a record (a launcher must not fail).
                return None
            position = data.get("position")
            return cls(status=int(data["status"]), reason=str(data.get("reason", "")),
                       unresponsive=tuple(int(i) for i in data.get("unresponsive", ())),
                       position=tuple(position) if position else None,
                       work_lost=bool(data.get("work_lost", False)))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def record_stop(status: int, reason: str = "", unresponsive: Sequence[int] = (),
                position: tuple[int, int] | None = None, work_lost: bool = False) -> None:
    """Writes this process's :class:`StopRecord` where its launcher asked (nothing when it was
    not started by one). Never raises: a record is help for the launcher, not a need."""
    path = os.environ.get(STOP_RECORD_ENV)
    if not path:
        return
    with contextlib.suppress(OSError, ValueError):
        StopRecord(int(status), reason, tuple(unresponsive), position, work_lost).write(path)

