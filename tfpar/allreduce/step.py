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
variable through ``strategy.extended.update`` and the optimizer's public ``update_step``.
Dynamic loss scaling (``LossScaleOptimizer``, mixed_float16) is done on the reduced gradient.
Optimizer features applied outside ``update_step`` (weight decay, EMA, gradient accumulation)
are refused with a clear error rather than silently skipped.

Everything else is Keras's ``fit``: compiled losses and metrics (any, per output), sample and
class weights, validation, callbacks, ``steps_per_execution``, ``evaluate`` and ``predict``.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from tfpar.allreduce import algorithms
from tfpar.allreduce.options import StepOptions
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


def check_optimizer(optimizer: Optional[keras.optimizers.Optimizer]) -> None:
    """Raises for optimizer features the step's update path does not apply.

    A ``LossScaleOptimizer`` (mixed_float16) is supported: its inner optimizer is checked.

    Raises:
        ConfigError: For no optimizer, weight decay or EMA (the strategy refuses the
            optimizer's gradient accumulation before the step is traced).
    """
    if optimizer is None:
        raise ConfigError("Compile the model with an optimizer and a loss before training it, "
                          "e.g. model.compile(optimizer='sgd', loss=...).")
    optimizer = _inner(optimizer)
    unsupported = {
        "weight_decay": getattr(optimizer, "weight_decay", None),
        "use_ema": getattr(optimizer, "use_ema", False),
    }
    used = [name for name, value in unsupported.items() if value]
    if used:
        raise ConfigError(f"The all-reduce step does not support optimizer {', '.join(used)}. "
                          "Use an optimizer without it, or the 'mirrored' strategy.")


def _clip(optimizer: keras.optimizers.Optimizer, grads: list) -> list:
    if optimizer.global_clipnorm:
        return tf.clip_by_global_norm(grads, optimizer.global_clipnorm)[0]
    if optimizer.clipnorm:
        return [tf.clip_by_norm(g, optimizer.clipnorm) for g in grads]
    if optimizer.clipvalue:
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
    return [(tree.map_structure(lambda t: None if t is None else t[starts[j]:starts[j] + sizes[j]],
                                data), tf.cast(sizes[j], tf.float32)) for j in range(k)]


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
    check_optimizer(model.optimizer)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    loss_scale = (model.optimizer if isinstance(
        model.optimizer, keras.optimizers.LossScaleOptimizer) else None)
    inner = _inner(model.optimizer)
    context = tf.distribute.get_replica_context()
    first_input = next(t for t in tree.flatten(x) if t is not None)
    count = tf.cast(tf.shape(first_input)[0], tf.float32)
    wire = _WIRE_DTYPES[options.gradient_compression]
    # fp16 has too little range for a sum of losses' gradients: they are divided by the global
    # count before the cast, so the count needs a reduction of its own, issued before the
    # model runs (and needed only after the backward pass). Otherwise the count travels in the
    # last bucket and the sums are divided after it: one collective fewer per step.
    total = (algorithms.all_reduce_sum([tf.reshape(count, [1])], options.algorithm,
                                       options.bytes_per_pack)[0][0]
             if options.gradient_compression == "fp16" else None)
    variables = model.trainable_variables
    present = []  # Indices of the variables that get a gradient (known once traced).

    def forward_backward(x, y, sample_weight, count):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            mean = tf.cast(_local_mean_loss(model, x, y, y_pred, sample_weight), tf.float32)
            objective = mean * count
            if loss_scale is not None:
                # In float16 the backward pass of a loss *sum* overflows where Keras's mean
                # does not: shrink it to about a mean first (by this replica's share of the
                # global batch) and undo that in float32 below, so the sum stays exact.
                shrink = 1.0 / (tf.maximum(count, 1.0) * context.num_replicas_in_sync)
                objective = loss_scale.scale_loss(objective * shrink)
        grads = tape.gradient(objective, variables)
        if loss_scale is not None:
            grads = [None if g is None else g / tf.cast(shrink, g.dtype) for g in grads]
        if not present:
            present.extend(i for i, g in enumerate(grads) if g is not None)
        # The mean loss logged, weighted by the examples: its replicas' sum is the global
        # mean. No public API updates the loss Keras logs; fit reads and resets this tracker
        # itself (Keras 3.0-3.15), and the per-step loss tests fail without this update.
        model._loss_tracker.update_state(mean, sample_weight=count)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return [grads[i] for i in present]

    def empty_shard():
        # A replica with no examples (a batch smaller than the number of replicas) adds
        # nothing; it must not run the model (TensorFlow's CPU convolution backward fails on
        # an empty batch).
        return [tf.zeros_like(variables[i]) for i in present]

    grads = None
    synchronizes = _synchronizes(model)
    for micro, micro_count in _micro_batches((x, y, sample_weight), count,
                                             options.accumulation_steps):
        # One micro-batch after the other: the next starts once this one's gradients exist.
        with tf.control_dependencies(grads or []):
            if synchronizes:
                # Layers that all-reduce inside the forward pass (synchronized
                # BatchNormalization) cannot sit in a conditional branch.
                step_grads = forward_backward(*micro, micro_count)
            else:
                # tf.cond traces forward_backward first, which fills `present`.
                step_grads = tf.cond(micro_count > 0,
                                     lambda: forward_backward(*micro, micro_count), empty_shard)
        grads = step_grads if grads is None else [a + b for a, b in zip(grads, step_grads)]

    def scaled(grads, total):
        # Every replica scales by the same factors (1 / the global count, 1 / the loss
        # scale), so scaling before or after the sum is exact; fp16 scales before (into its
        # range), the others after (with the count from the last bucket).
        scale = 1.0 / tf.maximum(total, 1.0)
        if loss_scale is not None:
            scale /= tf.cast(loss_scale.dynamic_scale, scale.dtype)
        return [g * tf.cast(scale, g.dtype) for g in grads]

    sent = scaled(grads, total) if total is not None else grads
    if wire is not None:
        sent = [tf.cast(g, wire) if g.dtype.is_floating else g for g in sent]
    # The metrics' states (the epoch's running totals of this replica) travel with the
    # gradients: summed, they are the global batch's.
    metric_states = [[v.value for v in metric.variables] for metric in model.metrics]
    flat_states = [value for states in metric_states for value in states]
    tail = flat_states + ([tf.reshape(count, [1])] if total is None else [])
    # From the last layer to the first: the order the backward pass produces them in.
    reduced = algorithms.all_reduce_sum(sent[::-1] + tail, options.algorithm,
                                       options.bytes_per_pack)
    reduced_grads = [tf.cast(r, g.dtype) for r, g in zip(reduced[:len(sent)][::-1], grads)]
    reduced_states = reduced[len(sent):len(sent) + len(flat_states)]
    if total is None:
        reduced_grads = scaled(reduced_grads, reduced[-1][0])
    # Identical on every replica, since the gradients were all-reduced. Only loss scaling
    # needs it (it is a pass over every gradient).
    finite = (tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in reduced_grads])
              if loss_scale is not None else tf.constant(True))
    reduced_grads = _clip(inner, reduced_grads)
    _apply(model.optimizer, [variables[i] for i in present], reduced_grads, finite)
    # The logs are the global batch's on every replica (Keras's step logs the mean of the
    # replicas' own results, which is not the global figure when shards differ in size).
    logs, start = {}, 0
    for metric, states in zip(model.metrics, metric_states):
        result = metric.stateless_result(reduced_states[start:start + len(states)])
        start += len(states)
        logs.update(result if isinstance(result, dict) else {metric.name: result})
    return logs


