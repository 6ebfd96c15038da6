"""The ``multi_worker`` strategy class: ``MultiWorkerMirroredStrategy`` that refuses, with its
reason, what Keras cannot run across workers.

:class:`RefusesMultiStepExecution` is shared with tfpar's own multi-worker step
(:class:`tfpar.allreduce.strategy.MultiWorkerAllReduceStrategy`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfpar.multiworker.strategy import check_steps_per_execution
from tfpar.strategies.iterator_release import ReleasesIteratorsInBackground
from tfpar.strategies.mixin_base import StrategyMixin
from tfpar.strategies.optimizer_checks import ChecksKerasOptimizerUpdate


class RefusesMultiStepExecution(StrategyMixin):
    """Mixin for a multi-worker ``tf.distribute`` strategy: a Keras step of a model compiled
    with ``steps_per_execution > 1`` raises tfpar's one-line reason (see
    :func:`~tfpar.multiworker.strategy.check_steps_per_execution`) instead of failing deep in
    TensorFlow."""

    def run(self, fn, args=(), kwargs=None, options=None):
        """``Strategy.run``, after checking the steps per execution of a Keras model's step."""
        model = getattr(fn, "__self__", None)
        if (isinstance(model, keras.Model)
                and self.num_replicas_in_sync != len(self.extended.worker_devices)):
            check_steps_per_execution(model.steps_per_execution)
        return super().run(fn, args=args, kwargs=kwargs, options=options)


class MultiWorkerStrategy(RefusesMultiStepExecution, ChecksKerasOptimizerUpdate,
                          ReleasesIteratorsInBackground, tf.distribute.MultiWorkerMirroredStrategy):
    """``MultiWorkerMirroredStrategy`` (Keras's own step) that says what it cannot run and
    frees its input iterators in the background."""
