"""The saver Keras's ``BackupAndRestore`` saves and restores through under tfpar.

Keras's callback decides when to save; tfpar's fix of it
(:mod:`tfpar.compat.keras_fixes.backup_and_restore`, which wraps Keras's private methods)
hands every save, restore and removal to this module, so the fix stays a fix and the saving
lives with tfpar's savers.

**One save, one commit.** Keras rewrites its weights file in place and then its metadata file:
a kill inside the first leaves a torn weights file every restart fails on, one between them
resumes the old position on new weights. Each backup is saved as a new *generation*
(``generation-N.weights.h5`` and ``replica_copies/N/``) beside the last complete one, and
committed by renaming the metadata file, which names it, over the old one; older generations
are removed after, and the folder's position record (:mod:`tfpar.worker_contract`) is
committed right after the metadata. A kill at any moment resumes from a whole save: the new
one, or the one before. The chief writes; every other worker saves to a scratch folder it
deletes (saving may need every worker), and writes its replicas' own copies
(:func:`tfpar.replica_copies.write_files`).

**What ``save_weights`` leaves out** is recorded too: the step inside the epoch a mid-epoch
state resumes at and the epoch's metrics until then (with
:mod:`tfpar.compat.mid_epoch_resume`, a resumed ``fit`` continues at that step), the layers'
random generators' states (a resumed Dropout drew the masks of the run's first steps again),
and each replica's own copy of what replicas update apart (per-replica BatchNorm statistics).

**A restore reads a backup as its save wrote it.** The metadata lists the generation's
replicas' copies files and the SHA-256 of its weights file, which a restore holds them to: a
file that is missing, damaged or not the one written is refused in one line naming it
(:class:`~tfpar.errors.DamagedStateError`), as is a damaged metadata file. With
``double_checkpoint=True`` the generation before stays (named by the ``.bkp`` metadata) and is
resumed from when the newest weights file is damaged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from absl import logging

from tfpar import atomic_io
from tfpar import replica_copies
from tfpar import replica_copy_files
from tfpar import worker_contract
from tfpar.compat import mid_epoch_resume
from tfpar.errors import DamagedStateError

__all__ = ["FILES_KEY", "GENERATION_KEY", "METRICS_KEY", "REPLICA_COPIES_KEY", "SEEDS_KEY",
           "STEP_KEY", "WEIGHTS_DIGEST_KEY", "load", "remove", "resume_inside_epoch", "save",
           "writes_checkpoints"]


def writes_checkpoints(callback: Any) -> bool:
    """Whether this process writes the callback's files: the chief of a multi-worker strategy,
    and every single process."""
    strategy = getattr(callback.model, "distribute_strategy", None)
    return strategy is None or bool(strategy.extended.should_checkpoint)


_BACKUP_PATHS = ("backup_dir", "_weights_path", "_training_metadata_path",
                 "_prev_weights_path", "_prev_training_metadata_path")


# Keys tfpar adds to BackupAndRestore's training_metadata.json: the step inside the saved epoch
# the resumed run starts at, the epoch's metric values until then, the random generators'
# states (``save_weights`` leaves them out), the save's generation (its weights file and its
# replicas' own copies, :mod:`tfpar.replica_copies`) and, in saves of tfpar 0.3, the copies.
STEP_KEY, METRICS_KEY = "tfpar_next_step", "tfpar_metrics"
SEEDS_KEY, REPLICA_COPIES_KEY = "tfpar_seed_states", "tfpar_replica_copies"
GENERATION_KEY = worker_contract.BACKUP_GENERATION_KEY
# The list of the generation's replicas' copies files, which a restore holds them to
# (:attr:`tfpar.replica_copies.Written.files`; ``null``: none were written).
FILES_KEY = "tfpar_replica_copies_files"
# The SHA-256 of the generation's weights file, which a restore holds it to.
WEIGHTS_DIGEST_KEY = "tfpar_weights_sha256"
# Where a generation's files go in the backup folder.
_WEIGHTS_FILE, _COPIES_DIR = "generation-{}.weights.h5", "replica_copies"
_GENERATION_FILE = re.compile(r"^generation-(\d+)\.weights\.h5$")


def save(callback: Any, original: Callable, next_step: int) -> None:
    """One save as one commit: the chief writes the weights of a new generation beside the
    last one, every worker its replicas' own copies, and only then does the chief replace the
    metadata file, which names the generation, in one rename. A kill at any moment leaves the
    metadata naming a complete generation (the new one, or the one before) and its files."""
    committed = _read_metadata(callback._training_metadata_path).get(GENERATION_KEY, 0)
    generation = committed + 1  # Read by every worker before any of them can commit this one.
    copies = os.path.join(callback.backup_dir, _COPIES_DIR, str(generation))
    chief = writes_checkpoints(callback)
    if chief:  # What a save of this generation that never committed left.
        atomic_io.remove_tree(copies)
    # On every worker: a multi-worker strategy sums metric variables in a collective, and the
    # copies' fingerprints and write count are collectives.
    metrics = mid_epoch_resume.metric_values(callback.model)
    written = replica_copies.write_files(callback.model, copies)
    seeds = [np.asarray(keras.ops.convert_to_numpy(v)).tolist()
             for v in _seed_states(callback.model)]
    kept = {name: getattr(callback, name) for name in _BACKUP_PATHS}
    double = callback.double_checkpoint
    scratch = None if chief else tempfile.mkdtemp(prefix="tfpar-backup-")
    partial = f"{callback._training_metadata_path}.tfpar-partial"
    try:
        if chief:
            atomic_io.make_dirs(callback.backup_dir)
            callback._weights_path = os.path.join(callback.backup_dir,
                                                  _WEIGHTS_FILE.format(generation))
            callback._training_metadata_path = partial
            callback.double_checkpoint = False  # The generation before is kept instead.
        else:  # Saving may need every worker: the others save to a folder they delete.
            for name, path in kept.items():
                setattr(callback, name, path.replace(kept["backup_dir"], scratch, 1))
        # Keras writes its weights file and metadata file in place.
        with atomic_io.external_writes(scratch or callback.backup_dir, "keras",
                                       order=lambda name: int(not name.endswith(".h5"))):
            original(callback)
    finally:
        for name, path in kept.items():
            setattr(callback, name, path)
        callback.double_checkpoint = double
        if scratch is not None:
            atomic_io.remove_tree(scratch)
    if not chief:
        return
    metadata = _read_metadata(partial)
    metadata.update({STEP_KEY: next_step, METRICS_KEY: [v.tolist() for v in metrics],
                     SEEDS_KEY: seeds, GENERATION_KEY: generation, FILES_KEY: written.files,
                     WEIGHTS_DIGEST_KEY: _sha256(os.path.join(
                         callback.backup_dir, _WEIGHTS_FILE.format(generation)))})
    _commit(callback, partial, metadata, committed if double else None)


def _commit(callback: Any, partial: str, metadata: dict[str, Any], kept: int | None) -> None:
    """Commits the chief's save: its metadata (written to ``partial``) renamed over the last
    one, then the folder's position record; the generations other than the new one (and
    ``kept``, the one before, with ``double_checkpoint``) removed after."""
    atomic_io.write_text(partial, json.dumps(metadata))
    if kept:  # The generation before stays, named by the .bkp metadata.
        with open(callback._training_metadata_path, encoding="utf-8") as f:
            atomic_io.write_text(callback._prev_training_metadata_path, f.read())
    atomic_io.replace(partial, callback._training_metadata_path)  # The commit.
    worker_contract.commit_position(callback.backup_dir, _position(metadata))
    _remove_other_generations(callback.backup_dir, {metadata[GENERATION_KEY], kept or 0})


def _declare(callback: Any, metadata: dict[str, Any]) -> None:
    """The chief declares its backup folder to a launcher, whose position record says what it
    restored."""
    worker_contract.restored_position(callback.backup_dir, _position(metadata))
    worker_contract.declare(folder=callback.backup_dir)


def _position(metadata: dict[str, Any]) -> worker_contract.Position:
    """A backup's position, named by its generation (none: Keras's own backup, or none)."""
    generation = metadata.get(GENERATION_KEY)
    return worker_contract.Position(int(metadata.get("epoch", 0)), int(metadata.get(STEP_KEY, 0)),
                                    f"generation-{generation}" if generation is not None else "")


def _read_metadata(path: str) -> dict[str, Any]:
    """A metadata file's content; empty where there is none (or it is not Keras's)."""
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
    except (OSError, ValueError):
        return {}
    return metadata if isinstance(metadata, dict) else {}


def _remove_other_generations(backup_dir: str, keep: set[int]) -> None:
    """Removes the files of generations other than ``keep``, and Keras's own weights file."""
    with contextlib.suppress(OSError):
        for name in os.listdir(backup_dir):
            match = _GENERATION_FILE.match(name)
            if name == "latest.weights.h5" or (match and int(match.group(1)) not in keep):
                with contextlib.suppress(OSError):
                    atomic_io.remove(os.path.join(backup_dir, name))
    copies = os.path.join(backup_dir, _COPIES_DIR)
    with contextlib.suppress(OSError):
        for name in os.listdir(copies):
            if not name.isdigit() or int(name) not in keep:
                atomic_io.remove_tree(os.path.join(copies, name))


