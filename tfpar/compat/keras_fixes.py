"""Fixes for seven defects of Keras 3 under ``tf.distribute``, installed by tfpar.

1. **Symbolic build** (``TensorFlowTrainer._maybe_symbolic_build``). A model created under a
   strategy scope is built at the start of ``fit``/``evaluate`` from the first distributed
   batch, *averaged across replicas* (``strategy.reduce("MEAN", batch)``) just to learn the
   input shapes. That crashes under ``MirroredStrategy`` when the first batch does not split
   evenly over the replicas (``AddN ... must have the same size and shape``, e.g. a batch of 5
   on 2 devices), and under ``MultiWorkerMirroredStrategy`` always (``Attempt to convert a
   value (PerReplica...)``, keras-team/keras#20585, tensorflow/tensorflow#72388). The fix hands
   Keras's own method the first local replica's shard as ``data_batch`` instead.
2. **Scalar logs across workers** (``reduce_per_replica``). Keras averages per-replica logs
   of a multi-worker strategy with ``strategy.reduce("MEAN", v, axis=0)``; a scalar has no axis
   0 (``Invalid reduction dimension 0 for input with 0 dimensions``), so ``fit`` stops after
   the first step. The fix reduces scalars with ``axis=None``, all of a dtype in one
   collective (Keras would issue one per log per step), returns values the strategy says are
   global already (``strategy.is_global_value``: the all-reduce step's logs) as they are, and
   leaves everything else to Keras's own function.

3. **Several steps per compiled call across workers** (``make_train_function``,
   ``make_test_function``). Keras's loop for ``steps_per_execution > 1`` fails across workers
   at its first call (keras-team/keras#19246; the cause is TensorFlow's, see
   :mod:`tfpar.compat.collective_keys`). The fix traces the functions those methods make under
   :func:`tfpar.compat.collective_keys.assigned_when_traced`, only with several workers and
   ``steps_per_execution > 1``.
4. **Metrics under ``central_storage``** (``Variable.assign_add``/``assign_sub`` of Keras's
   TensorFlow backend). Keras 3 adds to a variable by assigning it ``self + value``: a read,
   then a write. ``CentralStorageStrategy`` keeps one copy of a metric's variables and sums
   what every replica assigns, so each step adds the old total once per replica: after three
   steps of a ``Mean`` on two replicas the count was 14 instead of 6, and ``fit``'s logged
   loss and metrics, ``evaluate`` (Keras's ``test_step`` or a model's own) and validation were
   wrong. The fix adds through TensorFlow's own ``assign_add``/``assign_sub`` there, which the
   strategy sums as increments; everywhere else Keras's code runs.

5. **A model's own step logs a fraction of the loss** (``scale_loss_for_distribution``,
   ``Loss.__call__``, ``Trainer.compute_loss``, ``Mean.update_state``). Inside a replica
   context of N replicas, a Keras loss and ``compute_loss`` return the loss divided by N, so
   that the replicas' gradients sum to the batch's. Keras's own steps multiply it back before
   their loss tracker sees it; a model's own ``train_step``/``test_step`` written as keras.io's
   "customizing what happens in fit" guide teaches (``loss = self.compute_loss(...)``, then
   ``metric.update_state(loss)`` for the metric named ``"loss"``) logged and evaluated 1/N of
   the loss (0.817 against 1.635 on one device, 2 replicas). The fix marks the values Keras
   scaled by 1/N (the output of a ``Loss`` call or of Keras's ``compute_loss`` during which
   Keras scaled), and a ``Mean`` metric given such a value records it times N. Gradients are
   untouched, and a value the user scaled back (``loss * N``) is a new, unmarked one.

6. **``BackupAndRestore`` across workers** (its ``_save_model``, ``on_train_end``,
   ``on_epoch_begin``). Every worker wrote the same backup file (h5py's "unable to lock file"
   at the first save on one machine) and deleted the folder at the end. The fix lets the
   chief (``strategy.extended.should_checkpoint``) write and delete, and has every other
   worker save to a scratch folder it deletes (saving may need every worker). With an integer
   ``save_freq`` Keras also recorded the wrong epoch: a state saved after an epoch's last batch
   as that epoch (resumed, it ran the epoch again), and every save after a resume counted the
   epochs from 0; the fix records the epochs finished. It also records the step inside the
   epoch a mid-epoch state resumes at, and the epoch's metrics until then (Keras saves the
   batch but never reads it): with fix 7, a resumed ``fit`` continues at that step.
7. **``fit`` cannot start inside an epoch** (``EpochIterator._enumerate_iterator``): see
   :mod:`tfpar.compat.mid_epoch_resume`.

No public Keras API exposes the TensorFlow trainer, its symbolic build, its reduction of logs
or how its variables add, so the fixes wrap these private attributes of
``keras.src.backend.tensorflow`` (the originals are kept and called). Each wrapper acts only
where its defect is (several replicas; several workers; central storage) and calls Keras's own
code everywhere else.

They are applied only on the Keras versions they were verified against
(:data:`VERIFIED_KERAS`); on others tfpar warns once and leaves Keras alone, and ``tfpar-env``
says so. ``TFPAR_KERAS_FIXES=force`` applies them anyway (to check a new Keras release, see
DEVELOPERS.md), ``=off`` never. Every tfpar strategy of more than one replica installs them
when it is built (:class:`tfpar.strategies.base.TfparStrategy`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from typing import Any
from typing import Protocol
from typing import runtime_checkable

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from keras import tree

from tfpar.compat import collective_keys
from tfpar.compat import mid_epoch_resume
from tfpar.compat import versions

# The Keras versions the fixes were verified against (the defective code is unchanged from 3.0
# to 3.15), and the switch: shared with every Keras workaround (tfpar.compat.versions).
VERIFIED_KERAS = versions.VERIFIED_KERAS
MODE_ENV = versions.KERAS_MODE_ENV


@runtime_checkable
class ReportsGlobalValues(Protocol):
    """What a strategy whose own training step returns logs that are already the same on
    every replica and worker implements, so that the scalar-logs fix does not reduce them
    again (Keras's own word for such a value, in ``reduce_per_replica``, is ``"first"``).
    tfpar's all-reduce strategies implement it (:mod:`tfpar.strategies.allreduce`)."""

    def is_global_value(self, value: Any) -> bool:
        """Whether ``value``, a log of this strategy's step, is global already."""


def _tf_trainer() -> Any:
    """Keras's TensorFlow trainer module. See the module docstring: no public API serves; it
    is imported only behind the version gate (:func:`skip_reason`), and each fix has a test
    that fails without it (tests/compat/keras_fixes_test.py)."""
    return importlib.import_module("keras.src.backend.tensorflow.trainer")


def _epoch_iterator() -> Any:
    """Keras's epoch iterator class (see :mod:`tfpar.compat.mid_epoch_resume`)."""
    return importlib.import_module("keras.src.trainers.epoch_iterator").EpochIterator


def _several_workers(strategy: tf.distribute.Strategy) -> bool:
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.num_replicas_in_sync != len(strategy.extended.worker_devices))


