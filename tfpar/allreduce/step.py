"""The hand-written data-parallel step (the seeds' from-scratch chapter), run by ``model.fit``.

A model built and compiled in the scope of an all-reduce strategy (:mod:`.strategy`) trains
with plain ``model.fit``, and every step is :func:`train_step`::

    global batch --split--> replica shards        (the strategy's distributed dataset;
                                                   by ``split_weights`` for unequal devices)
    each replica:  forward, loss, backward         (tf.GradientTape on its shard, in
                                                   ``accumulation_steps`` micro-batches)
    all replicas:  all-reduce the gradients        (.algorithms: collective | naive | ring,
                                                   buckets of ``bytes_per_pack`` bytes, last
                                                   layer first; optionally in fp16/bf16;
                                                   the example counts and the metrics' states
                                                   in the last bucket)
    each replica:  the same update                 (the optimizer, applied once per replica)

The gradient is exact: each replica differentiates the *sum* of its examples' losses (its
mean loss, as ``model.compute_loss`` gives it, times its example count); the all-reduced sums
are divided by the all-reduced global count. So uneven
shards (a last partial batch, a batch that does not divide by the number of replicas, an empty
shard) weigh every example equally, unlike Keras's standard step, which averages the
replicas' means. Clipping applies to the reduced gradient, as on one device. A step is one
collective per bucket and nothing else (across workers each costs 1-2 ms of
latency however small), except with fp16 compression, whose range needs the gradients divided
by the global count *before* the cast: the count is then all-reduced first, on its own.

The optimizer must not reduce a second time: Keras 3's TensorFlow optimizer all-reduces
gradients itself whenever ``apply`` runs in a replica context. The step therefore leaves the
replica context with ``ReplicaContext.merge_call`` and updates each replica's copy of each
variable through ``strategy.extended.update`` and the optimizer's public ``update_step``,
doing around it what Keras's ``Optimizer.apply`` does, in its order: gradient accumulation
(``gradient_accumulation_steps``: an update every k batches with the mean of their global
gradients), clipping, weight decay (``exclude_from_weight_decay`` honoured), the update, the
EMA (``use_ema``, ``ema_momentum``, ``ema_overwrite_frequency``; ``fit`` calls
``finalize_variable_values`` at its end), constraints, the iteration count. Dynamic loss
scaling (``LossScaleOptimizer``, mixed_float16) is done on the reduced gradient. An optimizer
that changes what ``apply`` does around ``update_step`` (a class overriding those methods, as
``Nadam``, ``Muon`` and ``MultiOptimizer`` do) is refused at the first step with one line.

Everything else is Keras's ``fit``: compiled losses and metrics (any, per output), sample and
class weights, validation, callbacks, ``steps_per_execution``, ``evaluate`` and ``predict``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from tfpar.allreduce import algorithms
from tfpar.allreduce.options import StepOptions
from tfpar.compat import keras_internals
from tfpar.errors import ConfigError

# The dtypes gradients may travel in (``StepOptions.gradient_compression``).
_WIRE_DTYPES = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16}


def split_sizes(batch_size: tf.Tensor, weights: Sequence[float]) -> tf.Tensor:
    """Splits ``batch_size`` examples by ``weights`` (largest remainders get the spare ones).

    Args:
        batch_size: Scalar int32 tensor.
        weights: Positive per-replica weights.

    Returns:
        int32 sizes, one per weight, summing to ``batch_size``.
    """
    w = tf.constant(np.asarray(weights, np.float64) / np.sum(weights))
    exact = tf.cast(batch_size, tf.float64) * w
    sizes = tf.cast(tf.floor(exact), tf.int32)
    spare = batch_size - tf.reduce_sum(sizes)
    order = tf.argsort(exact - tf.floor(exact), direction="DESCENDING", stable=True)
    bonus = tf.scatter_nd(order[:, None], tf.cast(tf.range(len(weights)) < spare, tf.int32),
                          [len(weights)])
    return sizes + bonus


def _inner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


# What Keras's Optimizer.apply does around update_step, by the method that does it: a class
# that overrides one of them changes the update in a way this step would silently skip.
_APPLY_METHODS = ("apply", "apply_gradients", "_backend_apply_gradients", "_backend_update_step",
                  "_apply_weight_decay", "_clip_gradients",
                  "_update_model_variables_moving_average",
                  "_overwrite_model_variables_with_average_value",
                  "_backend_increment_gradient_accumulators")


def check_optimizer(optimizer: keras.optimizers.Optimizer | None,
                    variables: Sequence[Any] = ()) -> None:
    """Raises for an optimizer whose update the step cannot reproduce exactly.

    Supported: every Keras optimizer that updates through ``update_step`` (SGD, Adam, AdamW,
    Lion, RMSprop, ...), with clipping, ``weight_decay``, EMA, ``gradient_accumulation_steps``,
    ``loss_scale_factor``, and a ``LossScaleOptimizer`` around it.

    Args:
        optimizer: The model's optimizer.
        variables: The variables it will update.

    Raises:
        ConfigError: For no optimizer, an optimizer class that overrides what ``apply`` does
            around ``update_step`` (naming the method), or a variable updated by overwriting
            it with its gradient (``overwrite_with_gradient``, float8 training).
    """
    if optimizer is None:
        raise ConfigError("Compile the model with an optimizer and a loss before training it, "
                          "e.g. model.compile(optimizer='sgd', loss=...).")
    inner = _inner(optimizer)
    overridden = [name for name in _APPLY_METHODS
                  if getattr(type(inner), name, None) is not getattr(keras.optimizers.Optimizer,
                                                                     name, None)]
    if overridden:
        raise ConfigError(
            f"The all-reduce step cannot train with {type(inner).__name__}: it changes what "
            f"Keras does around update_step ({', '.join(overridden)}), which the step would "
            "skip. Use an optimizer that updates through update_step (SGD, Adam, AdamW, Lion, "
            "RMSprop, ...), or the 'mirrored' strategy.")
    overwritten = [v.path for v in variables if getattr(v, "overwrite_with_gradient", False)]
    if overwritten:
        raise ConfigError(
            "The all-reduce step cannot train variables that are overwritten with their "
            f"gradient (overwrite_with_gradient, float8 training): {', '.join(overwritten)}. "
            "Use the 'mirrored' strategy.")


def _clip(optimizer: keras.optimizers.Optimizer, grads: list) -> list:
    # Keras's precedence (Optimizer._clip_gradients): clipnorm, then global_clipnorm, then
    # clipvalue; only one applies.
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        return [tf.clip_by_norm(g, optimizer.clipnorm) for g in grads]
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        return tf.clip_by_global_norm(grads, optimizer.global_clipnorm)[0]
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        return [tf.clip_by_value(g, -optimizer.clipvalue, optimizer.clipvalue) for g in grads]
    return grads


def _accepts_training(method) -> bool:
    return "training" in inspect.signature(method).parameters


def _local_mean_loss(model: keras.Model, x, y, y_pred, sample_weight) -> tf.Tensor:
    """This replica's mean loss over its own examples, regularisation included.

    Keras's ``compute_loss`` (and every loss it adds up) divides by the number of replicas,
    expecting the replicas' gradients to be summed; Keras itself multiplies that back for the
    loss it logs, and so does this.
    """
    kwargs = {"training": True} if _accepts_training(model.compute_loss) else {}
    loss = model.compute_loss(x, y, y_pred, sample_weight, **kwargs)
    return loss * tf.cast(tf.distribute.get_replica_context().num_replicas_in_sync, loss.dtype)


def _synchronizes(layer: keras.layers.Layer) -> bool:
    """Whether ``layer`` or a layer inside it communicates across replicas in its call."""
    return bool(getattr(layer, "synchronized", False)) or any(
        _synchronizes(inner) for inner in getattr(layer, "layers", ()))


def _micro_batches(data, count: tf.Tensor, k: int) -> list[tuple[Any, tf.Tensor]]:
    """Splits this replica's shard into ``k`` consecutive micro-batches (sizes differ by <= 1)."""
    if k == 1:
        return [(data, count)]
    sizes = split_sizes(tf.cast(count, tf.int32), [1.0] * k)
    starts = tf.cumsum(sizes, exclusive=True)

    def part(j: int):
        return tree.map_structure(
            lambda t: None if t is None else t[starts[j]:starts[j] + sizes[j]], data)

    return [(part(j), tf.cast(sizes[j], tf.float32)) for j in range(k)]


