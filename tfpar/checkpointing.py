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

import math
import os
import shutil
from typing import Optional

import keras
import tensorflow as tf
from absl import logging

from tfpar import cluster


class EpochCheckpoint(keras.callbacks.Callback):
    """Saves training state at the end of every epoch and restores the latest one.

    Args:
        directory: Where checkpoints live (``--model_dir``).
        model: The model (built, compiled, optimizer built) whose state is saved.
        strategy: The strategy it was built under.
        max_to_keep: Number of checkpoints kept.
    """

    def __init__(self, directory: str, model: keras.Model, strategy: tf.distribute.Strategy,
                 max_to_keep: int = 2):
        super().__init__()
        self.directory = directory
        self._chief = cluster.is_chief(strategy)
        resolver = getattr(strategy, "cluster_resolver", None)
        self._write_dir = directory if self._chief else os.path.join(
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
        self._manager = tf.train.CheckpointManager(self._checkpoint, self._write_dir,
                                                   max_to_keep=max_to_keep)

    @property
    def latest(self) -> Optional[str]:
        """Path prefix of the latest complete checkpoint in ``directory``, if any."""
        return tf.train.latest_checkpoint(self.directory)

    def restore(self) -> int:
        """Restores the latest checkpoint of ``directory``; returns the epochs it had finished.

        Returns:
            The number of finished epochs (0 when there is no checkpoint).
        """
        latest = self.latest
        if latest is None:
            return 0
        self._checkpoint.restore(latest).assert_existing_objects_matched()
        return int(self.epochs_done.numpy())

    def on_epoch_end(self, epoch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            # A diverged epoch is never saved: the last finite epoch stays the resume point.
            logging.warning("Not saving epoch %d: its loss is %s.", epoch + 1, loss)
            return
        self.epochs_done.assign(epoch + 1)
        path = self._manager.save(checkpoint_number=epoch + 1)
        if self._chief:
            logging.info("Saved training state after epoch %d to %s", epoch + 1, path)
        else:
            shutil.rmtree(self._write_dir, ignore_errors=True)