def _wrap_symbolic_build(original: Callable) -> Callable:
    @functools.wraps(original)
    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or strategy is None or strategy.num_replicas_in_sync == 1:
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            data_batch = tree.map_structure(
                lambda v: (strategy.experimental_local_results(v)[0]
                           if isinstance(v, tf.distribute.DistributedValues) else v),
                next(it))
            break
        return original(self, data_batch=data_batch)

    return maybe_symbolic_build


def _wrap_reduce_per_replica(original: Callable) -> Callable:
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not _several_workers(strategy):
            return original(values, strategy, reduction)
        is_global = (strategy.is_global_value if isinstance(strategy, ReportsGlobalValues)
                     else lambda value: False)
        flat = tree.flatten(values)
        reduced = [v if is_global(v) else None for v in flat]
        scalars: dict[tf.DType, list[int]] = {}
        for i, v in enumerate(flat):
            if reduced[i] is not None:
                continue
            # With one local replica, per-replica values arrive as plain tensors.
            local = strategy.experimental_local_results(v)[0]
            if tf.is_tensor(local) and local.shape.rank == 0:
                scalars.setdefault(local.dtype, []).append(i)
            else:
                reduced[i] = original(v, strategy, reduction)
        # Every scalar log of a dtype in one collective (Keras: one each), since a collective
        # across workers costs a round trip however small it is.
        for indices in scalars.values():
            stacked = strategy.run(lambda *logs: tf.stack(logs),
                                   args=tuple(flat[i] for i in indices))
            means = tf.unstack(strategy.reduce("MEAN", stacked, axis=None), len(indices))
            for i, mean in zip(indices, means):
                reduced[i] = mean
        return tree.pack_sequence_as(values, reduced)

    return reduce_per_replica


def _wrap_make_function(original: Callable, attribute: str) -> Callable:
    @functools.wraps(original)
    def make_function(self, force=False):
        made = original(self, force=force)
        function = getattr(self, attribute)
        if (function is None or getattr(function, "_tfpar_keys_when_traced", False)
                or self.steps_per_execution == 1
                or not _several_workers(self.distribute_strategy)
                or collective_keys.skip_reason()):
            return made

        @functools.wraps(function)
        def keys_when_traced(*args, **kwargs):
            with collective_keys.assigned_when_traced():
                return function(*args, **kwargs)

        keys_when_traced._tfpar_keys_when_traced = True  # type: ignore[attr-defined]
        setattr(self, attribute, keys_when_traced)
        return made if made is None else keys_when_traced

    return make_function


