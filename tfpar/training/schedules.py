"""Learning-rate schedules for large batches: linear warm-up (Goyal et al., 2017).

More devices and gradient accumulation multiply the global batch; the linear scaling rule
multiplies the learning rate with it, and a few epochs of linear warm-up keep the first steps,
when the weights change fastest, from diverging. :class:`LinearWarmup` is a Keras
``LearningRateSchedule``, so it works under every strategy (the optimizer evaluates it at its
own ``iterations``, identical on every replica).
"""

from __future__ import annotations

from typing import Any

import keras


@keras.saving.register_keras_serializable(package="tfpar")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Rises linearly from ``initial`` to ``target`` over ``warmup_steps`` steps, then stays.

    Args:
        initial: Learning rate at step 0.
        target: Learning rate from step ``warmup_steps`` on.
        warmup_steps: Steps of the rise (>= 1).
    """

    def __init__(self, initial: float, target: float, warmup_steps: int):
        self.initial = float(initial)
        self.target = float(target)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        progress = keras.ops.minimum(
            keras.ops.cast(step, "float32") / float(max(self.warmup_steps, 1)), 1.0)
        return self.initial + (self.target - self.initial) * progress

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments (Keras serialization)."""
        return {"initial": self.initial, "target": self.target,
                "warmup_steps": self.warmup_steps}
