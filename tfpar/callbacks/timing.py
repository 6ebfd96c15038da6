"""Epoch timing as a Keras callback: seconds per epoch and images per second.

The first epoch includes tracing and compilation, so it is reported apart from the steady
epochs after it. Figures are written into ``logs`` (``epoch_seconds``, ``images_per_second``),
so they appear in ``History`` and in TensorBoard when this callback comes before those.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import keras


class EpochTimer(keras.callbacks.Callback):
    """Measures wall-clock seconds and images per second of every training epoch.

    Args:
        examples_per_epoch: Training examples in one epoch (for images per second).
        clock: Returns seconds; injectable for tests.

    Attributes:
        epoch_seconds: Seconds of each finished epoch, in order.
    """

    def __init__(self, examples_per_epoch: int, clock: Callable[[], float] = time.perf_counter):
        super().__init__()
        if examples_per_epoch < 1:
            raise ValueError("examples_per_epoch must be >= 1. "
                             f"Received: examples_per_epoch={examples_per_epoch}.")
        self.examples_per_epoch = examples_per_epoch
        self._clock = clock
        self._start = 0.0  # Set when each epoch begins.
        self._first_step: int | None = None  # The epoch's first step run (a resumed one's > 0).
        self.epoch_seconds: list[float] = []
        #: Examples each finished epoch trained on (fewer in one resumed inside the epoch).
        self.epoch_examples: list[int] = []

    def on_train_begin(self, logs=None):
        self.epoch_seconds, self.epoch_examples = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._first_step = self._clock(), None

    def on_train_batch_begin(self, batch, logs=None):
        if self._first_step is None:
            self._first_step = batch

    def on_epoch_end(self, epoch, logs=None):
        seconds = self._clock() - self._start
        steps = (self.params or {}).get("steps")
        examples = self.examples_per_epoch
        if steps and self._first_step:  # Resumed inside the epoch: only its rest ran.
            examples = round(examples * (steps - self._first_step) / steps)
        self.epoch_seconds.append(seconds)
        self.epoch_examples.append(examples)
        if logs is not None:
            logs["epoch_seconds"] = seconds
            logs["images_per_second"] = examples / seconds

    @property
    def first_epoch_seconds(self) -> float:
        """Seconds of the first epoch (tracing and compilation included)."""
        if not self.epoch_seconds:
            raise ValueError("No epoch has finished yet.")
        return self.epoch_seconds[0]

    @property
    def steady_epoch_seconds(self) -> float:
        """Mean seconds of the epochs after the first (the first's when there is one epoch)."""
        if not self.epoch_seconds:
            raise ValueError("No epoch has finished yet.")
        steady = self.epoch_seconds[1:] or self.epoch_seconds
        return statistics.fmean(steady)

    @property
    def steady_images_per_second(self) -> float:
        """Images per second over the steady epochs."""
        examples = self.epoch_examples[1:] or self.epoch_examples or [self.examples_per_epoch]
        return statistics.fmean(examples) / self.steady_epoch_seconds