def _tf_core() -> Any:
    """Keras's TensorFlow variable module (imported behind the gate, as :func:`_tf_trainer`)."""
    return importlib.import_module("keras.src.backend.tensorflow.core")


def _wrap_aggregating_add(original: Callable, method: str) -> Callable:
    @functools.wraps(original)
    def add(self, value):
        variable = self._value
        if (tf.distribute.in_cross_replica_context()
                or not isinstance(tf.distribute.get_strategy(),
                                  tf.distribute.experimental.CentralStorageStrategy)
                or getattr(variable, "aggregation", None) in (None, tf.VariableAggregation.NONE)):
            return original(self, value)
        return getattr(variable, method)(tf.cast(value, variable.dtype))

    return add


def _loss_module() -> Any:
    """Keras's loss module, whose ``scale_loss_for_distribution`` every Keras loss and the
    TensorFlow trainer call by module attribute (imported behind the gate)."""
    return importlib.import_module("keras.src.losses.loss")


def _trainer_base() -> Any:
    """Keras's backend-neutral ``Trainer``, which defines ``compute_loss``."""
    return importlib.import_module("keras.src.trainers.trainer").Trainer


# The replica counts Keras divided losses by while a Loss call or compute_loss ran (a stack of
# lists per thread: nested calls report to the outer one), and the values it returned.
_scales = threading.local()
_marked: dict[int, tuple[weakref.ref, int]] = {}


def _mark(value: Any, replicas: int) -> None:
    key = id(value)

    def forget(_: weakref.ref) -> None:
        _marked.pop(key, None)

    _marked[key] = (weakref.ref(value, forget), replicas)


def replicas_scaled(value: Any) -> int:
    """N when ``value`` is a loss Keras divided by N replicas for the gradient, else 1."""
    entry = _marked.get(id(value))
    return entry[1] if entry is not None and entry[0]() is value else 1


@contextlib.contextmanager
def _recording_scales():
    outer = getattr(_scales, "current", None)
    inner: list[int] = []
    _scales.current = inner
    try:
        yield inner
    finally:
        _scales.current = outer
        if outer is not None:
            outer.extend(inner)


def _wrap_scale(original: Callable) -> Callable:
    @functools.wraps(original)
    def scale_loss_for_distribution(value):
        scaled = original(value)
        current = getattr(_scales, "current", None)
        if scaled is not value and current is not None:
            current.append(tf.distribute.get_strategy().num_replicas_in_sync)
        return scaled

    return scale_loss_for_distribution


def _wrap_marking(original: Callable) -> Callable:
    """Marks what ``original`` (a Loss call, ``compute_loss``) returns when Keras scaled during
    it, by one replica count."""
    @functools.wraps(original)
    def marking(*args, **kwargs):
        with _recording_scales() as scales:
            result = original(*args, **kwargs)
        if scales and len(set(scales)) == 1 and tf.is_tensor(result):
            _mark(result, scales[0])
        return result

    return marking


def _wrap_mean_update(original: Callable) -> Callable:
    @functools.wraps(original)
    def update_state(self, values, sample_weight=None):
        replicas = replicas_scaled(values)
        if replicas > 1:
            values = values * tf.cast(replicas, values.dtype)
        return original(self, values, sample_weight=sample_weight)

    return update_state


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
        # Read on every worker: a multi-worker strategy sums metric variables in a collective.
        metrics = mid_epoch_resume.metric_values(self.model)
        try:
            if _writes_checkpoints(self):
                saved = original(self)
                _record_step(self._training_metadata_path, next_step, metrics)
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
# the resumed run starts at, and the epoch's metric values until then.
STEP_KEY, METRICS_KEY = "tfpar_next_step", "tfpar_metrics"


def _record_step(metadata_path: str, next_step: int, metrics: list[np.ndarray]) -> None:
    """Adds the step and the metrics to Keras's metadata file, replaced as a whole."""
    with open(metadata_path, encoding="utf-8") as f:
        metadata = json.load(f)
    metadata[STEP_KEY] = next_step
    metadata[METRICS_KEY] = [v.tolist() for v in metrics]
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


@dataclasses.dataclass(frozen=True)
class Fix:
    """One fix: which attribute of which object it wraps, and how.

    Attributes:
        name: Short name (``tfpar-env`` shows it).
        description: What it fixes, in one line.
        owner: Returns the object whose attribute is wrapped.
        attribute: The attribute.
        wrap: Returns the wrapper of the original.
    """

    name: str
    description: str
    owner: Callable[[], Any]
    attribute: str
    wrap: Callable[[Callable], Callable]


