"""``MirroredStrategy`` as the ``mirrored`` entry runs it."""

from __future__ import annotations

import tensorflow as tf

from tfpar.strategies.base import TfparStrategy
from tfpar.strategies.refusals import KERAS_OPTIMIZER_UPDATE


class MirroredStrategy(TfparStrategy, tf.distribute.MirroredStrategy):
    """``MirroredStrategy`` (Keras's own step) that refuses, with the alternative, what Keras's
    optimizer cannot apply under it and warns where it trains differently from one device
    (:mod:`tfpar.strategies.refusals`)."""

    refusals = KERAS_OPTIMIZER_UPDATE
