"""tfpar's fixes for defects of Keras 3 under ``tf.distribute``, one module each, and their
registry: installed by every tfpar strategy of several replicas
(:class:`tfpar.strategies.base.TfparStrategy`), and those of ``BackupAndRestore`` by every tfpar
strategy (:data:`BACKUP_AND_RESTORE`: a backup folder tfpar wrote is read the same way on one
device).

- :mod:`.symbolic_build`: ``fit``/``evaluate`` build a model from one replica's shard, not a
  cross-replica mean (uneven first batches under ``mirrored``; every ``multi_worker`` run).
- :mod:`.scalar_logs`: scalar logs of several workers reduced with ``axis=None``, in one
  collective; logs that are global already (:class:`.scalar_logs.ReportsGlobalValues`) left.
- :mod:`.multi_step_functions`: several steps per compiled call across workers.
- :mod:`.run_time_refusals`: a refusal asserted inside the compiled step is raised as one line.
- :mod:`.central_storage_metrics`: metric variables under ``central_storage`` add increments.
- :mod:`.scaled_losses`: a model's own ``train_step``/``test_step`` logs the whole loss.
- :mod:`.backup_and_restore`: ``BackupAndRestore`` across workers, with the right epoch and
  step recorded.
- :mod:`tfpar.compat.mid_epoch_resume`: ``fit`` starts a resumed epoch at its step.

:mod:`.fix` says what a fix is. Each fix module names its upstream issue, the Keras versions it
was checked on and the test that fails without it; each wraps one private attribute of Keras
(no public API serves, see :mod:`.fix`) and calls Keras's own code wherever its defect is not.

They are applied only on the Keras versions they were verified against (:data:`VERIFIED_KERAS`,
and the preview of the next release CI runs, :data:`tfpar.compat.versions.PREVIEWS`); on others
tfpar warns once and leaves Keras alone, and ``tfpar-env`` says so. ``TFPAR_KERAS_FIXES=force``
applies them anyway (to check a new Keras release, see DEVELOPERS.md), ``=off`` never. Each fix
finds its target by what it needs (:mod:`.fix`); one whose target is missing or changed is not
installed, and says so in one line naming the fix, its upstream issue, the releases it was read
against and this Keras (no traceback); the others are installed. """

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import keras
from absl import logging

from tfpar.compat import mid_epoch_resume
from tfpar.compat import versions
from tfpar.compat.keras_fixes import backup_and_restore
from tfpar.compat.keras_fixes import central_storage_metrics
from tfpar.compat.keras_fixes import multi_step_functions
from tfpar.compat.keras_fixes import run_time_refusals
from tfpar.compat.keras_fixes import scalar_logs
from tfpar.compat.keras_fixes import scaled_losses
from tfpar.compat.keras_fixes import symbolic_build
from tfpar.compat.keras_fixes.fix import Fix
from tfpar.compat.keras_fixes.fix import FixUnavailable
from tfpar.compat.keras_fixes.scalar_logs import ReportsGlobalValues

__all__ = ["BACKUP_AND_RESTORE", "FIXES", "Fix", "FixUnavailable", "MODE_ENV",
           "ReportsGlobalValues", "VERIFIED_KERAS", "install", "installed", "skip_reason",
           "status", "unavailable", "unavailable_line", "uninstall", "use_backup_saver"]

# The Keras versions the fixes were verified against (the defective code is unchanged from 3.0
# to 3.15), and the switch: shared with every Keras workaround (tfpar.compat.versions).
VERIFIED_KERAS = versions.VERIFIED_KERAS
MODE_ENV = versions.KERAS_MODE_ENV


def _epoch_iterator() -> Any:
    """Keras's epoch iterator class (see :mod:`tfpar.compat.mid_epoch_resume`)."""
    return importlib.import_module("keras.src.trainers.epoch_iterator").EpochIterator


FIXES: tuple[Fix, ...] = (
    *symbolic_build.FIXES, *scalar_logs.FIXES, *multi_step_functions.FIXES,
    *central_storage_metrics.FIXES, *scaled_losses.FIXES, *backup_and_restore.FIXES,
    *run_time_refusals.FIXES,
    # Declared here: mid_epoch_resume is also read by tfpar's checkpoints, below this package.
    Fix("mid_epoch_start", "fit starts a resumed epoch at the step its state was saved at "
        "(EpochCheckpoint, BackupAndRestore(save_freq=N)), the batches before it drawn, not "
        "trained on", _epoch_iterator, "_enumerate_iterator",
        mid_epoch_resume.wrap_enumerate_iterator, parameters=("self",)),
)
"""Every fix, in the order they are installed."""