def _seed_states(model: keras.Model) -> list[keras.Variable]:
    """The model's variables that ``save_weights`` does not save: its layers' random
    generators' states (Dropout's masks follow them)."""
    saved = {id(v) for v in model.weights}
    return [v for v in model.non_trainable_variables if id(v) not in saved]


def _restore_state_beyond_weights(callback: Any, metadata: dict[str, Any]) -> None:
    model = callback.model
    seeds, saved = _seed_states(model), metadata.get(SEEDS_KEY, [])
    if len(saved) == len(seeds):  # In order, as Keras matches the weights.
        for variable, value in zip(seeds, saved):
            variable.assign(np.asarray(value, dtype=variable.dtype))
    elif saved:
        logging.warning("BackupAndRestore: %d random generator states were saved, the model has "
                        "%d; left as built.", len(saved), len(seeds))
    if GENERATION_KEY in metadata:
        folder = os.path.join(callback.backup_dir, _COPIES_DIR, str(metadata[GENERATION_KEY]))
        replica_copies.read(model, folder,
                            files=metadata.get(FILES_KEY, replica_copy_files.UNRECORDED))
    else:  # Saved by tfpar 0.3.
        replica_copies.scatter(model, replica_copy_files.decode_json(
            metadata.get(REPLICA_COPIES_KEY, {})))


