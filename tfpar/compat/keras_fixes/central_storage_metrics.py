"""Fix: metric variables under ``central_storage`` add increments.

**Metrics under ``central_storage``** (``Variable.assign_add``/``assign_sub`` of Keras's
TensorFlow backend). Keras 3 adds to a variable by assigning it ``self + value``: a read,
then a write. ``CentralStorageStrategy`` keeps one copy of a metric's variables and sums
what every replica assigns, so each step adds the old total once per replica: after three
steps of a ``Mean`` on two replicas the count was 14 instead of 6, and ``fit``'s logged
loss and metrics, ``evaluate`` (Keras's ``test_step`` or a model's own) and validation were
wrong. The fix adds through TensorFlow's own ``assign_add``/``assign_sub`` there, which the
strategy sums as increments; everywhere else Keras's code runs.

Upstream: none found. Checked on Keras 3.15.1; the wrapped code is the same from 3.0 to 3.15.
Fails without it: ``tests/strategies/central_storage_test.py``
(``test_keras_miscounts_without_the_fix``).
Keras 3.16: still needed (the test above fails on the preview 3.16.0.dev2026102704 without
the fix).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tensorflow as tf

from tfpar.compat.keras_fixes.fix import Fix
from tfpar.compat.keras_fixes.fix import tf_variable_class


def _wrap_aggregating_add(original: Callable, method: str) -> Callable:
    @functools.wraps(original)
    def add(self, value):
        variable = self._value
        if (tf.distribute.in_cross_replica_context()
                or not isinstance(tf.distribute.get_strategy(),
                                  tf.distribute.experimental.CentralStorageStrategy)
                or getattr(variable, "aggregation", None) in (None, tf.VariableAggregation.NONE)):
            return original(self, value)
        return getattr(variable, method)(tf.cast(value, variable.dtype))

    return add


FIXES = (
    Fix("aggregating_assign_add", "metric variables under central_storage add increments, "
        "not each replica's read-then-write (loss, metrics, evaluate)",
        tf_variable_class, "assign_add",
        functools.partial(_wrap_aggregating_add, method="assign_add"),
        parameters=("self", "value")),
    Fix("aggregating_assign_sub", "the same for assign_sub",
        tf_variable_class, "assign_sub",
        functools.partial(_wrap_aggregating_add, method="assign_sub"),
        parameters=("self", "value")),
)