def _apply(optimizer: keras.optimizers.Optimizer, variables: list, grads: list,
           finite: tf.Tensor) -> None:
    """Updates every replica's variables with its copy of the reduced gradients, once."""
    inner = _inner(optimizer)
    loss_scale = optimizer if inner is not optimizer else None

    def update(variable, grad, learning_rate, constraint):
        inner.update_step(grad, variable, learning_rate)
        if constraint is not None:
            variable.assign(constraint(variable))

    def apply(strategy, grads, learning_rate, finite):
        # Cross-replica context: each replica's copy of each variable is updated with that
        # replica's copy of the (already reduced) gradient, and nothing is reduced again.
        def update_all():
            for grad, variable in zip(grads, variables):
                strategy.extended.update(variable.value, update, group=False,
                                         args=(grad, learning_rate, variable.constraint))
            inner.iterations.assign_add(1)
            return tf.constant(True)

        if loss_scale is None:
            update_all()
            return
        # Dynamic loss scaling, as LossScaleOptimizer does: skip a step whose gradients
        # overflowed and halve the scale; double it after enough finite steps.
        tf.cond(strategy.experimental_local_results(finite)[0],
                lambda: tf.logical_and(update_all(), _grow_scale(loss_scale)),
                lambda: _shrink_scale(loss_scale))

    # The learning rate is read here, in the replica context, so every replica's update uses
    # its local copy: read in the cross-replica context, every device would wait for the
    # first device's copy (measured: half the throughput of ResNet-18 on 2 devices).
    learning_rate = tf.identity(inner.learning_rate)
    tf.distribute.get_replica_context().merge_call(apply, args=(grads, learning_rate, finite))


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
