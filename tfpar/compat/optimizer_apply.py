"""A mirror of what Keras's ``Optimizer.apply`` does around ``update_step``, applied to every
replica's copy of every variable: the update of tfpar's exact all-reduce step
(:mod:`tfpar.allreduce.step`).

Why no public API serves: Keras 3's TensorFlow optimizer all-reduces the gradients again
whenever ``apply`` runs in a replica context, so the step cannot call ``apply`` on gradients it
has reduced already; it calls the public ``update_step`` and does the rest itself. What it
mirrors, in Keras's order (``keras/src/optimizers/base_optimizer.py``, Keras 3.0-3.15):

- ``BaseOptimizer.apply``: gradient accumulation (``gradient_accumulation_steps``), then
  ``_backend_apply_gradients``;
- ``BaseOptimizer._clip_gradients``: clipnorm, then global_clipnorm, then clipvalue;
- ``BaseOptimizer._apply_weight_decay``, ``_backend_update_step``,
  ``_update_model_variables_moving_average``,
  ``_overwrite_model_variables_with_average_value``, the constraints, the iteration count;
- ``LossScaleOptimizer`` (``keras/src/optimizers/loss_scale_optimizer.py``): skip a step whose
  gradients overflowed and halve the scale, double it after ``dynamic_growth_steps`` finite
  steps.

The optimizer state it reads (accumulators, EMA pairs, the iteration counter) comes through
:mod:`tfpar.compat.keras_internals`. :data:`APPLY_METHODS` names the private methods of
``apply``: an optimizer class overriding one changes the update, and is refused.

Used only on the Keras versions of :data:`tfpar.compat.versions.VERIFIED_KERAS`:
:func:`overridden_methods` (which every training with the step calls first) raises one line
elsewhere. ``tests/compat/optimizer_apply_test.py`` fails when Keras's ``apply`` changes shape
(a method renamed, or called in another order); ``tests/allreduce/step_test.py`` compares the
step with Keras's own update for every feature above.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfpar.compat import keras_internals
from tfpar.compat import versions
from tfpar.errors import ConfigError


def inner_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that updates the variables (inside a ``LossScaleOptimizer``, its inner)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


# What Keras's Optimizer.apply does around update_step, by the method that does it.
APPLY_METHODS = ("apply", "apply_gradients", "_backend_apply_gradients", "_backend_update_step",
                 "_apply_weight_decay", "_clip_gradients",
                 "_update_model_variables_moving_average",
                 "_overwrite_model_variables_with_average_value",
                 "_backend_maybe_overwrite_model_variables",
                 "_backend_increment_gradient_accumulators")
# The methods of APPLY_METHODS that Keras has only from a release on.
APPLY_METHODS_SINCE = {"_backend_maybe_overwrite_model_variables": (3, 16)}


def skip_reason() -> str | None:
    """Why the mirror of Keras's ``Optimizer.apply`` is not used on this Keras (``None``: it
    is)."""
    return versions.keras_skip_reason(keras.version())


def overridden_methods(optimizer: keras.optimizers.Optimizer) -> list[str]:
    """The methods of :data:`APPLY_METHODS` that ``optimizer``'s class overrides.

    Raises:
        ConfigError: On a Keras outside the verified versions (the mirror may be stale).
    """
    reason = skip_reason()
    if reason is not None:
        raise ConfigError(
            "The all-reduce step mirrors Keras's Optimizer.apply as of Keras "
            f"{versions.keras_range_text()}; this is Keras {keras.version()} ({reason}). Use "
            "the 'mirrored' strategy.")
    return [name for name in APPLY_METHODS
            if getattr(type(optimizer), name, None) is not getattr(keras.optimizers.Optimizer,
                                                                   name, None)]


def clip(optimizer: keras.optimizers.Optimizer, grads: list) -> list:
    """Clips ``grads`` as ``Optimizer._clip_gradients`` does: clipnorm, then global_clipnorm,
    then clipvalue; only one applies."""
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        return [tf.clip_by_norm(g, optimizer.clipnorm) for g in grads]
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        return tf.clip_by_global_norm(grads, optimizer.global_clipnorm)[0]
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        return [tf.clip_by_value(g, -optimizer.clipvalue, optimizer.clipvalue) for g in grads]
    return grads


class OptimizerUpdate:
    """What Keras's ``Optimizer.apply`` does around ``update_step``, in its order, applied to
    every replica's copy of every variable.

    Built in the replica context: everything that needs all gradients at once (the accumulated
    mean, global clipping) or a scalar of the optimizer's is computed there, so every replica
    reads its local copies (read in the cross-replica context, every device would wait for the
    first device's copy). Those
    per-replica values reach the cross-replica update through ``merge_call``'s arguments.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, variables: list, grads: list,
                 finite: tf.Tensor):
        inner = self.inner = inner_optimizer(optimizer)
        self.loss_scale = optimizer if inner is not optimizer else None
        self.variables = variables
        self.steps = inner.gradient_accumulation_steps
        self.counter = keras_internals.iterations_variable(inner)
        self.accumulators: list = []
        if self.steps:
            self.accumulators = keras_internals.gradient_accumulators(inner, variables)
            update_grads = clip(inner, [(g + a.value) / self.steps
                                         for g, a in zip(grads, self.accumulators)])
            is_update_step = tf.equal((self.counter.value + 1) % self.steps, 0)
        else:
            update_grads, is_update_step = clip(inner, grads), tf.constant(True)
        self.ema: list = []
        momentum = overwrite = None
        if inner.use_ema:
            self.ema = keras_internals.moving_averages(inner)
            iterations = tf.identity(inner.iterations)  # Keras's count: of updates.
            momentum = tf.cast(tf.not_equal(iterations, 0), tf.float32) * inner.ema_momentum
            if inner.ema_overwrite_frequency:
                overwrite = tf.equal((iterations + 1) % inner.ema_overwrite_frequency, 0)
        self.decayed = ([keras_internals.uses_weight_decay(inner, v) for v in variables]
                        if inner.weight_decay is not None else [False] * len(variables))
        self._per_replica = dict(grads=grads, update_grads=update_grads,
                                 learning_rate=tf.identity(inner.learning_rate), finite=finite,
                                 is_update_step=is_update_step, momentum=momentum,
                                 overwrite=overwrite)

    def merge(self) -> None:
        """Leaves the replica context and applies the update on every replica's copies."""
        tf.distribute.get_replica_context().merge_call(self._apply, kwargs=self._per_replica)

    def _apply(self, strategy, grads, update_grads, learning_rate, finite, is_update_step,
               momentum, overwrite) -> None:
        # Cross-replica context: each replica's copy of each variable is updated with that
        # replica's copy of the (already reduced) values, and nothing is reduced again.
        def on_each(variable, fn, *args):
            strategy.extended.update(_tf_variable(variable), fn, args=args, group=False)

        def first(value):
            return strategy.experimental_local_results(value)[0]

        def update_variables():
            for variable, decay in zip(self.variables, self.decayed):
                if decay:
                    on_each(variable, _decay, learning_rate, self.inner.weight_decay)
            for grad, variable in zip(update_grads, self.variables):
                on_each(variable, lambda v, g, lr: self.inner.update_step(g, v, lr), grad,
                        learning_rate)
            for accumulator in self.accumulators:
                on_each(accumulator, lambda a: a.assign(tf.zeros_like(a)))
            return tf.constant(True)

        def accumulate():
            for grad, accumulator in zip(grads, self.accumulators):
                on_each(accumulator, lambda a, g: a.assign_add(tf.cast(g, a.dtype)), grad)
            return tf.constant(True)

        def apply_all():
            if self.steps:
                tf.cond(first(is_update_step), update_variables, accumulate)
            else:
                update_variables()
            for variable, average in self.ema:
                on_each(average, _moving_average, _tf_variable(variable), momentum)
            if overwrite is not None:
                tf.cond(first(overwrite), lambda: _overwrite_with(on_each, self.ema),
                        lambda: tf.constant(True))
            for variable in self.variables:
                if variable.constraint is not None:
                    on_each(variable, lambda v, c=variable.constraint: v.assign(c(v)))
            self.counter.assign_add(1)
            return tf.constant(True)

        if self.loss_scale is None:
            apply_all()
            return
        # Dynamic loss scaling, as LossScaleOptimizer does: skip a step whose gradients
        # overflowed and halve the scale; double it after enough finite steps.
        tf.cond(first(finite),
                lambda: tf.logical_and(apply_all(), grow_scale(self.loss_scale)),
                lambda: shrink_scale(self.loss_scale))


