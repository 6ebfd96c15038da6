"""Training functions with one signature, so a strategy's result can be compared with one device.

A training function ``train(model, dataset, strategy) -> losses`` trains ``model`` (built under
``strategy``) for one pass over ``dataset`` and returns the loss Keras logs after each step
(the running mean over the pass, as ``model.fit`` reports it).
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf

TrainFn = Callable[[keras.Model, tf.data.Dataset, tf.distribute.Strategy], list]


class _StepLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def fit_steps(model: keras.Model, dataset: tf.data.Dataset,
              strategy: tf.distribute.Strategy) -> list[float]:
    """Trains one pass over ``dataset`` with ``model.fit``; returns the per-step logged loss.

    Args:
        model: A compiled model (built under ``strategy``).
        dataset: Global batches.
        strategy: Unused by ``fit``, which takes the strategy of the model's scope; present so
            every training function has the same signature.

    Returns:
        The loss logged after each step.
    """
    del strategy  # fit uses the strategy the model was created under.
    record = _StepLosses()
    model.fit(dataset, epochs=1, verbose=0, callbacks=[record], shuffle=False)
    return record.losses
