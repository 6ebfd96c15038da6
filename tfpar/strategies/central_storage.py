"""``CentralStorageStrategy`` as the ``central_storage`` entry runs it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from tfpar.strategies.base import TfparStrategy
from tfpar.strategies.refusals import CLIPPING_PER_REPLICA
from tfpar.strategies.refusals import KERAS_UPDATE_IN_COND
from tfpar.strategies.refusals import REPLICA_ASSIGNS


def aggregated_state(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
    """A variable creator (``tf.variable_creator_scope``) that gives a non-trainable variable
    without an aggregation one that ``CentralStorageStrategy`` can assign in a replica's step:
    ``MEAN`` for a floating-point one, ``ONLY_FIRST_REPLICA`` for the rest.

    Keras assigns layers' state in each replica's step: ``BatchNormalization``'s moving
    statistics, the random state of ``Dropout`` and every layer drawing random numbers. It
    creates them without an aggregation, which ``MirroredStrategy`` takes as one copy per
    replica, each updated by its own replica; ``CentralStorageStrategy`` keeps one copy, and
    refuses such an assignment ("You must specify an aggregation method to update a
    AggregatingVariable in Replica Context"). With ``MEAN`` the one copy becomes the mean of
    what the replicas assign: a moving mean then follows the mean of the replicas' batch
    means, which is the global batch's mean where the replicas' batches are of one size, as on
    one device; a moving variance follows the mean of the replicas' variances, as the replicas'
    own copies average to under ``mirrored``. A random state is the same on every replica, so
    the first replica's is kept.
    """
    aggregation = kwargs.get("aggregation")
    if not kwargs.get("trainable", True) and aggregation in (None, tf.VariableAggregation.NONE):
        # Keras passes the dtype; an initial value is never called here (an initializer may
        # draw random numbers).
        dtype = kwargs.get("dtype") or getattr(kwargs.get("initial_value"), "dtype", None)
        floating = dtype is not None and tf.as_dtype(dtype).is_floating
        kwargs["aggregation"] = (tf.VariableAggregation.MEAN if floating
                                 else tf.VariableAggregation.ONLY_FIRST_REPLICA)
    return next_creator(**kwargs)


class CentralStorageStrategy(TfparStrategy, tf.distribute.experimental.CentralStorageStrategy):
    """``CentralStorageStrategy`` that trains models with BatchNormalization and Dropout
    (:func:`aggregated_state`) and refuses what Keras's optimizer cannot apply under it
    (:mod:`tfpar.strategies.refusals`, with :data:`~tfpar.strategies.refusals.REPLICA_ASSIGNS`).

    Keras 3's metrics (the logged loss and metrics, ``evaluate``, validation) count right
    under it through :mod:`tfpar.compat.keras_fixes` (``aggregating_assign_add``).
    """

    refusals = (KERAS_UPDATE_IN_COND, REPLICA_ASSIGNS,
                CLIPPING_PER_REPLICA)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """``Strategy.scope``, in which layers' non-trainable state gets an aggregation
        (:func:`aggregated_state`)."""
        with super().scope(), tf.variable_creator_scope(aggregated_state):
            yield