FIXES = (
    Fix("symbolic_build", "fit/evaluate build the model from one replica's shard, not a "
        "cross-replica mean (uneven batches; multi_worker)",
        lambda: _tf_trainer().TensorFlowTrainer, "_maybe_symbolic_build", _wrap_symbolic_build),
    Fix("reduce_per_replica", "scalar logs of multi-worker replicas reduced with axis=None, "
        "in one collective; logs global already are not reduced again",
        _tf_trainer, "reduce_per_replica", _wrap_reduce_per_replica),
    *(Fix(f"multi_step_{kind}_function", f"several steps per compiled call of {uses} run "
          "across workers (the function's collectives keyed when traced)",
          lambda: _tf_trainer().TensorFlowTrainer, f"make_{kind}_function",
          functools.partial(_wrap_make_function, attribute=f"{kind}_function"))
      for kind, uses in (("train", "fit"), ("test", "evaluate and validation"))),
    Fix("aggregating_assign_add", "metric variables under central_storage add increments, "
        "not each replica's read-then-write (loss, metrics, evaluate)",
        lambda: _tf_core().Variable, "assign_add",
        functools.partial(_wrap_aggregating_add, method="assign_add")),
    Fix("aggregating_assign_sub", "the same for assign_sub",
        lambda: _tf_core().Variable, "assign_sub",
        functools.partial(_wrap_aggregating_add, method="assign_sub")),
    Fix("scaled_loss_records", "the losses Keras divides by the replica count for the "
        "gradient are recorded", _loss_module, "scale_loss_for_distribution", _wrap_scale),
    Fix("scaled_loss_marks", "a Keras loss's value divided by the replica count is marked so",
        lambda: keras.losses.Loss, "__call__", _wrap_marking),
    Fix("scaled_compute_loss_marks", "the same for Keras's compute_loss",
        _trainer_base, "compute_loss", _wrap_marking),
    Fix("backup_chief_writes", "BackupAndRestore: the chief writes the backup, other workers "
        "a scratch folder; a state saved after an epoch's last batch resumes at the next",
        lambda: keras.callbacks.BackupAndRestore, "_save_model", _wrap_backup_save),
    Fix("backup_chief_deletes", "BackupAndRestore: only the chief deletes the backup at the end",
        lambda: keras.callbacks.BackupAndRestore, "on_train_end", _wrap_backup_train_end),
    Fix("backup_epoch_count", "BackupAndRestore: saves after a resume record the epochs "
        "finished, not those since the resume",
        lambda: keras.callbacks.BackupAndRestore, "on_epoch_begin", _wrap_backup_epoch_begin),
    Fix("mid_epoch_start", "fit starts a resumed epoch at the step its state was saved at "
        "(EpochCheckpoint, BackupAndRestore(save_freq=N)), the batches before it drawn, not "
        "trained on", _epoch_iterator, "_enumerate_iterator",
        mid_epoch_resume.wrap_enumerate_iterator),
    Fix("mean_of_scaled_losses", "a Mean metric given a marked loss records the whole loss "
        "(a model's own train_step/test_step logs what one device logs)",
        lambda: keras.metrics.Mean, "update_state", _wrap_mean_update),
)

_originals: dict[str, Callable] = {}
_skipped: list[str] = []  # Why the fixes were not applied, once known.


def skip_reason() -> str | None:
    """Why the fixes would not be applied on this Keras (``None``: they would)."""
    reason = versions.keras_skip_reason(keras.version())
    if reason:
        return reason
    try:
        missing = [f"{f.attribute}" for f in FIXES if not hasattr(f.owner(), f.attribute)]
    except ImportError as e:
        return f"Keras {keras.version()} has no {e.name}"
    if missing:
        return f"Keras {keras.version()} has no {', '.join(missing)}"
    return None


def install(names: tuple[str, ...] | None = None) -> None:
    """Installs the fixes (all, or those named), once; idempotent.

    On a Keras they were not verified against, warns once and installs nothing.
    """
    reason = skip_reason()
    if reason:
        if not _skipped:
            _skipped.append(reason)
            logging.warning("tfpar's fixes for Keras fit under tf.distribute are not applied: "
                            "%s. Uneven batches under 'mirrored' and fit under multi_worker may "
                            "fail.", reason)
        return
    for fix in FIXES:
        if (names is None or fix.name in names) and fix.name not in _originals:
            owner = fix.owner()
            _originals[fix.name] = getattr(owner, fix.attribute)
            setattr(owner, fix.attribute, fix.wrap(_originals[fix.name]))


def uninstall(names: tuple[str, ...] | None = None) -> None:
    """Restores Keras's own code (all, or the fixes named): for tests that show the defects."""
    for fix in FIXES:
        if (names is None or fix.name in names) and fix.name in _originals:
            setattr(fix.owner(), fix.attribute, _originals.pop(fix.name))


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
            "fixes": {f.name: f.description for f in FIXES}}
