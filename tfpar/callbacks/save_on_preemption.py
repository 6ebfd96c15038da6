"""Saving the training state when a preemption notice arrives, under plain ``model.fit``.

:class:`SaveOnPreemption` watches for a scheduler's notice (SIGTERM, and a second signal such as
Slurm's ``--signal=USR1@90``); every worker of the job finishes its step, all stop after the
same step (:mod:`tfpar.cluster.preemption`), the state is saved there by an
:class:`~tfpar.callbacks.EpochCheckpoint`, and each process prints one line and exits with
:data:`~tfpar.cluster.preemption.PREEMPTED_EXIT_STATUS`. Run the same command again: it
resumes at the next step, as the uninterrupted run would have gone on.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Sequence

import keras
import tensorflow as tf

from tfpar.callbacks.checkpointing import EpochCheckpoint
from tfpar.cluster import peers
from tfpar.cluster import preemption
from tfpar.cluster import spec as cluster_spec

_runs = itertools.count()  # Training runs of this process (the same on every worker).


class SaveOnPreemption(keras.callbacks.Callback):
    """Stops training at a step boundary after a preemption notice, saving the state there.

    Put it after ``checkpoint`` in ``fit``'s callbacks. Signal handlers are set (in the main
    thread) for the duration of ``fit`` and given back after it.

    Args:
        checkpoint: Saves the state (``None``: training stops at the agreed step, and nothing
            is saved).
        signals: The notice signals (default: SIGTERM and SIGUSR1).
        grace_seconds: Seconds from the notice to the end of the process at the latest; past
            them the process ends saying which state is intact.
        exit_process: Once saved, end the process at once with the preempted status (the
            chief of a multi-worker job first waits a moment for its peers to leave); ``False``
            raises :class:`~tfpar.cluster.preemption.Preempted` (a ``SystemExit``) out of
            ``fit`` instead, which can take long while TensorFlow frees the input's threads;
            ``None``: as the program watching the notices chose (``tfpar-train`` exits).
    """

    def __init__(self, checkpoint: EpochCheckpoint | None = None,
                 signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
                 grace_seconds: float = preemption.DEFAULT_GRACE_SECONDS,
                 exit_process: bool | None = True):
        super().__init__()
        preemption.check_grace_seconds(grace_seconds)
        self.checkpoint, self.signals, self.grace_seconds = checkpoint, signals, grace_seconds
        self.exit_process = exit_process
        self._stop: preemption.StopStep | None = None
        self._steps = 0
        self._epoch = 0
        self._at_epoch_end = False  # The agreed step ended an epoch: stop once it has ended.
        # With data of unknown size, the agreed step may have been the epoch's last: the state
        # is saved inside the epoch before the next step, and which it was shows next.
        self._saved_before: tuple[int, int] | None = None
        self._watching = False

    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy
        resolver = getattr(strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec() if resolver is not None else tf.train.ClusterSpec({})
        tasks = [(job, i) for job in sorted(spec.jobs) for i in spec.task_indices(job)]
        task = (tasks.index((resolver.task_type, resolver.task_id))
                if resolver is not None and resolver.task_type else 0)
        self._stop = preemption.NOTICE.stop_step(str(next(_runs)), task, max(1, len(tasks)))
        self._steps, self._at_epoch_end, self._saved_before = 0, False, None
        preemption.NOTICE.loop_started()  # First: a notice from the watch on stops at a step.
        self._watching = preemption.NOTICE.watch(self.signals, self.grace_seconds)

    def on_epoch_begin(self, epoch, logs=None):
        if self._at_epoch_end:
            self._raise_preempted(epoch, 0)
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._saved_before is not None:
            # The epoch had this step too: the state saved before it is where the rerun goes
            # on (this step's result is dropped with the process).
            self._raise_preempted(*self._saved_before, saved=True)
        self._steps += 1
        stop_after = self._stop.stop_after(self._steps) if self._stop else None
        if stop_after is None or self._steps < stop_after:
            return
        steps = self.params.get("steps")
        if steps is None:
            # Data of unknown size: whether this step was the epoch's last shows only when
            # Keras draws the next batch. Save now (every worker alike), then either the epoch
            # ends (the epoch's own save replaces this one) or the next step ends the run.
            self._saved_before = (self._epoch, batch + 1)
            preemption.NOTICE.stop_at(self._saved_before)
            self._save_inside_epoch(*self._saved_before)
            self._at_epoch_end = True
            return
        if batch + 1 >= steps:
            # The epoch's last step: its end (validation, callbacks, the epoch's save) runs
            # first, and training stops when the next epoch would begin.
            self._at_epoch_end = True
            preemption.NOTICE.stop_at((self._epoch + 1, 0))
            return
        preemption.NOTICE.stop_at((self._epoch, batch + 1))
        self._raise_preempted(self._epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        self._saved_before = None  # The saved step was the epoch's last: the epoch's end is.

    def on_train_end(self, logs=None):
        self._end()

    def _end(self) -> None:
        if self._stop is not None:
            self._stop.finish()
            self._stop = None
            preemption.NOTICE.loop_ended()
        if self._watching:
            preemption.NOTICE.unwatch()
            self._watching = False

    def _save_inside_epoch(self, epoch: int, steps: int) -> None:
        if self.checkpoint is not None:
            self.checkpoint.save_inside_epoch(epoch, steps)

    def _raise_preempted(self, epoch: int, steps: int, saved: bool = False) -> None:
        name = preemption.NOTICE.signal_name or "a peer's notice"
        if steps:
            where = f"epoch {epoch + 1} step {steps}"
        else:
            where = f"the end of epoch {epoch}"
        if self.checkpoint is None:
            said = f"stopped at {where}; nothing was saved (no checkpoint)"
        elif steps and not saved:
            said = f"state saved at {self.checkpoint.save_inside_epoch(epoch, steps)}"
        else:  # Saved already: the epoch's end, written in the background until committed.
            self.checkpoint.wait()
            said = f"state saved at {self.checkpoint.describe(epoch, steps)}"
        after = (f", {preemption.NOTICE.seconds_since():.1f} s after the notice"
                 if preemption.NOTICE.has_arrived else "")
        self._end()  # After the save: a second notice during it only records itself.
        stop = preemption.NOTICE.announce_stop(
            f"Preempted ({name}): {said}{after}; run the same command to resume.")
        exit_process = (preemption.NOTICE.exits_process if self.exit_process is None
                        else self.exit_process)
        if exit_process:
            preemption.NOTICE.exit(self._leave_last)
        raise stop

    def _leave_last(self) -> None:
        """The chief of a multi-worker job waits a moment for the other workers to leave (its
        process leads TensorFlow's coordination service)."""
        strategy = self.model.distribute_strategy
        if cluster_spec.is_multi_worker(strategy) and cluster_spec.is_chief(strategy):
            peers.leave_last(strategy.cluster_resolver)
