"""``OneDeviceStrategy`` as the ``one_device`` entry runs it."""

from __future__ import annotations

import tensorflow as tf

from tfpar.strategies.base import TfparStrategy


class OneDeviceStrategy(TfparStrategy, tf.distribute.OneDeviceStrategy):
    """``OneDeviceStrategy`` whose input iterators are freed in the background."""
