"""Fix: scalar logs of several workers are reduced, once, in one collective.

**Scalar logs across workers** (``reduce_per_replica``). Keras averages per-replica logs
of a multi-worker strategy with ``strategy.reduce("MEAN", v, axis=0)``; a scalar has no axis
0 (``Invalid reduction dimension 0 for input with 0 dimensions``), so ``fit`` stops after
the first step. The fix reduces scalars with ``axis=None``, all of a dtype in one
collective (Keras would issue one per log per step), returns values the strategy says are
global already (``strategy.is_global_value``: the all-reduce step's logs) as they are, and
leaves everything else to Keras's own function.

Upstream: part of Keras 3's missing multi-worker support, keras-team/keras#20585. Checked on
Keras 3.15.1; the wrapped code is the same from 3.0 to 3.15. Fails without it:
``tests/compat/keras_fixes_test.py``
(``test_multi_worker_fit_stops_after_one_step_without_the_log_fix``).
Keras 3.16: still needed (the test above fails on the preview 3.16.0.dev2026102704 without
the fix).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from typing import Protocol
from typing import runtime_checkable

import tensorflow as tf
from keras import tree

from tfpar.compat.keras_fixes import fix
from tfpar.compat.keras_fixes.fix import Fix


@runtime_checkable
class ReportsGlobalValues(Protocol):
    """What a strategy whose own training step returns logs that are already the same on
    every replica and worker implements, so that the scalar-logs fix does not reduce them
    again (Keras's own word for such a value, in ``reduce_per_replica``, is ``"first"``).
    tfpar's all-reduce strategies implement it (:mod:`tfpar.strategies.allreduce`)."""

    def is_global_value(self, value: Any) -> bool:
        """Whether ``value``, a log of this strategy's step, is global already."""


def _wrap_reduce_per_replica(original: Callable) -> Callable:
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not fix.several_workers(strategy):
            return original(values, strategy, reduction)
        is_global = (strategy.is_global_value if isinstance(strategy, ReportsGlobalValues)
                     else lambda value: False)
        flat = tree.flatten(values)
        reduced = [v if is_global(v) else None for v in flat]
        scalars: dict[tf.DType, list[int]] = {}
        for i, v in enumerate(flat):
            if reduced[i] is not None:
                continue
            # With one local replica, per-replica values arrive as plain tensors.
            local = strategy.experimental_local_results(v)[0]
            if tf.is_tensor(local) and local.shape.rank == 0:
                scalars.setdefault(local.dtype, []).append(i)
            else:
                reduced[i] = original(v, strategy, reduction)
        # Every scalar log of a dtype in one collective (Keras: one each), since a collective
        # across workers costs a round trip however small it is.
        for indices in scalars.values():
            stacked = strategy.run(lambda *logs: tf.stack(logs),
                                   args=tuple(flat[i] for i in indices))
            means = tf.unstack(strategy.reduce("MEAN", stacked, axis=None), len(indices))
            for i, mean in zip(indices, means):
                reduced[i] = mean
        return tree.pack_sequence_as(values, reduced)

    return reduce_per_replica


FIXES = (
    Fix("reduce_per_replica", "scalar logs of multi-worker replicas reduced with axis=None, "
        "in one collective; logs global already are not reduced again",
        fix.tf_trainer, "reduce_per_replica", _wrap_reduce_per_replica,
        parameters=("values", "strategy", "reduction")),
)
