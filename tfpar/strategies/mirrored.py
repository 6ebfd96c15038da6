"""``MirroredStrategy`` as the ``mirrored`` entry runs it."""

from __future__ import annotations

import tensorflow as tf

from tfpar.strategies.iterator_release import ReleasesIteratorsInBackground
from tfpar.strategies.optimizer_checks import ChecksKerasOptimizerUpdate


class MirroredStrategy(ChecksKerasOptimizerUpdate, ReleasesIteratorsInBackground,
                       tf.distribute.MirroredStrategy):
    """``MirroredStrategy`` (Keras's own step) that refuses, with the alternative, what Keras's
    optimizer cannot apply under it, warns where it trains differently from one device
    (:mod:`.optimizer_checks`), and frees its input iterators in the background."""