def _tf_variable(variable):
    """The ``tf.distribute`` variable behind a Keras variable (its per-replica copies)."""
    return getattr(variable, "value", variable)


def _decay(variable, learning_rate, weight_decay) -> None:
    variable.assign_sub(variable * tf.cast(weight_decay, variable.dtype)
                        * tf.cast(learning_rate, variable.dtype))


def _moving_average(average, variable, momentum) -> None:
    momentum = tf.cast(momentum, average.dtype)
    average.assign(momentum * average + (1 - momentum) * tf.cast(variable, average.dtype))


def _overwrite_with(on_each, ema) -> tf.Tensor:
    for variable, average in ema:
        on_each(variable, lambda v, a: v.assign(a), _tf_variable(average))
    return tf.constant(True)


def grow_scale(scaler: keras.optimizers.LossScaleOptimizer) -> tf.Tensor:
    """Doubles the loss scale after ``dynamic_growth_steps`` finite steps in a row."""
    grow = tf.equal(scaler.step_counter, scaler.dynamic_growth_steps - 1)
    scaler.dynamic_scale.assign(tf.where(grow, scaler.dynamic_scale * 2.0, scaler.dynamic_scale))
    scaler.step_counter.assign(tf.where(grow, tf.zeros_like(scaler.step_counter),
                                        scaler.step_counter + 1))
    return tf.constant(True)


def shrink_scale(scaler: keras.optimizers.LossScaleOptimizer) -> tf.Tensor:
    """Halves the loss scale after a step whose gradients overflowed."""
    scaler.step_counter.assign(tf.zeros_like(scaler.step_counter))
    scaler.dynamic_scale.assign(scaler.dynamic_scale * 0.5)
    return tf.constant(False)
