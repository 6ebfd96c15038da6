"""Parallel evaluation: each replica scores its shard of every batch, the counts are summed.

Distributed test accuracy: the result equals single-device evaluation
(an exact count of correct predictions over every test example), whatever the number of
replicas or the size of the last batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfpar.data import pipelines


def _batch_counter(model: keras.Model, strategy: tf.distribute.Strategy):
    """A compiled function: a distributed batch -> [correct predictions, examples]."""

    def replica_counts(images, labels):
        logits = model(images, training=False)
        predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
        correct = tf.reduce_sum(tf.cast(tf.equal(predicted, tf.cast(labels, tf.int32)), tf.int32))
        return tf.stack([correct, tf.shape(labels)[0]])

    @tf.function
    def batch_counts(batch):
        per_replica = strategy.run(replica_counts, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return batch_counts


def _accuracy(batch_counts, dataset: tf.data.Dataset, strategy: tf.distribute.Strategy) -> float:
    totals = tf.zeros([2], tf.int64)
    for batch in pipelines.distribute(strategy, dataset):
        totals += tf.cast(batch_counts(batch), tf.int64)
    correct, count = (int(v) for v in totals.numpy())
    return correct / count if count else 0.0


def accuracy(model: keras.Model, dataset: tf.data.Dataset,
             strategy: tf.distribute.Strategy) -> float:
    """Returns the fraction of examples whose arg-max logit equals the label.

    Args:
        model: A model built under ``strategy``, mapping images to logits.
        dataset: ``(image, label)`` batches of the global batch size.
        strategy: The strategy the model was built under.

    Returns:
        Accuracy in [0, 1] (0 for an empty dataset).
    """
    return _accuracy(_batch_counter(model, strategy), dataset, strategy)


class TestAccuracy(keras.callbacks.Callback):
    """Adds ``test_accuracy`` (see :func:`accuracy`) to the logs at the end of every epoch.

    Evaluated after every epoch, for the accuracy-per-epoch plot; callbacks after this one
    (History, TensorBoard) see the figure.

    Args:
        dataset: ``(image, label)`` batches of the global batch size.
        strategy: The strategy the model was built under.
    """

    def __init__(self, dataset: tf.data.Dataset, strategy: tf.distribute.Strategy):
        super().__init__()
        self.dataset, self.strategy = dataset, strategy
        self._counts = None

    def on_epoch_end(self, epoch, logs=None):
        if self._counts is None:  # One compiled function for the whole run.
            self._counts = _batch_counter(self.model, self.strategy)
        if logs is not None:
            logs["test_accuracy"] = _accuracy(self._counts, self.dataset, self.strategy)
