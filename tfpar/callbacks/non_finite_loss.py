"""Stopping training at the first non-finite loss, with a message that helps.

Keras's ``TerminateOnNaN`` stops silently; :class:`StopOnNonFiniteLoss` records where it
happened so the caller can report it (and keep what was measured so far).
"""

from __future__ import annotations

import math

import keras


class StopOnNonFiniteLoss(keras.callbacks.Callback):
    """Stops training when the logged loss is NaN or infinite.

    Attributes:
        epoch: Epoch (0-based) of the first non-finite loss, or ``None``.
        step: Step within that epoch (0-based), or ``None``.
        value: The loss value.
    """

    def __init__(self):
        super().__init__()
        self._epoch = 0
        self.epoch: int | None = None
        self.step: int | None = None
        self.value: float | None = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        loss = float((logs or {}).get("loss", 0.0))
        if not math.isfinite(loss) and self.epoch is None:
            self.epoch, self.step, self.value = self._epoch, batch, loss
            self.model.stop_training = True

    @property
    def stopped(self) -> bool:
        """Whether training was stopped."""
        return self.epoch is not None
