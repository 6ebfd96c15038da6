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
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from absl import logging
from keras import tree

from tfpar.allreduce import virtual_replicas
from tfpar.allreduce.options import StepOptions
from tfpar.allreduce.step import Shapes
from tfpar.allreduce.step import declared_shapes
from tfpar.allreduce.step import split_sizes
from tfpar.allreduce.step import train_step
from tfpar.errors import ConfigError
from tfpar.strategies.base import TfparStrategy
from tfpar.strategies.refusals import KERAS_OPTIMIZER_UPDATE
from tfpar.strategies.refusals import MULTI_STEP_EXECUTION
from tfpar.strategies.refusals import OWN_STEP_WITH_VIRTUAL_REPLICAS
from tfpar.strategies.refusals import KerasStep


class _AllReduceStep(TfparStrategy):
    """The all-reduce strategies' shared part: Keras's own ``train_step`` is replaced by
    :func:`train_step`, and ``split_weights`` deal the batch out unevenly."""

    step_options: StepOptions
    # Keras's own train_step runs the all-reduce step, which applies every optimizer feature
    # exactly; a model's own train_step calls the optimizer, which cannot under tf.distribute.
    refusal_alternative = ("A model's own train_step cannot use it here; Keras's train_step "
                           "can (this strategy's step applies it exactly).")

    def _take(self, step_options: StepOptions | None) -> None:
        """Keeps the step's options (the defaults if ``None``), checked against the replicas."""
        self.step_options = step_options or StepOptions()
        # The element shapes of every dataset distributed here: the step traces them.
        self._declared: list[Shapes] = []
        self.step_options.check(self.num_replicas_in_sync, len(self.extended.worker_devices))
        if self.step_options.virtual_replicas:
            for line in virtual_replicas.start_lines(self.num_replicas_in_sync,
                                                     self.extended.worker_devices):
                logging.warning("%s", line)

    def replacement_step(self, step: KerasStep) -> Callable[..., Any] | None:
        """The all-reduce step for Keras's own ``train_step``; a model's own steps run."""
        if step.name == "train_step" and step.is_keras_own:
            return functools.partial(train_step, step.model, self.step_options,
                                     declared=tuple(self._declared))
        return None

    def experimental_distribute_dataset(self, dataset, options=None):
        """``Strategy.experimental_distribute_dataset``, split by ``split_weights`` if set, and
        by shard position under ``virtual_replicas``."""
        if self.reads_own_shares(dataset):
            if self.step_options.virtual_replicas or self.step_options.split_weights:
                raise ConfigError(
                    "virtual_replicas and split_weights cut the global batch by position, "
                    "which needs every worker to read the whole input: set "
                    "auto_shard_dataset=True (the default), or leave both options unset. "
                    "Received: auto_shard_dataset=False across "
                    f"{self.num_replicas_in_sync // len(self.extended.worker_devices)} workers.")
            return self.own_shares(dataset, options)
        dataset = self.sharded_as_asked(dataset)
        shapes = declared_shapes(dataset.element_spec)
        if shapes not in self._declared:
            self._declared.append(shapes)
        if self.step_options.virtual_replicas:
            return virtual_replicas.distribute_by_position(
                self, dataset, self.step_options.virtual_replicas, options)
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

    # A model's own train_step calls the optimizer.
    refusals = (OWN_STEP_WITH_VIRTUAL_REPLICAS, *KERAS_OPTIMIZER_UPDATE)

    def __init__(self, devices: Sequence[str], cross_device_ops: tf.distribute.CrossDeviceOps,
                 step_options: StepOptions | None = None):
        super().__init__(list(devices), cross_device_ops=cross_device_ops)
        self._take(step_options)


class MultiWorkerAllReduceStrategy(_AllReduceStep, tf.distribute.MultiWorkerMirroredStrategy):
    """``MultiWorkerMirroredStrategy`` whose ``model.fit`` steps are tfpar's all-reduce step.

    Attributes:
        step_options: The :class:`StepOptions` it trains with (``collective`` only).
    """

    refusals = (MULTI_STEP_EXECUTION, OWN_STEP_WITH_VIRTUAL_REPLICAS, *KERAS_OPTIMIZER_UPDATE)

    def __init__(self, cluster_resolver, communication_options,
                 step_options: StepOptions | None = None):
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options)
        self._take(step_options)
