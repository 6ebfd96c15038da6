"""Epoch checkpoints for kill-and-resume, with ``tf.train.CheckpointManager``.

After every epoch the model's weights, the optimizer's state and the number of finished
epochs are saved. TensorFlow writes each checkpoint's files first and then replaces the small
``checkpoint`` index file atomically, so a run killed at any moment leaves the previous
complete checkpoint as the latest one. In multi-worker training every worker takes part in
saving (it may run collective ops), but only the chief writes to ``directory``; the others
write to a scratch folder they delete.

It is a Keras callback, so resuming behaves the same under every strategy.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from tfpar import atomic_io
from tfpar.cluster import spec as cluster_spec
from tfpar.errors import ConfigError
from tfpar.errors import StateNotSavedError


@contextlib.contextmanager
def _readable_index(directory: str) -> Iterator[None]:
    """Turns TensorFlow's failures to parse a damaged checkpoint index into one clear error."""
    try:
        yield
    except (UnicodeDecodeError, ValueError, tf.errors.OpError) as e:
        raise ConfigError(
            f"The checkpoint index {os.path.join(directory, 'checkpoint')} is not readable "
            f"({type(e).__name__}). Start over (resume=False), or use another model_dir."
        ) from None


class EpochCheckpoint(keras.callbacks.Callback):
    """Saves training state at the end of every epoch and restores the latest one.

    Args:
        directory: Where checkpoints live (``--model_dir``).
        model: The model (built, compiled, optimizer built) whose state is saved.
        strategy: The strategy it was built under.
        max_to_keep: Number of checkpoints kept.
        made_with: What the state is made with (model, dataset, optimizer, ...), saved beside
            it as ``made_with.json``: a restore into a run made with something else is refused
            with the difference, instead of a shape error or a silent resume.
    """

    MADE_WITH_FILE = "made_with.json"
    # Every saved epoch's logs (loss, metrics, test accuracy), so that a resumed run reports
    # the whole training, each epoch once. Written before the epoch's checkpoint: a kill in
    # between leaves it one epoch ahead, and a restore keeps the epochs the checkpoint has.
    HISTORY_FILE = "history.json"

    def __init__(self, directory: str, model: keras.Model, strategy: tf.distribute.Strategy,
                 max_to_keep: int = 2, made_with: dict[str, Any] | None = None):
        super().__init__()
        self.directory = directory
        self.made_with = json.loads(json.dumps(made_with or {}))  # As it reads back.
        self._made_with_written = False
        #: Per log, its value at every saved epoch from the first (restored, then extended).
        self.history: dict[str, list[float]] = {}
        self._chief = cluster_spec.is_chief(strategy)
        resolver = getattr(strategy, "cluster_resolver", None)
        # Only a worker of a multi-worker job is not the chief: it has a cluster resolver.
        self._write_dir = directory if self._chief or resolver is None else os.path.join(
            directory, f".worker_{resolver.task_type}_{resolver.task_id}")
        with strategy.scope():
            self.epochs_done = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="epochs_done")
            # The optimizer's slots must exist before a restore can fill them. Building twice
            # would replace the slots on optimizers that do not guard against it.
            if not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
        # Keras 3 models expose no checkpoint dependencies of their own; their variables
        # (BatchNorm statistics too) are tracked as a list.
        self._checkpoint = tf.train.Checkpoint(model_variables=list(model.variables),
                                               optimizer=model.optimizer,
                                               epochs_done=self.epochs_done)
        with _readable_index(self._write_dir):
            self._manager = tf.train.CheckpointManager(self._checkpoint, self._write_dir,
                                                       max_to_keep=max_to_keep)

    @property
    def latest(self) -> str | None:
        """Path prefix of the latest complete checkpoint in ``directory``, if any.

        Raises:
            ConfigError: If the checkpoint index file is unreadable.
        """
        with _readable_index(self.directory):
            return tf.train.latest_checkpoint(self.directory)

    def _check_made_with(self) -> None:
        path = os.path.join(self.directory, self.MADE_WITH_FILE)
        if not self.made_with or not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        differ = [f"{key}={saved.get(key)!r} (now {value!r})"
                  for key, value in self.made_with.items() if saved.get(key) != value]
        if differ:
            raise ConfigError(f"The training state in {self.directory} was made with "
                              f"{', '.join(differ)}. Start over (resume=False), or use another "
                              "model_dir.")

    def restore(self) -> int:
        """Restores the latest checkpoint of ``directory``; returns the epochs it had finished.

        Returns:
            The number of finished epochs (0 when there is no checkpoint).

        Raises:
            ConfigError: If the state was made with something else (see ``made_with``) or
                the index is unreadable.
        """
        latest = self.latest
        if latest is None:
            return 0
        self._check_made_with()
        self._checkpoint.restore(latest).assert_existing_objects_matched()
        epochs = int(self.epochs_done.numpy())
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.directory, self.HISTORY_FILE), encoding="utf-8") as f:
                self.history = {name: values[:epochs] for name, values in json.load(f).items()}
        return epochs

    def _save(self, epoch: int) -> str:
        """Writes the history (chief) and the checkpoint of ``epoch``; returns its path."""
        if self._chief:
            os.makedirs(self.directory, exist_ok=True)
            atomic_io.write_json(os.path.join(self.directory, self.HISTORY_FILE), self.history)
        self.epochs_done.assign(epoch + 1)
        path = self._manager.save(checkpoint_number=epoch + 1)
        if self._chief and self.made_with and not self._made_with_written:
            atomic_io.write_json(os.path.join(self.directory, self.MADE_WITH_FILE),
                                 self.made_with)
            self._made_with_written = True
        return path

    def _remove_partial_saves(self) -> None:
        """Removes what a failed save left: TensorFlow's ``<prefix>_temp`` folders."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self._write_dir):
                if name.endswith("_temp"):
                    shutil.rmtree(os.path.join(self._write_dir, name), ignore_errors=True)

    def on_epoch_end(self, epoch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            # A diverged epoch is never saved: the last finite epoch stays the resume point.
            logging.warning("Not saving epoch %d: its loss is %s.", epoch + 1, loss)
            return
        for name, value in (logs or {}).items():
            with contextlib.suppress(TypeError, ValueError):
                self.history.setdefault(name, []).append(float(value))
        try:
            path = self._save(epoch)
        except (OSError, tf.errors.OpError) as e:
            self._remove_partial_saves()
            reason = e.strerror if isinstance(e, OSError) else re.sub(
                r"\s*\[Op:\w+\]$", "", e.message.rsplit(";", 1)[-1])
            last = self._manager.latest_checkpoint
            resume = (f"the state of epoch {last.rsplit('-', 1)[-1]} is intact"
                      if last else "no epoch was saved before")
            raise StateNotSavedError(
                f"Could not save the training state of epoch {epoch + 1} in {self._write_dir} "
                f"({(reason or type(e).__name__).strip()}); {resume}. Free space there (or "
                "make it writable) and run again to resume.") from None
        if self._chief:
            logging.info("Saved training state after epoch %d to %s", epoch + 1, path)
        else:
            shutil.rmtree(self._write_dir, ignore_errors=True)