def _committed_metadata(callback: Any) -> dict[str, Any]:
    """The committed metadata file's content (empty where there is none).

    Raises:
        DamagedStateError: If it is there but is not a JSON object (cut short, emptied).
    """
    path = callback._training_metadata_path
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
    except FileNotFoundError:
        _check_no_orphan_generation(callback)
        return {}
    except (OSError, ValueError) as e:
        raise _damaged(callback, path, "is not readable", f"{type(e).__name__}: {e}") from None
    if not isinstance(metadata, dict):
        raise _damaged(callback, path, "is not a backup's metadata",
                       f"JSON of type {type(metadata).__name__}")
    return metadata


def _check_no_orphan_generation(callback: Any) -> None:
    """Raises where the metadata file is missing beside a generation's weights that only a
    committed save leaves: generation N > 1 is written after the metadata named N - 1.

    Raises:
        DamagedStateError: Naming the metadata file.
    """
    later: list[str] = []
    with contextlib.suppress(OSError):
        later = sorted(name for name in os.listdir(callback.backup_dir)
                       if (match := _GENERATION_FILE.match(name)) and int(match[1]) > 1)
    if later:
        raise _damaged(callback, callback._training_metadata_path, "is missing, beside the "
                       f"weights of a committed save ({later[0]})", "no such file")