def train_step(model: keras.Model, options: StepOptions, data) -> dict[str, Any]:
    """One exact data-parallel training step on this replica's shard (a replica context).

    The order of work, so that communication hides behind computation::

        [fp16 only: all-reduce the example count, issued first, during the forward pass]
        forward, backward              (per micro-batch, one after the other, summed locally)
        [fp16 only: scale by 1 / global count]; cast to the compression dtype, if any
        all-reduce the gradients       (buckets from the last layer to the first, each issued
                                        as soon as its gradients exist); the metrics' states
                                        and the example count in the last bucket
        scale by 1 / global count      (unless done before)
        clip, update                   (identical on every replica)

    Args:
        model: A compiled model built in the strategy's scope.
        options: How gradients are reduced.
        data: This replica's ``(x, y)`` or ``(x, y, sample_weight)``.

    Returns:
        The metrics, as Keras's ``train_step`` returns them.

    Raises:
        ConfigError: For an optimizer feature the step cannot apply.
    """
    check_optimizer(model.optimizer, model.trainable_variables)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    step = _ReplicaStep(model, options)
    first_input = next(t for t in tree.flatten(x) if t is not None)
    count = tf.cast(tf.shape(first_input)[0], tf.float32)
    # fp16 has too little range for a sum of losses' gradients: they are divided by the global
    # count before the cast, so the count needs a reduction of its own, issued before the
    # model runs (and needed only after the backward pass). Otherwise the count travels in the
    # last bucket and the sums are divided after it: one collective fewer per step.
    total = (algorithms.all_reduce_sum([tf.reshape(count, [1])], options.algorithm,
                                       options.bytes_per_pack)[0][0]
             if options.gradient_compression == "fp16" else None)
    grads = step.local_gradients(x, y, sample_weight, count)
    reduced_grads, reduced_states = step.all_reduce(grads, count, total)
    # Identical on every replica, since the gradients were all-reduced. Only loss scaling
    # needs it (it is a pass over every gradient).
    finite = (tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in reduced_grads])
              if step.loss_scale is not None else tf.constant(True))
    _apply(model.optimizer, [step.variables[i] for i in step.present], reduced_grads, finite)
    return step.logs(reduced_states)


