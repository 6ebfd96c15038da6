"""Fixes for defects of Keras 3 ``fit`` under ``tf.distribute``, installed by tfpar.

Keras 3 (checked up to 3.15) builds a model created under a strategy scope at the start of
``fit``/``evaluate`` by pulling the first distributed batch and *averaging it across replicas*
(``strategy.reduce("MEAN", batch)``) just to learn the input shapes. That crashes:

* under ``MirroredStrategy`` when the first batch does not split evenly over the replicas
  (``AddN ... must have the same size and shape``), e.g. a batch of 5 on 2 devices;
* under ``MultiWorkerMirroredStrategy`` always (``Attempt to convert a value (PerReplica...)``,
  keras-team/keras#20585, tensorflow/tensorflow#72388).

Only the shapes are needed, so the fix takes the first local replica's shard instead of a
cross-replica mean.

A second defect stops ``fit`` under ``MultiWorkerMirroredStrategy`` after the first step: Keras
averages the per-replica scalar logs with ``strategy.reduce("MEAN", v, axis=0)``, and a scalar
has no axis 0 (``Invalid reduction dimension 0 for input with 0 dimensions``). The fix reduces
scalars across replicas with ``axis=None``. :func:`install` applies it once per process; :func:`tfpar.strategies.get`
calls it, so user code that obtains its strategy from tfpar is covered.
"""

from __future__ import annotations

import tensorflow as tf
from keras import tree

# No public Keras API exposes the TensorFlow trainer, the symbolic build that fit/evaluate run
# first, or the reduction of per-replica logs; patching these two is the narrowest fix.
from keras.src.backend.tensorflow import trainer as _tf_trainer

_original = None


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """``TensorFlowTrainer._maybe_symbolic_build`` that reads shapes from one local shard."""
    if self._distribute_strategy is None:
        return  # Keras builds such models when it traces the step.
    strategy = self.distribute_strategy
    if iterator is not None:
        for _, _, it in iterator:
            data_batch = tree.map_structure(
                lambda v: (strategy.experimental_local_results(v)[0]
                           if isinstance(v, tf.distribute.DistributedValues) else v),
                next(it))
            break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _reduce_per_replica(values, strategy, reduction):
    """``reduce_per_replica`` that averages scalar logs of multi-worker replicas correctly."""
    if reduction in ("auto", "mean") and isinstance(strategy,
                                                    tf.distribute.MultiWorkerMirroredStrategy):
        def reduce(v):
            # With one local replica, per-replica values arrive as plain tensors.
            local = v.values[0] if isinstance(v, tf.distribute.DistributedValues) else v
            if tf.is_tensor(local) and local.shape.rank == 0:
                return strategy.reduce("MEAN", v, axis=None)
            return _original_reduce(v, strategy, reduction)
        return tree.map_structure(reduce, values)
    return _original_reduce(values, strategy, reduction)


_original_reduce = None


def install() -> None:
    """Installs the fixes (idempotent). Does nothing on a Keras without the defective code."""
    global _original, _original_reduce
    trainer_cls = _tf_trainer.TensorFlowTrainer
    if (_original is not None or not hasattr(trainer_cls, "_maybe_symbolic_build")
            or not hasattr(_tf_trainer, "reduce_per_replica")):
        return
    _original = trainer_cls._maybe_symbolic_build
    _original_reduce = _tf_trainer.reduce_per_replica
    trainer_cls._maybe_symbolic_build = _maybe_symbolic_build
    _tf_trainer.reduce_per_replica = _reduce_per_replica


def uninstall() -> None:
    """Restores Keras's own code (for tests that show the defects)."""
    global _original, _original_reduce
    if _original is not None:
        _tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _original
        _tf_trainer.reduce_per_replica = _original_reduce
        _original = _original_reduce = None


def installed() -> bool:
    """Returns whether the fix is installed."""
    return _original is not None
