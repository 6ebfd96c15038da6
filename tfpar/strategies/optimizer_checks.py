"""What Keras's own optimizer update cannot do under tfpar's mirrored strategies: refused at
the first step with one line naming the alternative, or, where it trains but not as on one
device, said once.

Keras's ``train_step`` (and a model's own step that calls ``optimizer.apply``) updates the
weights in a replica context; Keras 3's TensorFlow optimizer all-reduces the gradients inside
``apply``. Under every ``MirroredStrategy``-family strategy (``mirrored``, ``central_storage``,
``multi_worker``, and a model's own ``train_step`` under the all-reduce entries), measured on
TensorFlow 2.21 / Keras 3.15:

- ``gradient_accumulation_steps`` and ``ema_overwrite_frequency``: Keras applies them inside
  ``tf.cond``, where TensorFlow forbids the cross-replica update (``RuntimeError: merge_call
  called while defining a new graph``), even on one device. Refused.
- Under ``central_storage``, ``use_ema`` and variable constraints: Keras assigns the variables
  in the replica context, which ``CentralStorageStrategy`` forbids for variables without an
  aggregation (``ValueError: You must specify an aggregation method``). Refused.
- ``clipnorm``, ``global_clipnorm``, ``clipvalue`` with several replicas: Keras clips each
  replica's gradient before the all-reduce, so training differs from one device. Warned once.

The all-reduce step (Keras's ``train_step`` under ``allreduce`` and ``multi_worker_allreduce``)
applies every one of these exactly (:mod:`tfpar.allreduce.step`).
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from tfpar.errors import ConfigError
from tfpar.errors import InexactUpdateWarning
from tfpar.strategies.mixin_base import StrategyMixin


def _inner_optimizer(model: keras.Model) -> Any:
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def keras_accumulation_steps(model: keras.Model) -> int:
    """Returns the ``gradient_accumulation_steps`` of ``model``'s optimizer (the inner one of
    a ``LossScaleOptimizer``), or 0 when it does not accumulate."""
    return getattr(_inner_optimizer(model), "gradient_accumulation_steps", None) or 0


class ChecksKerasOptimizerUpdate(StrategyMixin):
    """Mixin for a ``MirroredStrategy``-family strategy: a model's ``train_step`` (Keras's or
    its own) whose optimizer uses what Keras cannot apply under the strategy raises one line
    naming the alternative at the first step; gradient clipping on several replicas warns once.

    A subclass sets :attr:`alternative` (what to do instead) and
    :attr:`assigns_need_aggregation` (``central_storage``).
    """

    #: What to do instead, for this strategy's error messages (a sentence).
    alternative = ("Train with the 'allreduce' strategy (or 'multi_worker_allreduce' across "
                   "workers), whose step applies it exactly.")
    #: Whether variables cannot be assigned in a replica context (central storage).
    assigns_need_aggregation = False

    def check_train_step(self, fn) -> None:
        """Checks the optimizer of the model whose ``train_step`` ``fn`` is (else nothing).

        Raises:
            ConfigError: For a feature Keras cannot apply under this strategy, naming it and
                the alternative.
        """
        model = getattr(fn, "__self__", None)
        if not (isinstance(model, keras.Model) and getattr(fn, "__name__", "") == "train_step"):
            return
        optimizer = _inner_optimizer(model)
        if optimizer is None:
            return
        in_cond = [f"{name}={getattr(optimizer, name)}"
                   for name in ("gradient_accumulation_steps", "ema_overwrite_frequency")
                   if getattr(optimizer, name, None) and (
                       name != "ema_overwrite_frequency" or optimizer.use_ema)]
        if in_cond:
            raise ConfigError(
                f"The optimizer's {' and '.join(in_cond)} fails under tf.distribute's mirrored "
                "strategies (Keras applies it inside tf.cond, where TensorFlow forbids the "
                f"cross-replica update). {self.alternative}")
        if self.assigns_need_aggregation:
            self._check_replica_assigns(model, optimizer)
        if self.num_replicas_in_sync > 1 and not getattr(self, "_clipping_warned", False):
            clipping = [f"{name}={getattr(optimizer, name)}"
                        for name in ("clipnorm", "global_clipnorm", "clipvalue")
                        if getattr(optimizer, name, None)]
            if clipping:
                self._clipping_warned = True
                warnings.warn(
                    f"The optimizer's {clipping[0]} clips each replica's gradient before the "
                    "all-reduce under Keras's train_step, so training differs from one device. "
                    "The 'allreduce' strategy clips the all-reduced gradient, as one device "
                    "does.", InexactUpdateWarning, stacklevel=2)

    def _check_replica_assigns(self, model: keras.Model, optimizer: Any) -> None:
        constrained = [v.path for v in model.trainable_variables
                       if getattr(v, "constraint", None) is not None]
        used = (["use_ema=True"] if optimizer.use_ema else []) + (
            [f"constraints on {', '.join(constrained)}"] if constrained else [])
        if used:
            raise ConfigError(
                f"Keras cannot apply {' and '.join(used)} under 'central_storage' (it assigns "
                "the variables where the strategy forbids it). Train with 'mirrored' or "
                "'allreduce'.")

    def run(self, fn, args=(), kwargs=None, options=None):
        """``Strategy.run``, after :meth:`check_train_step`."""
        self.check_train_step(fn)
        return super().run(fn, args=args, kwargs=kwargs, options=options)