class _ReplicaStep:
    """One replica's part of a traced step: what it trains with, and its phases (local
    gradients, their all-reduce, the logs).

    Attributes:
        variables: The model's trainable variables.
        present: Indices of the variables that get a gradient (known once traced).
        loss_scale: The ``LossScaleOptimizer``, if the model's optimizer is one.
    """

    def __init__(self, model: keras.Model, options: StepOptions):
        self.model, self.options = model, options
        self.loss_scale = (model.optimizer if isinstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer) else None)
        # A fixed loss scale (the optimizer's loss_scale_factor) is applied as Keras's step
        # does: to the loss before the backward pass, and divided out of the gradient.
        self.loss_scale_factor = _inner(model.optimizer).loss_scale_factor
        self.variables = model.trainable_variables
        self.present: list[int] = []
        self._metric_states: list[list] = []  # Read after the forward passes updated them.

    def local_gradients(self, x, y, sample_weight, count: tf.Tensor) -> list:
        """The gradient of the sum of this replica's examples' losses, micro-batch by
        micro-batch (``accumulation_steps``), summed locally."""
        grads: list = []
        synchronizes = _synchronizes(self.model)
        for micro, micro_count in _micro_batches((x, y, sample_weight), count,
                                                 self.options.accumulation_steps):
            micro_x, micro_y, micro_weight = micro

            def run_micro_batch(x=micro_x, y=micro_y, weight=micro_weight, n=micro_count):
                return self._forward_backward(x, y, weight, n)

            # One micro-batch after the other: the next starts once this one's gradients exist.
            with tf.control_dependencies(grads):
                if synchronizes:
                    # Layers that all-reduce inside the forward pass (synchronized
                    # BatchNormalization) cannot sit in a conditional branch.
                    step_grads = run_micro_batch()
                else:
                    # tf.cond traces the forward pass first, which fills `present`.
                    step_grads = tf.cond(micro_count > 0, run_micro_batch, self._empty_shard)
            grads = [a + b for a, b in zip(grads, step_grads)] if grads else step_grads
        return grads

    def _forward_backward(self, x, y, sample_weight, count) -> list:
        model, loss_scale = self.model, self.loss_scale
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            mean = tf.cast(_local_mean_loss(model, x, y, y_pred, sample_weight), tf.float32)
            objective = mean * count
            if self.loss_scale_factor and loss_scale is None:
                objective = objective * self.loss_scale_factor
            if loss_scale is not None:
                # In float16 the backward pass of a loss *sum* overflows where Keras's mean
                # does not: shrink it to about a mean first (by this replica's share of the
                # global batch) and undo that in float32 below, so the sum stays exact.
                replicas = tf.distribute.get_replica_context().num_replicas_in_sync
                shrink = 1.0 / (tf.maximum(count, 1.0) * replicas)
                objective = loss_scale.scale_loss(objective * shrink)
        grads = tape.gradient(objective, self.variables)
        if loss_scale is not None:
            grads = [None if g is None else g / tf.cast(shrink, g.dtype) for g in grads]
        if not self.present:
            self.present.extend(i for i, g in enumerate(grads) if g is not None)
        # The mean loss logged, weighted by the examples: its replicas' sum is the global
        # mean. No public API updates the loss Keras logs (tfpar.compat.keras_internals).
        keras_internals.loss_tracker(model).update_state(mean, sample_weight=count)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return [grads[i] for i in self.present]

    def _empty_shard(self) -> list:
        # A replica with no examples (a batch smaller than the number of replicas) adds
        # nothing; it must not run the model (TensorFlow's CPU convolution backward fails on
        # an empty batch).
        return [tf.zeros_like(self.variables[i]) for i in self.present]

    def _scaled(self, grads: list, total: tf.Tensor) -> list:
        # Every replica scales by the same factors (1 / the global count, 1 / the loss
        # scale), so scaling before or after the sum is exact; fp16 scales before (into its
        # range), the others after (with the count from the last bucket).
        scale = 1.0 / tf.maximum(total, 1.0)
        if self.loss_scale is not None:
            scale /= tf.cast(self.loss_scale.dynamic_scale, scale.dtype)
        if self.loss_scale_factor:
            scale /= self.loss_scale_factor
        return [g * tf.cast(scale, g.dtype) for g in grads]

    def all_reduce(self, grads: list, count: tf.Tensor, total: tf.Tensor | None
                   ) -> tuple[list, list]:
        """All-reduces the gradients (in buckets, last layer first) with the metrics' states
        and, unless ``total`` is known already, the example count in the last bucket.

        Returns:
            The global gradient (divided by the global count) and the metrics' global states.
        """
        options = self.options
        sent = self._scaled(grads, total) if total is not None else grads
        wire = _WIRE_DTYPES[options.gradient_compression]
        if wire is not None:
            sent = [tf.cast(g, wire) if g.dtype.is_floating else g for g in sent]
        # The metrics' states (the epoch's running totals of this replica, this step's
        # included) travel with the gradients: summed, they are the global batch's.
        self._metric_states = [[v.value for v in metric.variables]
                               for metric in self.model.metrics]
        flat_states = [value for states in self._metric_states for value in states]
        tail = flat_states + ([tf.reshape(count, [1])] if total is None else [])
        # From the last layer to the first: the order the backward pass produces them in.
        reduced = algorithms.all_reduce_sum(sent[::-1] + tail, options.algorithm,
                                           options.bytes_per_pack)
        reduced_grads = [tf.cast(r, g.dtype) for r, g in zip(reduced[:len(sent)][::-1], grads)]
        if total is None:
            reduced_grads = self._scaled(reduced_grads, reduced[-1][0])
        return reduced_grads, reduced[len(sent):len(sent) + len(flat_states)]

    def logs(self, reduced_states: list) -> dict[str, Any]:
        """The metrics of the global batch (the same on every replica; Keras's step logs the
        mean of the replicas' own results, which is not the global figure when shards differ
        in size)."""
        logs, start = {}, 0
        for metric, states in zip(self.model.metrics, self._metric_states):
            result = metric.stateless_result(reduced_states[start:start + len(states)])
            start += len(states)
            logs.update(result if isinstance(result, dict) else {metric.name: result})
        return logs


