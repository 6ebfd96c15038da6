"""``CentralStorageStrategy`` as the ``central_storage`` entry runs it."""

from __future__ import annotations

import tensorflow as tf

from tfpar.strategies.base import TfparStrategy
from tfpar.strategies.refusals import CLIPPING_PER_REPLICA
from tfpar.strategies.refusals import KERAS_UPDATE_IN_COND
from tfpar.strategies.refusals import REPLICA_ASSIGNS


class CentralStorageStrategy(TfparStrategy, tf.distribute.experimental.CentralStorageStrategy):
    """``CentralStorageStrategy`` that refuses what Keras's optimizer cannot apply under it
    (:mod:`tfpar.strategies.refusals`, with :data:`~tfpar.strategies.refusals.REPLICA_ASSIGNS`).

    Keras 3's metrics (the logged loss and metrics, ``evaluate``, validation) count right
    under it through :mod:`tfpar.compat.keras_fixes` (``aggregating_assign_add``).
    """

    refusals = (KERAS_UPDATE_IN_COND, REPLICA_ASSIGNS,
                CLIPPING_PER_REPLICA)
