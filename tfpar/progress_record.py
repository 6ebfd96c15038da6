"""The progress record: where a launched job's chief resumed, and what it saved since.

Written by the savers (:class:`tfpar.callbacks.EpochCheckpoint`, and ``BackupAndRestore``
through :mod:`tfpar.compat.keras_fixes`) as they restore and after each save, at the path the
launcher gives in :data:`PROGRESS_RECORD_ENV`; read by the launcher, which so learns a job's
progress from the worker that made it, never by guessing its folders. Part of the launcher's
protocol (:mod:`tfpar.cluster.protocol`), kept here so that savers below the cluster package
can write it. No TensorFlow here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

from tfpar import atomic_io

PROGRESS_RECORD_ENV = "TFPAR_PROGRESS_RECORD"
"""Where the chief writes its :class:`ProgressRecord` as it restores and saves."""

@dataclasses.dataclass(frozen=True)
class ProgressRecord:
    """Where a job's chief resumed, and the last position it saved since.

    Attributes:
        restored: The position it resumed from (``(0, 0)``: from scratch), or ``None`` where
            it saved without restoring first.
        saved: The last position it saved since (``None``: none yet).
        folder: Where that state is.
    """

    restored: tuple[int, int] | None = None
    saved: tuple[int, int] | None = None
    folder: str = ""

    @property
    def latest(self) -> tuple[int, int] | None:
        """The furthest position the state holds: the last saved, else the one resumed from."""
        return self.saved if self.saved is not None else self.restored

    @classmethod
    def read(cls, path: str) -> ProgressRecord | None:
        """The record at ``path``; ``None`` where there is none or it is not one."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict):
                return None
            restored, saved = data.get("restored"), data.get("saved")
            return cls(restored=(int(restored[0]), int(restored[1])) if restored else None,
                       saved=(int(saved[0]), int(saved[1])) if saved else None,
                       folder=str(data.get("folder", "")))
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None


def record_progress(folder: str, restored: tuple[int, int] | None = None,
                    saved: tuple[int, int] | None = None) -> None:
    """Records, where a launcher asked, that this process (the chief) resumed from
    ``restored`` or saved ``saved`` in ``folder``. A restore starts the record afresh; a save
    keeps the position resumed from. Never raises: the record is help for the launcher."""
    path = os.environ.get(PROGRESS_RECORD_ENV)
    if not path:
        return
    if restored is None:
        previous = ProgressRecord.read(path)
        restored = previous.restored if previous is not None else None
    with contextlib.suppress(OSError, ValueError):
        atomic_io.write_text(path, json.dumps(dataclasses.asdict(
            ProgressRecord(restored, saved, os.path.abspath(folder)))))