def _damaged(callback: Any, path: str, problem: str, received: str) -> DamagedStateError:
    return DamagedStateError(
        f"The backup's file {path} {problem}. A restore reads a backup as its save wrote it; "
        f"start over (remove the backup folder {callback.backup_dir}), or use another one. "
        f"Received: {received}.")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _load_generation(callback: Any, original: Callable, metadata: dict[str, Any]) -> Any:
    """Loads the weights of the generation ``metadata`` names, held to the digest it records.

    Raises:
        DamagedStateError: If the weights file is missing, not the one written, or not
            readable.
    """
    path = os.path.join(callback.backup_dir, _WEIGHTS_FILE.format(metadata[GENERATION_KEY]))
    names = f"that {callback._training_metadata_path} names"
    if not os.path.exists(path):
        raise _damaged(callback, path, f"{names} is missing", "no such file")
    saved = metadata.get(WEIGHTS_DIGEST_KEY)
    try:
        found = _sha256(path) if saved is not None else None
    except OSError as e:  # A folder where the file should be, or a file that cannot be read.
        raise _damaged(callback, path, "is not readable", f"{type(e).__name__}: {e}") from None
    if saved is not None and found != saved:
        raise _damaged(callback, path, f"{names} is not the one its save wrote (another "
                       "save's, or changed since)", f"a file of another SHA-256 than "
                       f"{saved[:16]}...")
    weights_path = callback._weights_path
    callback._weights_path = path
    try:
        return original(callback)
    except OSError as e:  # h5py's, for a file cut short or emptied.
        raise _damaged(callback, path, "is not readable", f"{type(e).__name__}: {e}") from None
    finally:
        callback._weights_path = weights_path


def remove(callback: Any) -> None:
    """Removes the backup at the end of training (where Keras's ``delete_checkpoint`` asks it,
    on the chief): whole or not at all, as a rerun reads it."""
    backup_dir = str(callback.backup_dir)
    if callback.delete_checkpoint and "://" not in backup_dir and os.path.isdir(backup_dir):
        # Keras's rmtree removes the files one by one: a kill inside it left the metadata
        # without its weights (or the weights without it), a backup every rerun refused.
        # Renamed aside in one step first, the backup is whole or gone.
        aside = f"{backup_dir.rstrip(os.sep)}.tfpar-removed"
        atomic_io.remove_tree(aside)  # What a kill inside an earlier removal left.
        atomic_io.replace(backup_dir, aside)
        atomic_io.remove_tree(aside)


def load(callback: Any, original: Callable) -> Any:
    """Restores the committed backup (Keras's ``_load_model``, ``original``, loads the weights
    of its generation) and what ``save_weights`` leaves out; the chief declares the folder.

    Raises:
        DamagedStateError: If a file of the backup is missing, damaged or not the one written
            (and no generation before it was kept).
    """
    metadata = _committed_metadata(callback)
    if GENERATION_KEY not in metadata:  # Keras's own save, or none.
        loaded = original(callback)
        if metadata:
            _restore_state_beyond_weights(callback, metadata)
        if writes_checkpoints(callback):
            _declare(callback, metadata)
        return loaded
    try:
        loaded = _load_generation(callback, original, metadata)
    except DamagedStateError:
        # A damaged weights file: the generation before, where double_checkpoint kept it.
        before = _read_metadata(callback._prev_training_metadata_path)
        if GENERATION_KEY not in before:
            raise
        logging.warning("BackupAndRestore: the weights of generation %s are not readable; "
                        "resuming from the save before it.", metadata[GENERATION_KEY])
        atomic_io.replace(callback._prev_training_metadata_path,
                          callback._training_metadata_path)
        metadata = before
        loaded = _load_generation(callback, original, metadata)
    _restore_state_beyond_weights(callback, metadata)
    if writes_checkpoints(callback):
        _declare(callback, metadata)
    return loaded


def resume_inside_epoch(callback: keras.callbacks.BackupAndRestore, epoch: int) -> None:
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
