"""Training-state checkpoints for kill-and-resume, with ``tf.train.CheckpointManager``.

After every epoch the model's weights, the optimizer's state and the number of finished
epochs are saved; :meth:`EpochCheckpoint.save_inside_epoch` also saves in the middle of an
epoch (after a preemption notice, :mod:`tfpar.callbacks.save_on_preemption`), with the step and the
epoch's metrics so far, and a run restored from such a state starts that epoch at the next
step (:mod:`tfpar.compat.mid_epoch_resume`). TensorFlow writes each checkpoint's files first
and then replaces the small ``checkpoint`` index file atomically, so a run killed at any moment
leaves the previous complete checkpoint as the latest one. In multi-worker training every
worker takes part in saving (it may run collective ops), but only the chief writes to
``directory``; the others write to a scratch folder they delete.

A save does not block training for its write: the step waits only while the state is copied
to host memory (:mod:`tfpar.callbacks.host_snapshot`), and the copy is written, committed and
pruned on a background thread, one write at a time, while training goes on. A save waits for
the write before it, a preemption notice's save and the end of ``fit`` wait for theirs, and a
write that fails is raised at the next save or at the end of ``fit`` (the last committed state
is intact). ``write_in_background=False`` writes within the step instead.

It is a Keras callback, so resuming behaves the same under every strategy.

Why one module of this length: it is one saver, :class:`EpochCheckpoint`, whose restore, two
kinds of save and their commit share the state each crash state of the explorer
(``tests/callbacks/crash_states_test.py``) checks; split, the order of its writes would be read
across files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import time
import warnings
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfpar import atomic_io
from tfpar import replica_copies
from tfpar import replica_copy_files
from tfpar import worker_contract
from tfpar.callbacks import host_snapshot
from tfpar.callbacks import save_interval
from tfpar.cluster import failures
from tfpar.cluster import preemption
from tfpar.cluster import spec as cluster_spec
from tfpar.compat import keras_fixes
from tfpar.compat import mid_epoch_resume
from tfpar.errors import ConfigError
from tfpar.errors import DamagedStateError
from tfpar.errors import PeerLostError
from tfpar.errors import StateNotSavedError
from tfpar.worker_contract import position_words


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


class _FileList(tf.train.experimental.PythonState):
    """The list of a checkpoint's replicas' copies files
    (:attr:`tfpar.replica_copies.Written.files`), as JSON inside the checkpoint: it commits with
    the checkpoint, which so records exactly which files it was saved with (``null``: none)."""

    def __init__(self):
        self.json = "null"

    def serialize(self) -> str:
        return self.json

    def deserialize(self, string_value: Any) -> None:
        self.json = string_value.decode() if isinstance(string_value, bytes) else string_value


_WRITERS: dict[str, host_snapshot.BackgroundWriter] = {}


def wait_for_writes(directory: str) -> None:
    """Waits for the saves this process is writing to ``directory`` in the background
    (:class:`EpochCheckpoint`'s); raises what the last one raised.

    Raises:
        StateNotSavedError: If that save could not be written (the last committed state is
            intact).
    """
    writer = _WRITERS.get(os.path.abspath(directory))
    if writer is not None:
        writer.wait()


class _DeprecatedConstant:
    """A class attribute that warns when read, naming its replacement."""

    def __init__(self, value: str, message: str):
        self._value, self._message = value, message

    def __get__(self, instance: Any, owner: Any = None) -> str:
        warnings.warn(self._message, DeprecationWarning, stacklevel=2)
        return self._value


class EpochCheckpoint(keras.callbacks.Callback):
    """Saves training state at the end of every epoch (and, with ``save_every_steps``, inside
    it) and restores the latest one.

    Args:
        directory: Where checkpoints live (``--model_dir``).
        model: The model (built, compiled, optimizer built) whose state is saved.
        strategy: The strategy it was built under.
        max_to_keep: Number of checkpoints kept.
        made_with: What the state is made with (model, dataset, optimizer, ...), saved beside
            it as ``made_with.json``: a restore into a run made with something else is refused
            with the difference, instead of a shape error or a silent resume.
        save_every_steps: Also save inside an epoch, after every this many of its steps (0:
            at epochs' ends only), so that a kill without notice loses at most that many
            steps; a run restored from such a save resumes at its step, bit for bit. Every
            worker saves at the same steps (the count is the job's, not a clock's).
            ``"auto"``: the most frequent interval whose saves cost at most ``save_budget`` of
            the training time, chosen after the run's first few steps from their time and a
            save's (:mod:`tfpar.callbacks.save_interval`), and said in one line; the workers of
            a job each choose at the same steps, and take the longest of their intervals.
        save_budget: With ``save_every_steps="auto"``, the largest fraction of the training
            time saving may take (0.02: 2%).
        write_in_background: How a save inside an epoch is written. ``"auto"``: the way
            that costs the training less, from the saves timed on this run (on the CPU a
            write in the background takes the step's cores, and can cost more than one within
            the step; see :mod:`tfpar.callbacks.save_interval`); ``True``: in the background,
            the step waiting only for a copy of the state in host memory (see the module
            docstring); ``False``: a save writes and commits before the step goes on. Without
            saves inside an epoch, the epochs' ends are written in the background unless
            ``False``.

    Raises:
        ConfigError: If ``save_every_steps`` is not an integer >= 0 or ``"auto"``,
            ``save_budget`` is not in (0, 1), or ``write_in_background`` is not ``True``,
            ``False`` or ``"auto"``.
    """

    MADE_WITH_FILE = "made_with.json"
    # tfpar 0.3's file of each kept checkpoint's position, read for the states it saved
    # (until 0.5.0); a save now commits the folder's position record
    # (:func:`tfpar.worker_contract.commit_position`).
    POSITIONS_FILE = _DeprecatedConstant(
        worker_contract.LEGACY_POSITIONS_FILE,
        "EpochCheckpoint.POSITIONS_FILE is deprecated and will be removed in tfpar 0.5.0: a "
        "state folder's position is its position record (tfpar.worker_contract.read_position); "
        "0.3.0's file is tfpar.worker_contract.LEGACY_POSITIONS_FILE.")
    # Every saved epoch's logs (loss, metrics, test accuracy), so that a resumed run reports
    # the whole training, each epoch once. Written before the epoch's checkpoint: a kill in
    # between leaves it one epoch ahead, and a restore keeps the epochs the checkpoint has.
    HISTORY_FILE = "history.json"
    # Each checkpoint's copies of the variables replicas updated apart (per-replica BatchNorm
    # statistics; see :mod:`tfpar.replica_copies`), in ``REPLICA_COPIES_DIR/ckpt-N/``, a file
    # written by each worker before the checkpoint, where any replica's copy differed.
    REPLICA_COPIES_DIR = "replica_copies"
    # The checkpoint's entry that lists those files (:class:`_FileList`).
    FILE_LIST = "replica_copies_files"

    def __init__(self, directory: str, model: keras.Model, strategy: tf.distribute.Strategy,
                 max_to_keep: int = 2, made_with: dict[str, Any] | None = None,
                 save_every_steps: int | str = 0, save_budget: float = save_interval.BUDGET,
                 write_in_background: bool | str = save_interval.AUTO):
        super().__init__()
        in_background = save_interval.checked_write_mode(write_in_background)
        self._background = in_background is not False
        self._mirror: host_snapshot.HostMirror | None = None
        self.save_every_steps = save_interval.checked_interval(save_every_steps)
        auto = self.save_every_steps == save_interval.AUTO
        budget = save_interval.checked_budget(save_budget)
        if budget != save_interval.BUDGET and not auto:
            raise ConfigError(f"save_budget applies only with save_every_steps="
                              f"{save_interval.AUTO!r}. Received: save_every_steps="
                              f"{save_every_steps!r}.", argument="save_budget")
        # Every worker of a job saves at the same steps: each chooses from its own clock, at
        # the same steps, and the job takes the longest interval (a collective).
        self._agree = cluster_spec.is_multi_worker(strategy)
        self._gather_intervals: Any = None
        # A write in the background takes the cores of a step that runs on the CPU.
        try:
            replicas = strategy.extended.worker_devices
        except RuntimeError:  # The default strategy lists none: one device, a GPU if any.
            replicas = [device.name for device in tf.config.list_logical_devices("GPU")[:1]]
        on_cpu = all(tf.DeviceSpec.from_string(device).device_type == "CPU"
                     for device in replicas)
        # Saves inside an epoch are timed where the interval or the way of writing them is
        # chosen (beside an accelerator a write in the background costs only its copy).
        if in_background is None and not on_cpu:
            in_background = True
        self._auto_interval = auto
        self._chooser = (save_interval.IntervalChooser(budget, writes_share_cores=on_cpu,
                                                       in_background=in_background)
                         if auto or (in_background is None and self.save_every_steps)
                         else None)
        #: The steps between saves inside an epoch (0: none, or with ``"auto"`` none chosen).
        self.interval = 0 if auto else int(self.save_every_steps)
        #: With ``"auto"``, the line that says the interval chosen (``None`` until then).
        self.interval_chosen: str | None = None
        self._epoch = 0
        self._saved_step = 0  # The step of the current epoch its state was last saved at.
        self._steps = 0  # The current epoch's steps done.
        # An epoch's steps, where the data does not tell Keras: the last whole epoch's.
        self._epoch_steps_seen: int | None = None
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
        self._model, self._max_to_keep, self._strategy = model, max_to_keep, strategy
        # One writer per folder in this process: a checkpoint made again on a folder (after
        # fit raised, say) waits for what the one before is still writing there.
        self._writer = _WRITERS.setdefault(os.path.abspath(self._write_dir),
                                           host_snapshot.BackgroundWriter())
        with strategy.scope():
            self.epochs_done = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="epochs_done")
            #: Steps of epoch ``epochs_done`` done when the state was saved (0 at an epoch end).
            self.steps_done = tf.Variable(0, dtype=tf.int64, trainable=False, name="steps_done")
            # The optimizer's slots must exist before a restore can fill them. Building twice
            # would replace the slots on optimizers that do not guard against it.
            if not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
        self._metric_variables: list = []
        self._file_list = _FileList()
        self._last_number = 0
        # The positions of the checkpoints this callback restored or saved, by name.
        self._known: dict[str, tuple[int, int]] = {}
        self._last_path: str | None = None  # In directory: the last state restored or saved.
        self._manager = self._make_manager()
        #: Where the restored epoch resumes (0: at its start), and its metrics until then.
        self.resume_step = 0
        self._resume_metrics: list[np.ndarray] = []
        self._began = False
        #: The files of ``directory`` this worker wrote at the last save that another
        #: worker's folder does not hold (its replicas' copies), as paths relative to
        #: ``directory``: what a worker with a folder of its own must hand on (Ray Train
        #: merges every worker's reported files into one checkpoint).
        self.written_by_this_worker: list[str] = []

    def _parts(self, metric_variables: list | None = None) -> dict[str, Any]:
        # Keras 3 models expose no checkpoint dependencies of their own; their variables
        # (BatchNorm statistics too) are tracked as a list, and so are the metrics' (the
        # running loss and metrics of a partly trained epoch), once fit has built them.
        parts = dict(model_variables=list(self._model.variables),
                     optimizer=self._model.optimizer, epochs_done=self.epochs_done,
                     steps_done=self.steps_done)
        if metric_variables:
            parts["metric_variables"] = metric_variables
        return parts

    def _make_manager(self) -> tf.train.CheckpointManager:
        """The manager of the saves: of a mirror of the state in host memory, written in the
        background (the same keys and values; see :mod:`.host_snapshot`), or of the state."""
        checkpoint = tf.train.Checkpoint(**self._parts(self._metric_variables),
                                         **{self.FILE_LIST: self._file_list})
        self._mirror = None
        if self._background:
            try:
                self._mirror = host_snapshot.HostMirror(checkpoint)
            except host_snapshot.NotMirrored as e:
                logging.warning("Saving within the step: the training state cannot be copied "
                                "to host memory for a write in the background (%s).", e)
        saved = self._mirror.checkpoint if self._mirror is not None else checkpoint
        with _readable_index(self._write_dir):
            return tf.train.CheckpointManager(saved, self._write_dir,
                                              max_to_keep=self._max_to_keep)

    def wait(self) -> None:
        """Waits for the save being written in the background to be committed.

        Raises:
            StateNotSavedError: If it could not be written (the last committed state is
                intact).
        """
        self._writer.wait()

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
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            if not isinstance(saved, dict):
                raise ValueError(f"JSON of type {type(saved).__name__}")
        except (OSError, ValueError) as e:
            detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise DamagedStateError(
                f"The file {path} that records what the training state in {self.directory} "
                "was made with is not readable. A restore checks the state is of this model "
                "and data; start over (resume=False), or use another model_dir. Received: "
                f"{type(e).__name__}: {' '.join(detail.split())}.") from None
        differ = [f"{key}={saved[key]!r} (now {value!r})"  # Keys saved by older versions.
                  for key, value in self.made_with.items() if saved.get(key, value) != value]
        if differ:
            raise ConfigError(f"The training state in {self.directory} was made with "
                              f"{', '.join(differ)}. Start over (resume=False), or use another "
                              "model_dir.")

    def restore(self) -> int:
        """Restores the latest checkpoint of ``directory``; returns the epoch to start at.

        A state saved inside an epoch resumes that epoch at its next step
        (:attr:`resume_step`), when this callback's ``fit`` begins it.

        Returns:
            The number of finished epochs (0 when there is no checkpoint).

        Raises:
            ConfigError: If the state was made with something else (see ``made_with``), the
                index is unreadable, or the state was saved inside an epoch on a Keras where
                tfpar cannot start ``fit`` inside one.
        """
        self.wait()
        latest = self.latest
        if latest is None:
            self._check_no_index_ignored()
            self._declare(worker_contract.Position(0, 0))
            return 0
        self._check_made_with()
        with _readable_checkpoint(latest):
            reader = tf.train.load_checkpoint(latest)
            saved = reader.get_variable_to_shape_map()
            parts = self._parts()
            if _VALUE.format("steps_done") not in saved:  # Saved before steps were recorded.
                del parts["steps_done"]
            # The metrics are read below, when the resumed epoch begins.
            tf.train.Checkpoint(**parts).restore(latest).assert_existing_objects_matched(
            ).expect_partial()
            key = f"{self.FILE_LIST}/.ATTRIBUTES/py_state"
            files = (json.loads(_text(reader.get_tensor(key))) if key in saved
                     else replica_copy_files.UNRECORDED)  # Saved before the files were listed.
        epochs, self.resume_step = int(self.epochs_done.numpy()), int(self.steps_done.numpy())
        self._last_number = _number_of(latest)
        self._restore_replica_copies(os.path.basename(latest), files)
        if self.resume_step:
            reason = keras_fixes.unavailable("mid_epoch_start")
            if reason:
                raise ConfigError(
                    f"The state in {self.directory} was saved at step {self.resume_step} of "
                    f"epoch {epochs + 1}; resuming inside an epoch needs tfpar's fix of Keras's "
                    f"fit, which is not applied ({reason}). Start over (resume=False).")
            keras_fixes.install(("mid_epoch_start",))
            keys = [_VALUE.format(f"metric_variables/{i}") for i in range(len(saved))]
            with _readable_checkpoint(latest):
                self._resume_metrics = [reader.get_tensor(key) for key in keys if key in saved]
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.directory, self.HISTORY_FILE), encoding="utf-8") as f:
                self.history = {name: values[:epochs] for name, values in json.load(f).items()}
        self._known[os.path.basename(latest)] = self.position
        self._last_path = latest
        self._declare(worker_contract.Position(*self.position, os.path.basename(latest)))
        return epochs

    def start_over(self) -> int:
        """Trains from scratch in ``directory`` without restoring what it holds (overwritten
        by the next saves): from now on its position record says no save is resumed from.

        Returns:
            0, the epoch to start at.
        """
        self._declare(worker_contract.Position(0, 0))
        return 0

    def _declare(self, restored: worker_contract.Position) -> None:
        """The chief declares its folder to a launcher, whose position record says what it
        restored."""
        if self._chief:
            worker_contract.restored_position(self.directory, restored)
            worker_contract.declare(folder=self.directory)

    def _check_no_index_ignored(self) -> None:
        """Raises where TensorFlow found no checkpoint although its index is there: it ignores
        an index it cannot parse, or whose checkpoint has no files, and a run would start over
        without a word. (TensorFlow replaces the index whole, after the checkpoint's files.)

        Raises:
            DamagedStateError: Naming the index, or the checkpoint's missing file.
        """
        index = os.path.join(self.directory, worker_contract.CHECKPOINT_INDEX)
        try:
            with open(index, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return  # No index: nothing was saved (or a save was killed before its first).
        except OSError as e:  # A folder in its place, or a file that cannot be read.
            raise DamagedStateError(
                f"The checkpoint index {index} is not readable. A restore reads a checkpoint "
                "as TensorFlow wrote it; start over (resume=False), or use another model_dir. "
                f"Received: {type(e).__name__}: {e.strerror or e}.") from None
        named = worker_contract.latest_in_index(text)
        allowed = ("A restore reads a checkpoint as TensorFlow wrote it; start over "
                   "(resume=False), or use another model_dir.")
        files = os.path.join(self.directory, f"{named}.index")
        if named is None or os.path.exists(files):
            raise DamagedStateError(f"The checkpoint index {index} is not readable. {allowed} "
                                    f"Received: {len(text)} characters TensorFlow cannot "
                                    "parse.")
        raise DamagedStateError(f"The checkpoint {os.path.join(self.directory, named)} that "
                                f"the index {index} names has no file {named}.index. {allowed} "
                                f"Received: no such file {files}.")

    def _replica_copies_path(self, name: str) -> str:
        """The folder of checkpoint ``name``'s replicas' copies, a file per worker."""
        return os.path.join(self.directory, self.REPLICA_COPIES_DIR, name)

    def _restore_replica_copies(self, name: str, files: Any) -> None:
        """Gives each replica its own copy of what replicas updated apart, as saved: from the
        files the checkpoint lists (``files``), or, saved before they were listed, the files
        found."""
        path = self._replica_copies_path(name)
        try:
            if replica_copies.read(self._model, path, self._strategy, files):
                return
            if files is not replica_copy_files.UNRECORDED:
                return  # Every replica's copy was the same: the checkpoint holds it.
            with open(f"{path}.json", encoding="utf-8") as f:  # Saved by tfpar 0.3.
                copies = replica_copy_files.decode_json(json.load(f))
        except FileNotFoundError:
            return  # Every replica's copy was the same: the checkpoint holds it.
        except DamagedStateError:
            raise
        except (OSError, ValueError) as e:
            raise ConfigError(f"The replicas' copies saved with {name} in {self.directory} are "
                              f"not readable ({e}). Start over (resume=False), or use another "
                              "model_dir.") from None
        replica_copies.scatter(self._model, copies, self._strategy)

    def _write_replica_copies(self, name: str) -> None:
        """Each worker writes its own replicas' copies of what differs between replicas."""
        path = self._replica_copies_path(name)
        if self._chief:  # What a failed save of this number left (before any worker writes).
            atomic_io.remove_tree(path)
        written = replica_copies.write_files(self._model, path, self._strategy)
        self._file_list.json = json.dumps(written.files)
        self.written_by_this_worker = (
            [os.path.relpath(written.path, self.directory)] if written.path else [])

    def _prune_replica_copies(self) -> None:
        """Removes the copies of checkpoints the manager no longer keeps."""
        kept = {os.path.basename(path) for path in self._manager.checkpoints}
        folder = os.path.join(self.directory, self.REPLICA_COPIES_DIR)
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                if name.removesuffix(".json") in kept:
                    continue
                if os.path.isdir(path):
                    atomic_io.remove_tree(path)
                else:  # A 0.3 save's JSON.
                    with contextlib.suppress(OSError):
                        atomic_io.remove(path)

    @property
    def position(self) -> tuple[int, int]:
        """``(epochs finished, steps of the next epoch done)`` of the last state saved or
        restored."""
        return int(self.epochs_done.numpy()), int(self.steps_done.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._saved_step, self._steps = epoch, 0, 0
        if self._began:
            return
        self._began = True  # The first epoch of this fit: resumes at the restored step.
        if self.resume_step and epoch == int(self.epochs_done.numpy()):
            self._saved_step = self.resume_step
            mid_epoch_resume.start_next_epoch_at(self.resume_step)
            mid_epoch_resume.assign_metric_values(self.model, self._resume_metrics)
            logging.info("Epoch %d resumes at step %d.", epoch + 1, self.resume_step)

    def on_train_begin(self, logs=None):
        self._began = False

    def on_train_end(self, logs=None):
        self.wait()  # fit returns with its last save committed.

    def on_train_batch_end(self, batch, logs=None):
        if not self.save_every_steps:
            return
        steps = batch + 1  # Of this epoch (Keras numbers a resumed epoch's from its step).
        self._steps = steps
        chooser = self._chooser
        if chooser is not None:
            chooser.step_ended(steps, writing=self._writer.in_flight)
        loss = (logs or {}).get("loss")
        if (steps >= ((self.params or {}).get("steps") or math.inf)
                or (loss is not None and not math.isfinite(float(loss)))):
            return  # The epoch's last step (its end saves); a diverged state is never saved.
        if not self._auto_interval:
            if steps // self.interval <= self._saved_step // self.interval:
                return  # No multiple of the interval reached since the last save (several
                # steps per call move on by several).
        elif not self.interval:
            if chooser is None or not chooser.ready:
                return  # The saves timed before the interval is chosen, once enough calls
                # are timed since the run's start or the save before.
        elif steps - self._saved_step < self.interval:
            return
        self._saved_step = steps
        if chooser is None:
            self._save_or_raise(self._epoch, steps, background=True)
            return
        chooser.timed_save(lambda: self._save_or_raise(self._epoch, steps, background=True),
                           wait=self.wait)
        self._choose_interval()

    def _choose_interval(self) -> None:
        """Chooses the interval from the steps and saves timed so far: said in one line when
        first chosen, logged when the times move it."""
        chooser = self._chooser
        if chooser is None or not chooser.timed or not self._auto_interval:
            return
        # Saves come at the end of a call of the step: whole calls of several steps.
        per_call = getattr(self.model, "steps_per_execution", 1)
        per_call = per_call if isinstance(per_call, int) and per_call > 1 else 1
        chosen = chooser.choose()
        here = math.ceil(chosen / per_call) * per_call
        interval = self._longest_of_every_worker(here) if self._agree else here
        if interval == self.interval:
            return
        first, self.interval = not self.interval, interval
        self.interval_chosen = save_interval.describe(
            interval, chooser.step_seconds, chooser.save_seconds, chooser.budget,
            (self.params or {}).get("steps") or self._epoch_steps_seen, chooser.how,
            here=here, chosen=chosen)
        if not self._chief:
            return
        if first:
            # Printed, not logged: how often the state is saved is part of the run's result
            # (on a line of its own after a progress bar's).
            bar = (self.params or {}).get("verbose") == 1
            print(("\n" if bar else "") + self.interval_chosen, flush=True)
        else:
            logging.info("%s", self.interval_chosen)

    def _longest_of_every_worker(self, interval: int) -> int:
        """The longest of the intervals the job's workers chose (each from its own clock, at
        the same step): every worker must save at the same steps."""
        if self._gather_intervals is None:  # One function, traced once (eager runs retrace).
            strategy = self._strategy

            @tf.function
            def gather(value: tf.Tensor) -> tf.Tensor:
                return strategy.gather(strategy.run(lambda: tf.reshape(value, [1])), axis=0)

            self._gather_intervals = gather
        return int(tf.reduce_max(self._gather_intervals(tf.constant(interval, tf.int64))))

    def _snapshot(self, epochs: int, steps: int,
                  saving: contextlib.ExitStack) -> tuple[int, worker_contract.Position]:
        """The part of a save of the position ``(epochs finished, steps of the next epoch)``
        the step waits for: the history (chief), the position's variables, each worker's
        replicas' copies (collectives) and the copy of the state in host memory; returns the
        checkpoint's number and position. ``saving`` holds the notice's record of the save
        under way until :meth:`_write` commits it."""
        metric_variables = list(self._model.metrics_variables)
        if len(metric_variables) != len(self._metric_variables):  # Built by fit since.
            self._metric_variables = metric_variables
            self._manager = self._make_manager()
        number = max(int(self._model.optimizer.iterations.numpy()), self._last_number + 1)
        if self._chief:
            atomic_io.make_dirs(self.directory)
            # What a save killed inside TensorFlow's write left (a data file as large as the
            # model's state, in ckpt-N_temp/, kept by every later run before).
            self._remove_partial_saves()
            atomic_io.write_json(os.path.join(self.directory, self.HISTORY_FILE), self.history)
        self.epochs_done.assign(epochs)
        self.steps_done.assign(steps)
        position = worker_contract.Position(epochs, steps, f"ckpt-{number}")
        # Until its position record, a spent grace budget cannot tell whether TensorFlow's
        # commit (the index, then a sweep of old checkpoints) happened: it says both.
        saving.enter_context(preemption.NOTICE.saving(
            dataclasses.replace(position, folder=self.directory)))
        self._write_replica_copies(f"ckpt-{number}")
        if self._mirror is not None:
            self._mirror.take()
        return number, position

    def _write(self, number: int, position: worker_contract.Position,
               saving: contextlib.ExitStack) -> str:
        """The rest of the save (in the background, or within the step): TensorFlow's write
        of checkpoint ``number`` and its commit, the position record, then the pruning;
        returns its path."""
        with saving:
            # TensorFlow renames its data files into place, then writes the checkpoint's
            # ``.index`` file in place, then replaces the index ``checkpoint`` whole.
            with atomic_io.external_writes(
                    self._write_dir, "tensorflow",
                    whole=lambda name: not name.endswith(".index"),
                    order=lambda name: (2 if name == worker_contract.CHECKPOINT_INDEX
                                        else 1 if name.endswith(".index") else 0)):
                path = self._saved_even_if_not_swept(number)
            self._last_number = number
            self._known[f"ckpt-{number}"] = position.pair
            self._last_path = os.path.join(self.directory, os.path.basename(path))
            # Committed: its position record (which the launcher reads, and the notice's line,
            # should its grace budget run out during the clean-up below), held off from a spent
            # budget's end so that the line and the record name the same state.
            with preemption.NOTICE.ending_held():
                worker_contract.commit_position(self.directory, position, write=self._chief,
                                                by_another=not self._chief)
        if self._chief:
            self._prune_replica_copies()
        if self._chief and self.made_with and not self._made_with_written:
            atomic_io.write_json(os.path.join(self.directory, self.MADE_WITH_FILE),
                                 self.made_with)
            self._made_with_written = True
        return path

    def _saved_even_if_not_swept(self, number: int) -> str:
        """Saves ``ckpt-number`` through the manager; returns its path. TensorFlow commits a
        save (its index names it) before it removes the checkpoints past ``max_to_keep``: a
        removal that fails then leaves the new save committed, which is said in a warning, not
        taken for a failed save.

        Raises:
            OSError, tf.errors.OpError: Where the save did not commit.
        """
        try:
            return self._manager.save(checkpoint_number=number)
        except (OSError, tf.errors.OpError) as e:
            if worker_contract.committed_save(self._write_dir) != f"ckpt-{number}":
                raise
            reason = e.strerror if isinstance(e, OSError) else e.message
            logging.warning("Saved ckpt-%d in %s, but older checkpoints there could not be "
                            "removed (%s); they take space until a later save removes them.",
                            number, self._write_dir, reason)
            return os.path.join(self._write_dir, f"ckpt-{number}")

    def describe(self, epochs: int, steps: int) -> str:
        """A saved position in words, e.g. ``"epoch 3 step 17 in DIR"`` (1-based epoch)."""
        return worker_contract.Position(epochs, steps, folder=self.directory).where

    def _remove_partial_saves(self) -> None:
        """Removes what a failed save left: TensorFlow's ``<prefix>_temp`` folders."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self._write_dir):
                if name.endswith("_temp"):
                    atomic_io.remove_tree(os.path.join(self._write_dir, name))

    def on_epoch_end(self, epoch, logs=None):
        self._epoch_steps_seen = self._steps or self._epoch_steps_seen
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            # A diverged epoch is never saved: the last finite epoch stays the resume point.
            logging.warning("Not saving epoch %d: its loss is %s.", epoch + 1, loss)
            return
        for name, value in (logs or {}).items():
            with contextlib.suppress(TypeError, ValueError):
                self.history.setdefault(name, []).append(float(value))
        if self._chooser is None:
            self._save_or_raise(epoch + 1, 0, background=True)
            return
        self._chooser.timed_save(lambda: self._save_or_raise(epoch + 1, 0, background=True),
                                 wait=self.wait)
        self._chooser.epoch_ended()
        self._choose_interval()

    def save_inside_epoch(self, epoch: int, steps: int, wait: bool = True) -> str:
        """Saves the state after ``steps`` steps of ``epoch`` (0-based), with the epoch's
        metrics so far; a run restored from it starts ``epoch`` at step ``steps``.

        Every worker of a job must call it at the same step (saving may run collectives).

        Args:
            epoch: The epoch (0-based).
            steps: Its steps done.
            wait: Return once the save is committed (and the one written in the background
                before it); ``False``: once the state is copied to host memory, the write going
                on in the background (with ``write_in_background``).

        Returns:
            The position in words (see :meth:`describe`).

        Raises:
            StateNotSavedError: If the state could not be written (the last one is intact).
            PeerLostError: If a peer worker stopped answering during the save (the last one
                is intact).
        """
        self._save_or_raise(epoch, steps, background=not wait)
        return self.describe(epoch, steps)

    def _save_or_raise(self, epochs: int, steps: int, background: bool = False) -> bool:
        """Saves the position ``(epochs, steps)``: the step waits for the snapshot, and, unless
        ``background`` (and a mirror in host memory serves, and the saves' timing does not
        have this one written within the step), for the write and commit too; returns
        whether the write goes on in the background.

        Raises:
            StateNotSavedError, PeerLostError: If this save, or the one written in the
                background before it, could not be saved.
        """
        self.wait()  # One write at a time: the one before, and what it raised.
        saving = contextlib.ExitStack()
        try:
            number, position = self._snapshot(epochs, steps, saving)
        except (OSError, tf.errors.OpError) as e:
            saving.close()
            raise self._not_saved(e, epochs, steps) from None
        except BaseException:
            saving.close()
            raise

        # The saves' timing has the first written within the step (its whole time is known
        # before the first choice), and where the way is chosen, each the cheaper way.
        either_way = background and self._mirror is not None
        background = either_way and (self._chooser is None or self._chooser.next_in_background())
        if either_way and self._chooser is not None and self._chooser.changed() and self._chief:
            # Said as the save written that way is made, from the costs it was chosen from.
            logging.info("Writing saves %s: %s.", "in the background"
                         if background else "within the step", self._chooser.how)

        def write() -> None:
            start = time.perf_counter()
            try:
                path = self._write(number, position, saving)
            except (OSError, tf.errors.OpError) as e:
                raise self._not_saved(e, epochs, steps) from None
            if background and self._chooser is not None:
                self._chooser.timed_write(time.perf_counter() - start)
            self._said_saved(path, epochs, steps)

        if background:
            self._writer.start(write)
        else:
            write()
        return background

    def _said_saved(self, path: str, epochs: int, steps: int) -> None:
        if self._chief:
            if steps:
                logging.info("Saved training state at epoch %d step %d to %s", epochs + 1, steps,
                             path)
            else:
                logging.info("Saved training state after epoch %d to %s", epochs, path)
        else:
            atomic_io.remove_tree(self._write_dir)

    def _not_saved(self, e: OSError | tf.errors.OpError, epochs: int,
                   steps: int) -> PeerLostError | StateNotSavedError:
        """The one-line error for a save of ``(epochs, steps)`` that failed with ``e``, once
        what it left is removed."""
        self._remove_partial_saves()
        # A worker's own manager writes to a scratch folder: the state it names is in
        # directory, where it last restored or saved.
        last = self._manager.latest_checkpoint if self._chief else self._last_path
        tasks = (failures.lost_peers(e.message) if isinstance(e, tf.errors.OpError)
                 else None)
        message = e.message if isinstance(e, tf.errors.OpError) else ""
        if tasks == [] and "://" in message and not failures.collectives_aborted(message):
            tasks = None  # A storage service's connection (gs://, s3://), not a peer.
        if tasks is not None:  # A peer that stopped aborted the save's collectives.
            kept = (f"the state of {self._short_position_of(last)} in {self.directory} is "
                    "intact and is where a rerun resumes" if last
                    else "no state was saved before")
            message = (f"The training state of {position_words((epochs, steps))} could not "
                       f"be saved; {kept}.")
            return PeerLostError(failures.peer_lost_message(tasks, message),
                                 unresponsive=failures.worker_indices(tasks))
        reason = e.strerror if isinstance(e, OSError) else re.sub(
            r"\s*\[Op:\w+\]$", "", e.message.rsplit(";", 1)[-1])
        resume = (f"the state of {self._short_position_of(last)} is intact"
                  if last else "no state was saved before")
        return StateNotSavedError(
            f"Could not save the training state of {position_words((epochs, steps))} in "
            f"{self._write_dir} "
            f"({(reason or type(e).__name__).strip()}); {resume}. Free space there (or "
            "make it writable) and run again to resume.")

    def position_of(self, path: str) -> str:
        """The position of the checkpoint at ``path`` in words (``"epoch 3 step 17"``, or
        ``"the end of epoch 2"``)."""
        return worker_contract.Position(*self._position_pair_of(path)).words

    def _short_position_of(self, path: str) -> str:
        return position_words(self._position_pair_of(path))

    def _position_pair_of(self, path: str) -> tuple[int, int]:
        """The position of a checkpoint this callback restored or saved, else the one the
        folder's position record gives it, else the one its own variables hold (a checkpoint
        of tfpar before positions were saved: its number counted epochs)."""
        name = os.path.basename(path)
        if name in self._known:
            return self._known[name]
        recorded = worker_contract.read_position(self.directory)
        if recorded is not None and recorded.checkpoint == name:
            return recorded.pair
        with contextlib.suppress(tf.errors.OpError, ValueError, LookupError):
            reader = tf.train.load_checkpoint(path)
            saved = reader.get_variable_to_shape_map()
            epochs = int(reader.get_tensor(_VALUE.format("epochs_done")))
            steps = _VALUE.format("steps_done")
            return epochs, int(reader.get_tensor(steps)) if steps in saved else 0
        return _number_of(path), 0


@contextlib.contextmanager
def _readable_checkpoint(prefix: str) -> Iterator[None]:
    """Turns TensorFlow's failures to read a damaged checkpoint's files into one clear error
    (a file cut short: ``IndexError``; bytes changed: ``DataLossError``)."""
    try:
        yield
    except (tf.errors.OpError, ValueError, LookupError, UnicodeDecodeError,
            AssertionError) as e:  # AssertionError: the model has variables it does not hold.
        if isinstance(e, DamagedStateError):
            raise
        detail = e.message if isinstance(e, tf.errors.OpError) else str(e)
        raise DamagedStateError(
            f"The checkpoint {prefix} (its files {os.path.basename(prefix)}.index and "
            f"{os.path.basename(prefix)}.data-*) cannot be restored: they are damaged, or hold "
            "another model's state. A restore reads a checkpoint of this model as TensorFlow "
            "wrote it; start over (resume=False), or use another model_dir. "
            f"Received: {type(e).__name__}: {' '.join(detail.split())[:300]}.") from None


def _text(value: Any) -> str:
    """A string tensor's value read from a checkpoint, as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


# A variable's value under its checkpoint key.
_VALUE = "{}/.ATTRIBUTES/VARIABLE_VALUE"


def _number_of(path: str) -> int:
    """The number of a checkpoint path ``.../ckpt-N``."""
    return int(path.rsplit("-", 1)[-1])
