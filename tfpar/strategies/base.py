"""The base of every tfpar strategy class: what it refuses (data, checked once in the one
``run`` override), the step hook that lets a strategy run a step of its own in place of
Keras's, the global-logs contract, and what every tfpar strategy does when it is built.

A strategy class is ``class MyStrategy(TfparStrategy, tf.distribute.SomeStrategy)``, with:

- :attr:`TfparStrategy.refusals`: the :class:`~tfpar.strategies.refusals.Refusal` s checked on
  every model step Keras asks it to run (:mod:`tfpar.strategies.refusals`);
- :meth:`TfparStrategy.replacement_step`: the step hook (``None``: Keras's step runs);
- :meth:`TfparStrategy.is_global_value`: whether a log of a replaced step is already the same
  on every replica and worker (the
  :class:`~tfpar.compat.keras_fixes.scalar_logs.ReportsGlobalValues` protocol).

When it is built it checks ``TF_CONFIG`` first (TensorFlow's strategies parse it and fail with
a JSON traceback on a malformed one) and, with several replicas, installs tfpar's fixes of
Keras (:mod:`tfpar.compat.keras_fixes`). Its input iterators are freed on background threads
(:mod:`tfpar.compat.iterator_release`), so ``fit`` and its epochs end when their last step does;
with one replica on the CPU, ``fit`` reads the dataset as plain Keras does.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import ClassVar

import tensorflow as tf
from keras import tree

from tfpar import backup_saver
from tfpar import errors
from tfpar.cluster import peers as cluster_peers
from tfpar.cluster import spec as cluster_spec
from tfpar.compat import keras_fixes
from tfpar.compat.iterator_release import releasing_iterators
from tfpar.strategies.refusals import KERAS_STEP_EMPTY_REPLICA
from tfpar.strategies.refusals import MODEL_BUILT_ELSEWHERE
from tfpar.strategies.refusals import XLA_ON_CPU_REPLICAS
from tfpar.strategies.refusals import KerasStep
from tfpar.strategies.refusals import Refusal
from tfpar.strategies.refusals import empty_replica_fails

if TYPE_CHECKING:  # A tf.distribute.Strategy for type checkers; ``object`` at run time.
    from tensorflow.distribute import Strategy as _StrategyBase
else:
    _StrategyBase = object

# Keras's BackupAndRestore, as tfpar's fix of it runs, saves through tfpar's saver.
keras_fixes.use_backup_saver(backup_saver)


def _refusing_an_empty_replica(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (Keras's step), which first asserts its replica got examples
    (:data:`~tfpar.strategies.refusals.KERAS_STEP_EMPTY_REPLICA`, raised by ``fit`` as one
    line)."""

    def step(data, *args, **kwargs):
        first = next((t for t in tree.flatten(data) if tf.is_tensor(t) and t.shape.rank), None)
        if first is None:
            return fn(data, *args, **kwargs)
        check = tf.debugging.Assert(tf.shape(first)[0] > 0,
                                    [errors.RUN_TIME_REFUSAL + KERAS_STEP_EMPTY_REPLICA])
        with tf.control_dependencies([check]):
            return fn(data, *args, **kwargs)

    return step


