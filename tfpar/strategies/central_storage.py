"""``CentralStorageStrategy`` as the ``central_storage`` entry runs it."""

from __future__ import annotations

import tensorflow as tf

from tfpar.strategies.iterator_release import ReleasesIteratorsInBackground
from tfpar.strategies.optimizer_checks import ChecksKerasOptimizerUpdate


class CentralStorageStrategy(ChecksKerasOptimizerUpdate, ReleasesIteratorsInBackground,
                             tf.distribute.experimental.CentralStorageStrategy):
    """``CentralStorageStrategy`` that refuses what Keras's optimizer cannot apply under it
    (:mod:`.optimizer_checks`) and frees its input iterators in the background.

    Keras 3's metrics (the logged loss and metrics, ``evaluate``, validation) count right
    under it through :mod:`tfpar.compat.keras_fixes` (``aggregating_assign_add``).
    """

    assigns_need_aggregation = True
