"""``MirroredStrategy`` as the ``mirrored`` entry runs it."""

from __future__ import annotations

import tensorflow as tf

from tfpar.strategies.iterator_release import ReleasesIteratorsInBackground
from tfpar.strategies.keras_accumulation import RefusesKerasGradientAccumulation


class MirroredStrategy(RefusesKerasGradientAccumulation, ReleasesIteratorsInBackground,
                       tf.distribute.MirroredStrategy):
    """``MirroredStrategy`` (Keras's own step) that refuses, with the alternative, the
    optimizer's gradient accumulation it cannot run, and frees its input iterators in the
    background."""