class TfparStrategy(_StrategyBase):
    """The base of tfpar's ``tf.distribute`` strategy classes (inherit it before the
    ``tf.distribute`` class).

    Attributes:
        refusals: What it cannot run, checked on each model step before the step runs.
        refusal_alternative: What to do instead, for the refusals' messages (a sentence).
    """

    refusals: ClassVar[tuple[Refusal, ...]] = ()
    #: Checked under every tfpar strategy, before the class's own :attr:`refusals`.
    common_refusals: ClassVar[tuple[Refusal, ...]] = (MODEL_BUILT_ELSEWHERE,
                                                      XLA_ON_CPU_REPLICAS)
    refusal_alternative: ClassVar[str] = (
        "Train with the 'allreduce' strategy (or 'multi_worker_allreduce' across workers), "
        "whose step applies it exactly.")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if os.environ.get("TF_CONFIG"):
            cluster_spec.parse_tf_config(os.environ["TF_CONFIG"])
        super().__init__(*args, **kwargs)
        if self.num_replicas_in_sync > 1:  # Keras's defects are in the several-replica paths.
            keras_fixes.install()
        else:  # A backup a run of several replicas wrote is read the same way on one.
            keras_fixes.install(keras_fixes.BACKUP_AND_RESTORE)

    def replacement_step(self, step: KerasStep) -> Callable[..., Any] | None:
        """The step hook: a function to run in place of ``step``, or ``None`` for ``step``.

        Args:
            step: The model's step Keras asked to run.

        Returns:
            ``fn(*args, **kwargs)`` run on each replica instead; its logs are the global
            batch's on every replica already (see :meth:`is_global_value`).
        """
        del step
        return None

    def run(self, fn, args=(), kwargs=None, options=None):
        """``Strategy.run``; a model's step is checked against :attr:`refusals` first, and runs
        as :meth:`replacement_step` says.

        A replaced step's logs are returned as the first local replica's plain tensors, and
        :meth:`is_global_value` says so: Keras then logs them as they are instead of averaging
        every scalar across the replicas (across workers, one collective more per step).
        """
        step = KerasStep.of(fn)
        replacement = None if step is None else self.replacement_step(step)
        if step is not None:
            step = dataclasses.replace(step, replaced=replacement is not None)
            for refusal in (*self.common_refusals, *self.refusals):
                refusal(self, step)
        if replacement is None:
            if step is not None and empty_replica_fails(self, step):
                fn = _refusing_an_empty_replica(fn)
            return super().run(fn, args=args, kwargs=kwargs, options=options)
        logs = super().run(replacement, args=args, kwargs=kwargs, options=options)
        logs = tree.map_structure(lambda v: self.experimental_local_results(v)[0], logs)
        self._global_values = {v.ref() for v in tree.flatten(logs) if isinstance(v, tf.Tensor)}
        return logs

    def is_global_value(self, value: Any) -> bool:
        """Whether ``value`` is a log of a replaced step: the same on every replica and worker,
        so there is nothing to reduce (the
        :class:`tfpar.compat.keras_fixes.scalar_logs.ReportsGlobalValues` protocol)."""
        return isinstance(value, tf.Tensor) and value.ref() in getattr(self, "_global_values", ())

    def experimental_distribute_dataset(self, dataset, options=None):
        """``Strategy.experimental_distribute_dataset``, iterators freed in the background.

        With one replica on the host's CPU there is nothing to distribute, and the dataset
        comes back as a dataset: ``fit`` then reads it through its own iterator, as plain Keras
        does, rather than through TensorFlow's per-device ``MultiDeviceIterator``, whose get-next
        sits inside every compiled step (slower for short steps; the benchmarks page has the
        figures). On a GPU, or with ``options``, the input
        path is TensorFlow's (which prefetches onto the device).
        """
        if self.reads_own_shares(dataset):
            return self.own_shares(dataset, options)
        dataset = self.sharded_as_asked(dataset)
        if options is None and self._is_one_host_replica():
            # A new dataset object (same pipeline): the user's own is left as it was.
            return releasing_iterators(dataset.with_options(tf.data.Options()))
        return releasing_iterators(super().experimental_distribute_dataset(dataset, options))

    def sharded_as_asked(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """``dataset``, left unsharded across workers where its strategy was made for a
        ``keras.distribution.DataParallel(auto_shard_dataset=False)``
        (:mod:`tfpar.keras_distribution`): each worker reads its own input then."""
        if getattr(self, "tfpar_auto_shard", True) or not isinstance(dataset, tf.data.Dataset):
            return dataset
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        return dataset.with_options(options)

    def reads_own_shares(self, dataset: Any) -> bool:
        """Whether each worker's ``dataset`` is its own share of the global batch: a job of
        several workers whose strategy was made for a
        ``keras.distribution.DataParallel(auto_shard_dataset=False)``."""
        return (not getattr(self, "tfpar_auto_shard", True)
                and isinstance(dataset, tf.data.Dataset)
                and self.num_replicas_in_sync > len(self.extended.worker_devices))

    def own_shares(self, dataset: tf.data.Dataset, options: Any = None) -> Any:
        """Each worker's ``dataset`` as its share of every global batch (its batch of step
        ``k`` and every other worker's make global batch ``k``), cut into its local replicas'
        pieces, the first ``size mod replicas`` one example longer. (TensorFlow's own
        ``experimental_distribute_dataset`` takes a worker's batch for the global batch and
        deals its pieces to the job's replicas, so a step would train on a worker's batch
        divided by the workers, and an epoch would leave examples out.)"""
        self._check_same_batches(int(dataset.cardinality()))
        local = len(self.extended.worker_devices)
        if local > 1:
            def pieces(*batch):
                element = batch[0] if len(batch) == 1 else batch
                size = tf.shape(next(t for t in tree.flatten(element) if t is not None))[0]
                sizes = size // local + tf.cast(tf.range(local) < size % local, size.dtype)
                starts = tf.cumsum(sizes, exclusive=True)
                return tf.data.Dataset.range(local).map(
                    lambda r: tree.map_structure(
                        lambda t: t[starts[r]:starts[r] + sizes[r]], element))

            dataset = dataset.flat_map(pieces)
        options_off = tf.data.Options()
        options_off.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        dataset = dataset.with_options(options_off)
        return self.distribute_datasets_from_function(lambda _: dataset, options)

    def _check_same_batches(self, batches: int) -> None:
        """Refuses, in one line, workers whose own datasets give unequal numbers of batches
        (where each knows its number): TensorFlow's collectives would fail in the step after
        the shortest ends, with an error of their own."""
        self._own_share_calls = getattr(self, "_own_share_calls", 0) + 1
        counts = cluster_peers.counts_of_every_worker(
            self.cluster_resolver, f"own_batches/{self._own_share_calls}", batches,
            "how many batches its own input gives", cluster_peers.COUNT_WAIT_SECONDS)
        known = {task: n for task, n in counts.items() if n >= 0}
        if len(set(known.values())) > 1:
            each = ", ".join(f"{job} {index}: {n}" for (job, index), n in known.items())
            raise errors.ConfigError(
                "Under auto_shard_dataset=False each worker's batch of a step is its share of "
                "the step's global batch, so every worker's input must give as many batches; "
                f"this job's give {each}.")

    def _is_one_host_replica(self) -> bool:
        devices = self.extended.worker_devices
        return (self.num_replicas_in_sync == 1 and len(devices) == 1
                and tf.DeviceSpec.from_string(devices[0]).device_type == "CPU")

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """``Strategy.distribute_datasets_from_function``, iterators freed in the background."""
        return releasing_iterators(super().distribute_datasets_from_function(dataset_fn,
                                                                             options))
