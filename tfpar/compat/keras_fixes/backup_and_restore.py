"""Fix: ``BackupAndRestore`` across workers, and the epoch and step it records.

**``BackupAndRestore`` across workers** (its ``_save_model``, ``on_train_end``,
``on_epoch_begin``). Every worker wrote the same backup file (h5py's "unable to lock file"
at the first save on one machine) and deleted the folder at the end. The fix lets the
chief (``strategy.extended.should_checkpoint``) write and delete, and has every other
worker save to a scratch folder it deletes (saving may need every worker). With an integer
``save_freq`` Keras also recorded the wrong epoch: a state saved after an epoch's last batch
as that epoch (resumed, it ran the epoch again), and every save after a resume counted the
epochs from 0; the fix records the epochs finished. It also records the step inside the
epoch a mid-epoch state resumes at, and the epoch's metrics until then (Keras saves the
batch but never reads it): with :mod:`tfpar.compat.mid_epoch_resume`, a resumed ``fit``
continues at that step. Last, ``save_weights`` leaves out two kinds of state a resume needs:
the layers' random generators' states (a resumed Dropout drew the masks of the run's first
steps again) and each replica's own copy of what replicas update apart (per-replica BatchNorm
statistics, of which the weights file holds the first replica's): the saver records the
generators' states in the metadata file, has each worker write its replicas' copies, and
restores both after Keras loads the weights.

**The saving is a saver's.** Each wrapper here decides what Keras got wrong and hands the
save, the restore and the removal to the saver it was given (:func:`use_saver`; tfpar's
strategies give :mod:`tfpar.backup_saver`, which saves each backup as a generation committed in
one rename, records what ``save_weights`` leaves out, and refuses a damaged backup in one line).
The fix imports no saver: the workaround package stays below the savers.

Upstream: none found. Checked on Keras 3.15.1; the wrapped code is the same from 3.0 to 3.15.
Fails without it: ``tests/compat/keras_fixes_test.py`` (``BackupAndRestoreTest``:
``test_the_epochs_finished_are_recorded``,
``test_a_worker_that_is_not_the_chief_leaves_the_backup_alone``) and
``tests/end_to_end/exactness_test.py`` (the ``backup_and_restore_kill`` cells of the models
with BatchNorm and Dropout, and ``TornBackupTest``, a kill inside each window of a save).
Keras 3.16: still needed (the test above fails on the preview 3.16.0.dev2026102704 without
the fix).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from typing import Protocol

import keras

from tfpar.compat.keras_fixes.fix import Fix

__all__ = ["FIXES", "BackupSaver", "has_saver", "use_saver"]


class BackupSaver(Protocol):
    """What the fix hands a ``BackupAndRestore``'s saving to (:mod:`tfpar.backup_saver`)."""

    def writes_checkpoints(self, callback: Any) -> bool:
        """Whether this process writes the callback's files (the chief, or a lone process)."""

    def save(self, callback: Any, original: Callable, next_step: int) -> None:
        """Saves the state through Keras's ``_save_model`` (``original``), to resume at step
        ``next_step`` of the callback's current epoch."""

    def load(self, callback: Any, original: Callable) -> Any:
        """Restores the committed state through Keras's ``_load_model`` (``original``)."""

    def remove(self, callback: Any) -> None:
        """Removes the backup at the end of training, where the callback asks it."""

    def resume_inside_epoch(self, callback: Any, epoch: int) -> None:
        """Starts ``epoch`` at the step its restored state was saved at."""


_saver: list[BackupSaver] = []


def use_saver(saver: BackupSaver) -> None:
    """Gives the fix the saver its wrappers hand saving to (the last given is used)."""
    _saver[:] = [saver]


def has_saver() -> bool:
    """Whether a saver was given (the fixes are installed only then)."""
    return bool(_saver)


def _the_saver() -> BackupSaver:
    if not _saver:  # install() leaves the fixes out without one.
        raise RuntimeError("tfpar's BackupAndRestore fix runs without a saver.")
    return _saver[0]


def _wrap_backup_save(original: Callable) -> Callable:
    @functools.wraps(original)
    def _save_model(self):
        steps = (self.params or {}).get("steps")
        after_last_batch = (self.save_freq != "epoch" and steps
                            and self._last_batch_seen + 1 == steps)
        epoch, batch = self._current_epoch, self._last_batch_seen
        if after_last_batch:  # The state at the epoch's end: the next epoch starts from it.
            self._current_epoch, self._last_batch_seen = epoch + 1, 0
        # Where the resumed run starts inside its epoch (0: at its start).
        next_step = 0 if self.save_freq == "epoch" or after_last_batch else batch + 1
        try:
            _the_saver().save(self, original, next_step)
        finally:
            self._current_epoch, self._last_batch_seen = epoch, batch

    return _save_model


def _wrap_backup_train_end(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_train_end(self, logs=None):
        saver = _the_saver()
        if not saver.writes_checkpoints(self):  # Only the chief deletes the backup.
            return None
        saver.remove(self)
        return original(self, logs)

    return on_train_end


def _wrap_backup_load(original: Callable) -> Callable:
    @functools.wraps(original)
    def _load_model(self):
        return _the_saver().load(self, original)

    return _load_model


def _wrap_backup_epoch_begin(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch  # The epochs finished, after a resume too.
        if not getattr(self, "_tfpar_began", False):  # The first epoch of this fit.
            self._tfpar_began = True
            _the_saver().resume_inside_epoch(self, epoch)
        return original(self, epoch, logs)

    return on_epoch_begin


FIXES = (
    Fix("backup_chief_writes", "BackupAndRestore: the chief writes the backup, other workers "
        "a scratch folder; a state saved after an epoch's last batch resumes at the next",
        lambda: keras.callbacks.BackupAndRestore, "_save_model", _wrap_backup_save,
        parameters=("self",)),
    Fix("backup_chief_deletes", "BackupAndRestore: only the chief deletes the backup at the end",
        lambda: keras.callbacks.BackupAndRestore, "on_train_end", _wrap_backup_train_end,
        parameters=("self", "logs")),
    Fix("backup_state_beyond_weights", "BackupAndRestore: the random generators' states "
        "(Dropout's masks) and each replica's own BatchNorm statistics are restored too",
        lambda: keras.callbacks.BackupAndRestore, "_load_model", _wrap_backup_load,
        parameters=("self",)),
    Fix("backup_epoch_count", "BackupAndRestore: saves after a resume record the epochs "
        "finished, not those since the resume",
        lambda: keras.callbacks.BackupAndRestore, "on_epoch_begin", _wrap_backup_epoch_begin,
        parameters=("self", "epoch", "logs")),
)
