"""Ray Train: reporting a tfpar job's epochs to Ray, and resuming from Ray's latest checkpoint.

Ray Train's ``TensorflowTrainer`` starts the workers and sets ``TF_CONFIG`` in each; a
``train_loop_per_worker`` that calls ``tfpar.strategies.get("multi_worker")`` (or
``"multi_worker_allreduce"``) and plain ``model.fit`` trains there as it does under tfpar's
launcher, where plain ``tf.distribute.MultiWorkerMirroredStrategy`` fails under Keras 3
(keras-team/keras#20585).

Ray's own Keras callback, ``ray.train.tensorflow.keras.ReportCheckpointCallback``, works under
tfpar's entries (the logs it reports are the whole job's), but leaves two things undone that a
job Ray restarts needs, which :class:`ReportCheckpointCallback` here does:

- its checkpoint is a ``model.keras`` file without the epoch it was taken at, so a restarted
  worker group cannot tell ``fit`` where to resume; here a checkpoint holds the model's
  variables, the optimizer's state and the number of finished epochs
  (:class:`tfpar.callbacks.EpochCheckpoint`), and :meth:`ReportCheckpointCallback.restore`
  puts them back and returns the epoch to resume from;
- every worker saves and reports a copy of the same state; here the chief reports it, the
  others report the metrics alone (Ray asks every worker to report the same number of times).

Install with ``pip install "tfpar[ray]"``.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from typing import Any

import keras
import tensorflow as tf

from tfpar.callbacks.checkpointing import EpochCheckpoint
from tfpar.cluster import spec as cluster_spec

try:
    import ray.train
except ImportError:  # Said in one line; the example turns it into its exit message.
    raise ImportError("tfpar.ray needs Ray Train, which is not installed: pip install "
                      "\"tfpar[ray]\" (or pip install -e \".[ray]\" in a checkout).") from None

CHECKPOINT_PREFIX = "epoch_"
""": The prefix of the checkpoint folders reported to Ray (``epoch_000003``: after 3 epochs)."""


class ReportCheckpointCallback(keras.callbacks.Callback):
    """Reports each epoch's logs to Ray Train, with a checkpoint to resume from.

    Build it after the model is compiled, call :meth:`restore` and give ``fit`` the epoch it
    returns::

        report = tfpar.ray.ReportCheckpointCallback(model, strategy)
        model.fit(data, epochs=10, initial_epoch=report.restore(), callbacks=[report])

    Args:
        model: The compiled model (its optimizer is built here if it is not yet).
        strategy: The strategy the model was built under.
        metrics: Which logs to report: ``None`` for all, a list of names, or ``{reported
            name: log name}``. ``epoch`` (the number of finished epochs) is always reported.
        made_with: What the state is made with (see :class:`~tfpar.callbacks.EpochCheckpoint`);
            a restore into a model made with something else is refused with the difference.

    Raises:
        ConfigError: From :meth:`restore`, if the checkpoint was made with something else.
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy,
                 metrics: list[str] | dict[str, str] | None = None,
                 made_with: dict[str, Any] | None = None):
        super().__init__()
        self._metrics = metrics
        self._chief = cluster_spec.is_chief(strategy)
        self._local = tempfile.mkdtemp(prefix="tfpar-ray-")  # Ray uploads it at each epoch.
        weakref.finalize(self, shutil.rmtree, self._local, True)
        self._state = EpochCheckpoint(self._local, model, strategy, max_to_keep=1,
                                      made_with=made_with)

    def restore(self) -> int:
        """Restores Ray's latest checkpoint of this run, if it has one.

        Returns:
            The number of epochs it had finished (0 without a checkpoint): ``fit``'s
            ``initial_epoch``.
        """
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return 0
        with checkpoint.as_directory() as directory:
            shutil.copytree(directory, self._local, dirs_exist_ok=True)
        return self._state.restore()

    def _reported(self, logs: dict[str, Any], epochs: int) -> dict[str, Any]:
        if self._metrics is None:
            chosen = dict(logs)
        elif isinstance(self._metrics, dict):
            chosen = {name: logs[log] for name, log in self._metrics.items()}
        else:
            chosen = {name: logs[name] for name in self._metrics}
        return {**{name: float(value) for name, value in chosen.items()}, "epoch": epochs}

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        self._state.on_epoch_end(epoch, logs)  # Every worker takes part; the chief writes.
        metrics = self._reported(logs, epoch + 1)
        saved = int(self._state.epochs_done.numpy()) == epoch + 1  # Not after a NaN loss.
        if self._chief and saved:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(
                self._local), checkpoint_dir_name=f"{CHECKPOINT_PREFIX}{epoch + 1:06d}")
        else:
            ray.train.report(metrics)
