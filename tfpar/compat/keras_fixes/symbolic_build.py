"""Fix: fit and evaluate build a model from one replica's shard.

**Symbolic build** (``TensorFlowTrainer._maybe_symbolic_build``). A model created under a
strategy scope is built at the start of ``fit``/``evaluate`` from the first distributed
batch, *averaged across replicas* (``strategy.reduce("MEAN", batch)``) just to learn the
input shapes. That crashes under ``MirroredStrategy`` when the first batch does not split
evenly over the replicas (``AddN ... must have the same size and shape``, e.g. a batch of 5
on 2 devices), and under ``MultiWorkerMirroredStrategy`` always (``Attempt to convert a
value (PerReplica...)``, keras-team/keras#20585, tensorflow/tensorflow#72388). The fix hands
Keras's own method the first local replica's shard as ``data_batch`` instead.

Upstream: keras-team/keras#20585, tensorflow/tensorflow#72388. Checked on Keras 3.15.1; the
wrapped code is the same from 3.0 to 3.15. Fails without it:
``tests/compat/keras_fixes_test.py`` (``test_uneven_first_batch_crashes_without_the_fix``).
Keras 3.16: still needed (the test above fails on the preview 3.16.0.dev2026102704 without
the fix).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tensorflow as tf
from keras import tree

from tfpar.compat.keras_fixes.fix import Fix
from tfpar.compat.keras_fixes.fix import tf_trainer_class


def _wrap_symbolic_build(original: Callable) -> Callable:
    @functools.wraps(original)
    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or strategy is None or strategy.num_replicas_in_sync == 1:
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            data_batch = tree.map_structure(
                lambda v: (strategy.experimental_local_results(v)[0]
                           if isinstance(v, tf.distribute.DistributedValues) else v),
                next(it))
            break
        return original(self, data_batch=data_batch)

    return maybe_symbolic_build


FIXES = (
    Fix("symbolic_build", "fit/evaluate build the model from one replica's shard, not a "
        "cross-replica mean (uneven batches; multi_worker)",
        tf_trainer_class, "_maybe_symbolic_build", _wrap_symbolic_build,
        parameters=("self", "iterator", "data_batch"),
        upstream="keras-team/keras#20585, tensorflow/tensorflow#72388"),
)
