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
- every worker saves and reports a copy of the same state; here the chief reports it, and
  each other worker reports only what it alone holds (its replicas' copies of per-replica
  BatchNorm statistics, :mod:`tfpar.replica_copies`), which Ray merges into the same
  checkpoint (Ray asks every worker to report the same number of times).

Under Ray Train a scheduler's SIGTERM does not reach the training (Ray's controller handles the
worker group), so a restart resumes from the last state reported. With ``save_every_steps=N``
a state is also reported every N steps inside an epoch, and a restart resumes at the step
after it, with each replica's own BatchNorm statistics and the partial epoch's metrics, as a
resume from a notice does (:class:`tfpar.callbacks.EpochCheckpoint`).

Install tfpar with its ``ray`` extra: ``pip install "tfpar-0.4.0-py3-none-any.whl[ray]"``.
"""

from __future__ import annotations

import contextlib
import os
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
    import tfpar

    raise ImportError("tfpar.ray needs Ray Train, which is not installed: install tfpar with "
                      f"its ray extra (pip install \"tfpar-{tfpar.__version__}-py3-none-any.whl"
                      "[ray]\", or pip install -e \".[ray]\" in a checkout).") from None

CHECKPOINT_PREFIX = "epoch_"
""": The prefix of the checkpoint folders reported to Ray (``epoch_000003``: after 3 epochs;
``epoch_000003_step_000020``: after step 20 of the fourth)."""


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
        save_every_steps: Also report a state every this many steps inside an epoch (``None``:
            at the end of each epoch only). Each report costs a save: choose N so that a save
            takes a small share of N steps.

    Raises:
        ConfigError: From :meth:`restore`, if the checkpoint was made with something else.
        ValueError: If ``save_every_steps`` is not a positive integer.
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy,
                 metrics: list[str] | dict[str, str] | None = None,
                 made_with: dict[str, Any] | None = None,
                 save_every_steps: int | None = None):
        super().__init__()
        if save_every_steps is not None and (
                isinstance(save_every_steps, bool) or not isinstance(save_every_steps, int)
                or save_every_steps < 1):
            raise ValueError("save_every_steps must be a positive integer (or None: at epoch "
                             f"ends only). Received: {save_every_steps!r}.")
        self._metrics, self._every = metrics, save_every_steps
        self._epoch = 0
        self._chief = cluster_spec.is_chief(strategy)
        self._local = tempfile.mkdtemp(prefix="tfpar-ray-")  # Ray uploads it at each epoch.
        weakref.finalize(self, shutil.rmtree, self._local, True)
        # Written within the step: Ray takes the folder as each report is made.
        self._state = EpochCheckpoint(self._local, model, strategy, max_to_keep=1,
                                      made_with=made_with, write_in_background=False)

    def restore(self) -> int:
        """Restores Ray's latest checkpoint of this run, if it has one.

        Returns:
            The number of epochs it had finished (0 without a checkpoint): ``fit``'s
            ``initial_epoch``. A state reported inside an epoch resumes that epoch at the
            next step when ``fit`` begins it with this callback.
        """
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return 0
        with checkpoint.as_directory() as directory:
            shutil.copytree(directory, self._local, dirs_exist_ok=True)
        return self._state.restore()

    def _reported(self, logs: dict[str, Any], epochs: int,
                  partial: bool = False) -> dict[str, Any]:
        """The chosen logs (inside an epoch, those it has: no validation yet) and ``epoch``."""
        if self._metrics is None:
            chosen = dict(logs)
        else:
            names = (self._metrics if isinstance(self._metrics, dict)
                     else {name: name for name in self._metrics})
            chosen = {name: logs[log] for name, log in names.items()
                      if not partial or log in logs}
        return {**{name: float(value) for name, value in chosen.items()}, "epoch": epochs}

    def set_model(self, model):
        super().set_model(model)
        self._state.set_model(model)

    def on_train_begin(self, logs=None):
        self._state.on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._state.on_epoch_begin(epoch, logs)  # A restored state resumes at its step.

    def on_train_batch_end(self, batch, logs=None):
        steps = batch + 1
        if not self._every or steps % self._every or steps == self.params.get("steps"):
            return  # (The epoch's last step is reported at its end.)
        self._state.save_inside_epoch(self._epoch, steps)  # Every worker; the chief writes.
        metrics = {**self._reported(dict(logs or {}), self._epoch, partial=True), "step": steps}
        self._report(metrics, f"{CHECKPOINT_PREFIX}{self._epoch:06d}_step_{steps:06d}")

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        self._state.on_epoch_end(epoch, logs)  # Every worker takes part; the chief writes.
        metrics = self._reported(logs, epoch + 1)
        saved = int(self._state.epochs_done.numpy()) == epoch + 1  # Not after a NaN loss.
        if saved:
            self._report(metrics, f"{CHECKPOINT_PREFIX}{epoch + 1:06d}")
        else:
            ray.train.report(metrics)

    def _report(self, metrics: dict[str, Any], name: str) -> None:
        """Reports the state just saved as checkpoint ``name``: the chief its whole folder,
        another worker the files it alone wrote (moved to a folder of their own, removed once
        Ray has them), which Ray merges into the same checkpoint."""
        if self._chief:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(
                self._local), checkpoint_dir_name=name)
            return
        own = self._state.written_by_this_worker
        if not own:
            ray.train.report(metrics)
            return
        staged = tempfile.mkdtemp(prefix="tfpar-ray-own-")
        try:
            for relative in own:
                os.makedirs(os.path.dirname(os.path.join(staged, relative)), exist_ok=True)
                source = os.path.join(self._local, relative)
                shutil.move(source, os.path.join(staged, relative))
                with contextlib.suppress(OSError):  # Its checkpoint's folder, when empty.
                    os.rmdir(os.path.dirname(source))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(staged),
                             checkpoint_dir_name=name)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
