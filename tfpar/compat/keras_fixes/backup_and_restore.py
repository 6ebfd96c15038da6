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
statistics, of which the weights file holds the first replica's): the fix records both in the
metadata file and restores them after Keras loads the weights.

Upstream: none found. Checked on Keras 3.15.1; the wrapped code is the same from 3.0 to 3.15.
Fails without it: ``tests/compat/keras_fixes_test.py`` (``BackupAndRestoreTest``:
``test_the_epochs_finished_are_recorded``,
``test_a_worker_that_is_not_the_chief_leaves_the_backup_alone``) and
``tests/end_to_end/exactness_test.py`` (the ``backup_and_restore_kill`` cells of the models
with BatchNorm and Dropout).
Keras 3.16: still needed (the test above fails on the preview 3.16.0.dev2026102704 without
the fix).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from absl import logging

from tfpar import replica_copies
from tfpar.compat import mid_epoch_resume
from tfpar.compat.keras_fixes.fix import Fix


def _writes_checkpoints(callback: Any) -> bool:
    """Whether this process writes the callback's files: the chief of a multi-worker strategy,
    and every single process."""
    strategy = getattr(callback.model, "distribute_strategy", None)
    return strategy is None or bool(strategy.extended.should_checkpoint)


_BACKUP_PATHS = ("backup_dir", "_weights_path", "_training_metadata_path",
                 "_prev_weights_path", "_prev_training_metadata_path")


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
        # Read on every worker: a multi-worker strategy sums metric variables in a collective,
        # and gathers the replicas' own copies in one.
        metrics = mid_epoch_resume.metric_values(self.model)
        state = _state_beyond_weights(self.model)
        try:
            if _writes_checkpoints(self):
                saved = original(self)
                _record_step(self._training_metadata_path, next_step, metrics, state)
                return saved
            scratch = tempfile.mkdtemp(prefix="tfpar-backup-")
            kept = {name: getattr(self, name) for name in _BACKUP_PATHS}
            try:
                for name, path in kept.items():
                    setattr(self, name, path.replace(kept["backup_dir"], scratch, 1))
                return original(self)
            finally:
                for name, path in kept.items():
                    setattr(self, name, path)
                shutil.rmtree(scratch, ignore_errors=True)
        finally:
            self._current_epoch, self._last_batch_seen = epoch, batch

    return _save_model


# Keys tfpar adds to BackupAndRestore's training_metadata.json: the step inside the saved epoch
# the resumed run starts at, the epoch's metric values until then, the random generators'
# states (``save_weights`` leaves them out) and the replicas' own copies of what they update
# apart (:mod:`tfpar.replica_copies`).
STEP_KEY, METRICS_KEY = "tfpar_next_step", "tfpar_metrics"
SEEDS_KEY, REPLICA_COPIES_KEY = "tfpar_seed_states", "tfpar_replica_copies"


def _seed_states(model: keras.Model) -> list[keras.Variable]:
    """The model's variables that ``save_weights`` does not save: its layers' random
    generators' states (Dropout's masks follow them)."""
    saved = {id(v) for v in model.weights}
    return [v for v in model.non_trainable_variables if id(v) not in saved]


def _state_beyond_weights(model: keras.Model) -> dict[str, Any]:
    """What a resume needs besides ``save_weights``'s file, as JSON-ready data."""
    copies = replica_copies.gather(model)
    return {SEEDS_KEY: [np.asarray(keras.ops.convert_to_numpy(v)).tolist()
                        for v in _seed_states(model)],
            REPLICA_COPIES_KEY: replica_copies.encode(copies)}


def _restore_state_beyond_weights(model: keras.Model, metadata: dict[str, Any]) -> None:
    seeds, saved = _seed_states(model), metadata.get(SEEDS_KEY, [])
    if len(saved) == len(seeds):  # In order, as Keras matches the weights.
        for variable, value in zip(seeds, saved):
            variable.assign(np.asarray(value, dtype=variable.dtype))
    elif saved:
        logging.warning("BackupAndRestore: %d random generator states were saved, the model has "
                        "%d; left as built.", len(saved), len(seeds))
    replica_copies.scatter(model, replica_copies.decode(metadata.get(REPLICA_COPIES_KEY, {})))


def _record_step(metadata_path: str, next_step: int, metrics: list[np.ndarray],
                 state: dict[str, Any]) -> None:
    """Adds the step, the metrics and the state beyond the weights to Keras's metadata file,
    replaced as a whole."""
    with open(metadata_path, encoding="utf-8") as f:
        metadata = json.load(f)
    metadata[STEP_KEY] = next_step
    metadata[METRICS_KEY] = [v.tolist() for v in metrics]
    metadata.update(state)
    partial = f"{metadata_path}.tfpar-partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(metadata, f)
    os.replace(partial, metadata_path)


def _wrap_backup_train_end(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_train_end(self, logs=None):
        if _writes_checkpoints(self):
            return original(self, logs)
        return None

    return on_train_end


def _wrap_backup_load(original: Callable) -> Callable:
    @functools.wraps(original)
    def _load_model(self):
        loaded = original(self)
        try:
            with open(self._training_metadata_path, encoding="utf-8") as f:
                metadata = json.load(f)
        except (OSError, ValueError):
            return loaded
        _restore_state_beyond_weights(self.model, metadata)
        return loaded

    return _load_model


def _wrap_backup_epoch_begin(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch  # The epochs finished, after a resume too.
        if not getattr(self, "_tfpar_began", False):  # The first epoch of this fit.
            self._tfpar_began = True
            _resume_inside_epoch(self, epoch)
        return original(self, epoch, logs)

    return on_epoch_begin


def _resume_inside_epoch(callback: keras.callbacks.BackupAndRestore, epoch: int) -> None:
    """Starts ``epoch`` at the step the restored backup was saved at, with its metrics."""
    try:
        with open(callback._training_metadata_path, encoding="utf-8") as f:
            metadata = json.load(f)
    except (OSError, ValueError):
        return
    step = metadata.get(STEP_KEY, 0)
    if metadata.get("epoch") != epoch or not step:
        return
    mid_epoch_resume.start_next_epoch_at(step)
    callback._last_batch_seen = step - 1
    mid_epoch_resume.assign_metric_values(
        callback.model, [np.asarray(v) for v in metadata.get(METRICS_KEY, [])])
    logging.info("BackupAndRestore: epoch %d resumes at step %d.", epoch + 1, step)


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
