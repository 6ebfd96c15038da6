"""Non-trainable state that replicas update on their own, made well-defined.

With per-replica BatchNorm (the default, as in PyTorch's DataParallel), each replica updates its
copy of the moving mean and variance from its own shard, so the copies drift apart, evaluation
depends on which replica runs it, and a saved model keeps replica 0's copy. :func:`average`
replaces every replica's copy of every non-trainable variable by the mean over all replicas (of
all workers); :class:`AverageAtEpochEnd` does it after each epoch, before evaluation and saving.
(The mean of the replicas' moving variances is not the variance of the global batch; for that,
train with synchronized BatchNorm.)
"""

from __future__ import annotations

import keras
import tensorflow as tf


def averager(model: keras.Model, strategy: tf.distribute.Strategy):
    """Returns a compiled function that does :func:`average` for this model and strategy
    (``None`` when there is nothing to average); build it once and call it as often as needed.
    """
    # Floating-point ones only: a mean of integers (a Dropout's seed state) is not one of them,
    # and replicas advance those alike.
    variables = [v.value for v in model.non_trainable_variables
                 if tf.as_dtype(v.dtype).is_floating]
    if not variables or strategy.num_replicas_in_sync == 1:
        return None

    @tf.function
    def average_copies():
        def replica_means():
            # In a replica context, reading a mirrored variable gives this replica's copy.
            copies = [tf.identity(v) for v in variables]
            return tf.distribute.get_replica_context().all_reduce("MEAN", copies)

        means = strategy.run(replica_means)
        for variable, mean in zip(variables, means):
            strategy.extended.update(variable, lambda var, x: var.assign(x), args=(mean,),
                                     group=False)

    return average_copies


def average(model: keras.Model, strategy: tf.distribute.Strategy) -> None:
    """Sets every replica's copy of each non-trainable variable to the mean over replicas.

    Args:
        model: A model built under ``strategy``.
        strategy: The strategy.
    """
    run = averager(model, strategy)
    if run is not None:
        run()


class AverageAtEpochEnd(keras.callbacks.Callback):
    """Averages non-trainable variables over replicas at the end of every epoch.

    The averaging function is traced once, at the first epoch's end, and reused.

    Args:
        strategy: The strategy the model was built under (by default the model's own,
            ``model.distribute_strategy``).
    """

    def __init__(self, strategy: tf.distribute.Strategy | None = None):
        super().__init__()
        self.strategy = strategy
        self._average = None
        self._for_model = None

    def on_epoch_end(self, epoch, logs=None):
        if self._for_model is not self.model:
            strategy = self.strategy or self.model.distribute_strategy
            self._average, self._for_model = averager(self.model, strategy), self.model
        if self._average is not None:
            self._average()
