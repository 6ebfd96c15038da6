"""Learning-rate schedules: linear warm-up for large batches (Goyal et al., 2017), and the
train command's choice of schedule (:func:`learning_rate`).

More devices and gradient accumulation multiply the global batch; the linear scaling rule
multiplies the learning rate with it, and a few epochs of linear warm-up keep the first steps,
when the weights change fastest, from diverging. A cosine decay to 0 over the run (Keras's
``CosineDecay``, after the warm-up) ends a run with small steps, so its final weights depend
less on the last batches seen. Both are Keras ``LearningRateSchedule`` objects, so they work
under every strategy (the optimizer evaluates them at its own ``iterations``, identical on
every replica, and restored on resume).
"""

from __future__ import annotations

from typing import Any

import keras

from tfpar.training.config import LR_DECAYS


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


def learning_rate(lr: float, *, warmup_start: float = 0.0, warmup_steps: int = 0,
                  total_steps: int = 1, decay: str = "constant"
                  ) -> float | keras.optimizers.schedules.LearningRateSchedule:
    """The learning rate of a run, for an optimizer's ``learning_rate``.

    Args:
        lr: The rate after the warm-up (the peak).
        warmup_start: The rate at step 0 when there is a warm-up.
        warmup_steps: Steps of a linear rise from ``warmup_start`` to ``lr`` (0: none).
        total_steps: Steps of the whole run (updates, over every epoch).
        decay: One of ``LR_DECAYS`` (``TrainConfig.lr_decay``): ``constant`` keeps ``lr``
            after the warm-up; ``cosine`` decays it to 0 at ``total_steps`` along a half
            cosine.

    Returns:
        ``lr`` itself when nothing changes it, else a Keras ``LearningRateSchedule``.

    Raises:
        ValueError: For a decay not in ``LR_DECAYS``.
    """
    if decay not in LR_DECAYS:
        raise ValueError(f"decay must be one of {', '.join(LR_DECAYS)}. "
                         f"Received: decay={decay!r}.")
    if decay == "cosine":
        if warmup_steps:
            return keras.optimizers.schedules.CosineDecay(
                warmup_start, max(1, total_steps - warmup_steps), warmup_target=lr,
                warmup_steps=warmup_steps)
        return keras.optimizers.schedules.CosineDecay(lr, max(1, total_steps))
    return LinearWarmup(warmup_start, lr, warmup_steps) if warmup_steps else lr
