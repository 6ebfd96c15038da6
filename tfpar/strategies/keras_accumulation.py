"""Keras's optimizer gradient accumulation under tfpar's mirrored strategies: refused, with
the alternative, before TensorFlow fails deep inside the step.

``keras.optimizers.Optimizer(gradient_accumulation_steps=k)`` applies the accumulated update
inside a ``tf.cond``; under every ``MirroredStrategy``-family strategy (``mirrored``,
``central_storage``, ``allreduce``, ``multi_worker``, ``multi_worker_allreduce``, even with one
device) the update's ``merge_call`` is then forbidden and ``fit`` fails inside TensorFlow
(``RuntimeError: `merge_call` called while defining a new graph``; TensorFlow 2.21, Keras
3.15). The ``allreduce`` entries accumulate exactly themselves (their ``accumulation_steps``).
"""

from __future__ import annotations

import keras

from tfpar.errors import ConfigError


def keras_accumulation_steps(model: keras.Model) -> int:
    """Returns the ``gradient_accumulation_steps`` of ``model``'s optimizer (the inner one of
    a ``LossScaleOptimizer``), or 0 when it does not accumulate."""
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return getattr(optimizer, "gradient_accumulation_steps", None) or 0


class RefusesKerasGradientAccumulation:
    """Mixin for a ``MirroredStrategy``-family strategy: a model's ``train_step`` (Keras's or
    its own) whose optimizer has ``gradient_accumulation_steps`` raises one line naming the
    alternative, instead of failing inside TensorFlow.

    A subclass that accumulates itself sets :attr:`accumulation_option_hint`.
    """

    #: What to use instead, for this strategy's error message.
    accumulation_option_hint = ("train with the 'allreduce' strategy (or "
                                "'multi_worker_allreduce' across workers) and its "
                                "accumulation_steps={steps}")

    def check_train_step(self, fn) -> None:
        """Raises if ``fn`` is a model's ``train_step`` (Keras's or its own) whose optimizer
        has ``gradient_accumulation_steps``.

        Raises:
            ConfigError: Naming the alternative.
        """
        model = getattr(fn, "__self__", None)
        if not (isinstance(model, keras.Model) and getattr(fn, "__name__", "") == "train_step"):
            return
        steps = keras_accumulation_steps(model)
        if steps:
            hint = self.accumulation_option_hint.format(steps=steps)
            raise ConfigError(
                f"The optimizer's gradient_accumulation_steps={steps} fails under "
                "tf.distribute's mirrored strategies (Keras applies the accumulated update "
                "inside tf.cond, where TensorFlow forbids the cross-replica update). "
                f"Compile without it and {hint}: exact, one all-reduce per accumulated batch.")

    def run(self, fn, args=(), kwargs=None, options=None):
        """``Strategy.run``, after :meth:`check_train_step`."""
        self.check_train_step(fn)
        return super().run(fn, args=args, kwargs=kwargs, options=options)
