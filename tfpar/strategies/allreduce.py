"""The strategies that make ``model.fit`` run tfpar's all-reduce step (:mod:`.step`).

:class:`AllReduceStrategy` (in one process) and :class:`MultiWorkerAllReduceStrategy` (across
worker processes) are ``tf.distribute`` strategies that carry the step's options
(:class:`~tfpar.allreduce.options.StepOptions`). Keras calls ``strategy.run(model.train_step,
...)``; when ``train_step`` is Keras's own (not overridden by the model's class), these run
:func:`~tfpar.allreduce.step.train_step` in its place. A model that overrides ``train_step``
keeps its own step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import keras
import tensorflow as tf
from keras import tree

from tfpar.allreduce.options import StepOptions
from tfpar.allreduce.step import split_sizes
from tfpar.allreduce.step import train_step
from tfpar.strategies.iterator_release import ReleasesIteratorsInBackground
from tfpar.strategies.multi_worker import RefusesMultiStepExecution
from tfpar.strategies.optimizer_checks import ChecksKerasOptimizerUpdate


def is_keras_step(fn, step: str) -> bool:
    """Whether ``fn`` is a model's Keras ``step`` (``"train_step"``, ``"test_step"``) that its
    class did not override: what Keras's ``fit``/``evaluate`` pass to ``Strategy.run``."""
    return (isinstance(getattr(fn, "__self__", None), keras.Model)
            and getattr(fn, "__func__", None) is getattr(keras.Model, step))


class _AllReduceStep(ChecksKerasOptimizerUpdate, ReleasesIteratorsInBackground):
    """Mixin for a ``tf.distribute`` strategy: ``model.fit`` runs :func:`train_step` (its
    input iterators freed in the background)."""

    step_options: StepOptions
    # Keras's own train_step runs the all-reduce step, which applies every optimizer feature
    # exactly; a model's own train_step calls the optimizer, which cannot under tf.distribute.
    alternative = ("A model's own train_step cannot use it here; Keras's train_step can (this "
                   "strategy's step applies it exactly).")

    def run(self, fn, args=(), kwargs=None, options=None):
        """``Strategy.run``; Keras's own ``train_step`` is replaced by the all-reduce step.

        The step's logs are the global batch's on every replica already, so the first local
        replica's are returned as plain tensors, and :meth:`is_global_value` says so: Keras
        then logs them as they are instead of averaging every scalar across the replicas
        (across workers, a collective of 1-2 ms of latency and CPU per step).
        """
        if not is_keras_step(fn, "train_step"):
            return super().run(fn, args=args, kwargs=kwargs, options=options)  # Checks it.
        logs = super().run(functools.partial(train_step, fn.__self__, self.step_options),
                           args=args, kwargs=kwargs, options=options)
        logs = tree.map_structure(lambda v: self.experimental_local_results(v)[0], logs)
        self._global_values = {v.ref() for v in tree.flatten(logs) if isinstance(v, tf.Tensor)}
        return logs

    def is_global_value(self, value) -> bool:
        """Whether ``value`` is a log of the all-reduce step: the same on every replica and
        worker, so there is nothing to reduce (the
        :class:`tfpar.compat.keras_fixes.ReportsGlobalValues` protocol)."""
        return isinstance(value, tf.Tensor) and value.ref() in getattr(self, "_global_values", ())

    def experimental_distribute_dataset(self, dataset, options=None):
        """``Strategy.experimental_distribute_dataset``, split by ``split_weights`` if set."""
        weights = self.step_options.split_weights
        if weights is None:
            return super().experimental_distribute_dataset(dataset, options)
        replicas = self.num_replicas_in_sync

        def shards(*batch):
            # One global batch becomes `replicas` consecutive elements, which the strategy
            # deals out to the replicas in turn.
            element = batch[0] if len(batch) == 1 else batch
            size = tf.shape(next(t for t in tree.flatten(element) if t is not None))[0]
            sizes = split_sizes(size, weights)
            starts = tf.cumsum(sizes, exclusive=True)
            return tf.data.Dataset.range(replicas).map(
                lambda r: tree.map_structure(
                    lambda t: t[starts[r]:starts[r] + sizes[r]], element))

        split = dataset.flat_map(shards)
        return self.distribute_datasets_from_function(lambda _: split, options)


class AllReduceStrategy(_AllReduceStep, tf.distribute.MirroredStrategy):
    """``MirroredStrategy`` whose ``model.fit`` steps are tfpar's exact all-reduce step.

    Attributes:
        step_options: The :class:`StepOptions` it trains with.
    """

    def __init__(self, devices: Sequence[str], cross_device_ops: tf.distribute.CrossDeviceOps,
                 step_options: StepOptions | None = None):
        super().__init__(list(devices), cross_device_ops=cross_device_ops)
        step_options = step_options or StepOptions()
        step_options.check(self.num_replicas_in_sync, len(self.extended.worker_devices))
        self.step_options = step_options


class MultiWorkerAllReduceStrategy(RefusesMultiStepExecution, _AllReduceStep,
                                   tf.distribute.MultiWorkerMirroredStrategy):
    """``MultiWorkerMirroredStrategy`` whose ``model.fit`` steps are tfpar's all-reduce step.

    Attributes:
        step_options: The :class:`StepOptions` it trains with (``collective`` only).
    """

    def __init__(self, cluster_resolver, communication_options,
                 step_options: StepOptions | None = None):
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options)
        step_options = step_options or StepOptions()
        step_options.check(self.num_replicas_in_sync, len(self.extended.worker_devices))
        self.step_options = step_options