def _apply(optimizer: keras.optimizers.Optimizer, variables: list, grads: list,
           finite: tf.Tensor) -> None:
    """Updates every replica's copy of ``variables`` with its copy of the reduced gradients,
    as Keras's ``Optimizer.apply`` would on one device (see the module docstring)."""
    _OptimizerUpdate(optimizer, variables, grads, finite).merge()


class _OptimizerUpdate:
    """What Keras's ``Optimizer.apply`` does around ``update_step``, in its order, applied to
    every replica's copy of every variable.

    Built in the replica context: everything that needs all gradients at once (the accumulated
    mean, global clipping) or a scalar of the optimizer's is computed there, so every replica
    reads its local copies (read in the cross-replica context, every device would wait for the
    first device's copy: measured, half the throughput of ResNet-18 on 2 devices). Those
    per-replica values reach the cross-replica update through ``merge_call``'s arguments.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, variables: list, grads: list,
                 finite: tf.Tensor):
        inner = self.inner = _inner(optimizer)
        self.loss_scale = optimizer if inner is not optimizer else None
        self.variables = variables
        self.steps = inner.gradient_accumulation_steps
        self.counter = keras_internals.iterations_variable(inner)
        self.accumulators: list = []
        if self.steps:
            self.accumulators = keras_internals.gradient_accumulators(inner, variables)
            update_grads = _clip(inner, [(g + a.value) / self.steps
                                         for g, a in zip(grads, self.accumulators)])
            is_update_step = tf.equal((self.counter.value + 1) % self.steps, 0)
        else:
            update_grads, is_update_step = _clip(inner, grads), tf.constant(True)
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
                lambda: tf.logical_and(apply_all(), _grow_scale(self.loss_scale)),
                lambda: _shrink_scale(self.loss_scale))


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


def _grow_scale(scaler: keras.optimizers.LossScaleOptimizer) -> tf.Tensor:
    grow = tf.equal(scaler.step_counter, scaler.dynamic_growth_steps - 1)
    scaler.dynamic_scale.assign(tf.where(grow, scaler.dynamic_scale * 2.0, scaler.dynamic_scale))
    scaler.step_counter.assign(tf.where(grow, tf.zeros_like(scaler.step_counter),
                                        scaler.step_counter + 1))
    return tf.constant(True)


def _shrink_scale(scaler: keras.optimizers.LossScaleOptimizer) -> tf.Tensor:
    scaler.step_counter.assign(tf.zeros_like(scaler.step_counter))
    scaler.dynamic_scale.assign(scaler.dynamic_scale * 0.5)
    return tf.constant(False)
