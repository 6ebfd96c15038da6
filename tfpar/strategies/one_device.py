"""``OneDeviceStrategy`` as the ``one_device`` entry runs it."""

from __future__ import annotations

import tensorflow as tf

from tfpar.strategies.iterator_release import ReleasesIteratorsInBackground


class OneDeviceStrategy(ReleasesIteratorsInBackground, tf.distribute.OneDeviceStrategy):
    """``OneDeviceStrategy`` whose input iterators are freed in the background."""