use_backup_saver = backup_and_restore.use_saver
"""Gives ``BackupAndRestore``'s fixes the saver they hand saving to
(:func:`.backup_and_restore.use_saver`)."""

BACKUP_AND_RESTORE: tuple[str, ...] = (*(fix.name for fix in backup_and_restore.FIXES),
                                       "mid_epoch_start")
"""The fixes ``BackupAndRestore`` needs on any number of replicas: its save (a generation
committed in one rename), load, epoch count and resume inside an epoch."""

_originals: dict[str, Callable] = {}
_skipped: list[str] = []  # Why the fixes were not applied, once known.
_said_unavailable: set[str] = set()  # Fixes whose missing target was said.


def skip_reason() -> str | None:
    """Why the fixes would not be applied on this Keras at all (``None``: they would, each
    whose target is there; see :func:`unavailable`)."""
    return versions.keras_skip_reason(keras.version())


def _named(name: str) -> Fix:
    for fix in FIXES:
        if fix.name == name:
            return fix
    raise KeyError(name)


def unavailable(name: str) -> str | None:
    """Why the fix ``name`` would not be applied on this Keras (``None``: it would)."""
    return skip_reason() or _named(name).unavailable()


def unavailable_line(fix: Fix, reason: str) -> str:
    """The one line for a fix that cannot be installed."""
    return (f"tfpar's fix {fix.name!r} ({fix.description}) is not applied: {reason}. Upstream: "
            f"{fix.upstream}; read against Keras {fix.read_against}; this is Keras "
            f"{keras.version()}.")


def install(names: tuple[str, ...] | None = None) -> None:
    """Installs the fixes (all, or those named), once; idempotent.

    On a Keras they were not verified against, warns once and installs nothing. A fix whose
    target is missing or changed is left out with one warning line; the others are installed.
    ``BackupAndRestore``'s are installed once a saver was given (:data:`use_backup_saver`;
    tfpar's strategies give it), else left out with one warning line each.
    """
    reason = skip_reason()
    if reason:
        if not _skipped:
            _skipped.append(reason)
            logging.warning("tfpar's fixes for Keras fit under tf.distribute are not applied: "
                            "%s. Uneven batches under 'mirrored' and fit under multi_worker may "
                            "fail.", reason)
        return
    backup_fixes = {fix.name for fix in backup_and_restore.FIXES}
    for fix in FIXES:
        if (names is None or fix.name in names) and fix.name not in _originals:
            if fix.name in backup_fixes and not backup_and_restore.has_saver():
                if fix.name not in _said_unavailable:
                    _said_unavailable.add(fix.name)
                    logging.warning("%s", unavailable_line(
                        fix, "no saver was given to hand its saving to (tfpar's strategies "
                        "give tfpar.backup_saver: keras_fixes.use_backup_saver)"))
                continue
            try:
                owner, original = fix.target()
            except FixUnavailable as e:
                if fix.name not in _said_unavailable:
                    _said_unavailable.add(fix.name)
                    logging.warning("%s", unavailable_line(fix, str(e)))
                continue
            _originals[fix.name] = original
            setattr(owner, fix.attribute, fix.wrap(original))


def uninstall(names: tuple[str, ...] | None = None) -> None:
    """Restores Keras's own code (all, or the fixes named): for tests that show the defects."""
    named = [fix for fix in FIXES
             if (names is None or fix.name in names) and fix.name in _originals]
    # Two fixes may wrap one attribute: the others on a named fix's attribute are taken off
    # with it (last installed, first) and put back after.
    stacked = [fix for fix in FIXES if fix.name in _originals and fix not in named
               and any(fix.attribute == other.attribute
                       and fix.target()[0] is other.target()[0] for other in named)]
    for fix in reversed(FIXES):
        if fix in named or fix in stacked:
            owner, _ = fix.target()
            setattr(owner, fix.attribute, _originals.pop(fix.name))
    if stacked:
        install(tuple(fix.name for fix in stacked))


def installed() -> bool:
    """Returns whether every fix is installed."""
    return all(fix.name in _originals for fix in FIXES)


def status() -> dict[str, Any]:
    """What ``tfpar-env`` reports: Keras's version, the verified range, whether the fixes
    apply, each fix."""
    reason = skip_reason()
    return {"keras": keras.version(),
            "verified_with_keras": versions.keras_range_text(),
            "applied": (f"no: {reason}" if reason else
                        "yes, by every tfpar strategy of several replicas"),
            "fixes": {f.name: f.description for f in FIXES},
            "active": {f.name: (f"no: {why}" if (why := reason or f.unavailable()) else "yes")
                       for f in FIXES}}
