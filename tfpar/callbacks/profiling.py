"""Tracing some training steps for TensorBoard's profiler.

Keras's ``TensorBoard(profile_batch=...)`` traces too, but only together with its summaries
and only in the callback that writes them; this one drives ``tf.profiler.experimental`` alone,
so the benchmark's workers and runs without ``--logdir`` can trace. View the trace in
TensorBoard's profile tab (``pip install tensorboard-plugin-profile``; ``tensorboard --logdir
DIR``).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from absl import logging


class ProfileSteps(keras.callbacks.Callback):
    """Traces training steps ``first`` to ``last`` (1-based, inclusive) of the first epoch.

    Args:
        first: First step traced.
        last: Last step traced.
        log_dir: Where the trace is written.
    """

    def __init__(self, first: int, last: int, log_dir: str):
        super().__init__()
        if not 1 <= first <= last:
            raise ValueError(f"Profile steps are 1 <= first <= last. Received: {first}, {last}.")
        self.first, self.last, self.log_dir = first, last, log_dir
        self._step = 0
        self._active = False

    def on_train_batch_begin(self, batch, logs=None):
        self._step += 1
        if self._step == self.first and not self._active:
            tf.profiler.experimental.start(self.log_dir)
            self._active = True

    def on_train_batch_end(self, batch, logs=None):
        if self._active and self._step >= self.last:
            self._stop()

    def on_train_end(self, logs=None):
        if self._active:
            self._stop()

    def _stop(self):
        tf.profiler.experimental.stop()
        self._active = False
        logging.info("Profile of steps %d-%d written to %s", self.first, self.last,
                     self.log_dir)
