"""``MirroredStrategy`` as the ``mirrored`` entry runs it."""

from __future__ import annotations

import tensorflow as tf

from tfpar.strategies.keras_accumulation import RefusesKerasGradientAccumulation


class MirroredStrategy(RefusesKerasGradientAccumulation, tf.distribute.MirroredStrategy):
    """``MirroredStrategy`` (Keras's own step) that refuses, with the alternative, the
    optimizer's gradient accumulation it cannot run."""
