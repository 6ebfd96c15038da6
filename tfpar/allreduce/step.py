"""The hand-written data-parallel step, run by ``model.fit``.

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
collective per bucket and nothing else (across workers each costs a round trip
however small), except with fp16 compression, whose range needs the gradients divided
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
from tfpar.allreduce import virtual_replicas
from tfpar.allreduce.options import StepOptions
from tfpar.compat import keras_internals
from tfpar.compat import optimizer_apply
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
    inner = optimizer_apply.inner_optimizer(optimizer)
    overridden = optimizer_apply.overridden_methods(inner)
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


def _unknown_if_empty(tensor: Any) -> Any:
    """``tensor`` with its batch size left unknown to the trace when it is known to be 0.

    Keras traces a step with the first batch's static shapes (Keras 3.16 does, for
    ``steps_per_execution=1``), so a replica given no examples of that batch sees a static
    batch of 0, for which Keras's losses return their unreduced per-example values (shape
    ``(0,)``) instead of a mean, and adding those to a scalar fails while tracing. The step
    never runs the model on such a shard (it adds zero gradients), but it is traced.
    """
    if (not tf.is_tensor(tensor) or tensor.shape.rank is None or tensor.shape.rank == 0
            or tensor.shape[0] != 0):
        return tensor
    return tf.compat.v1.placeholder_with_default(tensor, [None, *tensor.shape[1:]])


def _micro_batches(data, count: tf.Tensor, k: int) -> list[tuple[Any, tf.Tensor]]:
    """Splits this replica's shard into ``k`` consecutive micro-batches (sizes differ by <= 1)."""
    if k == 1:
        return [(data, count)]
    sizes = split_sizes(tf.cast(count, tf.int32), [1.0] * k)
    starts = tf.cumsum(sizes, exclusive=True)

    def part(j: int):
        return tree.map_structure(
            lambda t: None if t is None else _unknown_if_empty(t[starts[j]:starts[j] + sizes[j]]),
            data)

    return [(part(j), tf.cast(sizes[j], tf.float32)) for j in range(k)]


def train_step(model: keras.Model, options: StepOptions, data: Any) -> dict[str, Any]:
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
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
        tree.map_structure(_unknown_if_empty, data))
    step = _ReplicaStep(model, options)
    if options.virtual_replicas:
        return _virtual_replicas_step(model, options, step, (x, y, sample_weight))
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


def _virtual_replicas_step(model: keras.Model, options: StepOptions, step: _ReplicaStep,
                           data: tuple) -> dict[str, Any]:
    """The step of ``virtual_replicas`` (:mod:`.virtual_replicas`): the shards' sums in the
    fixed order, then the update every replica applies alike."""
    if _synchronizes(model):
        raise ConfigError("virtual_replicas keeps each shard's BatchNorm statistics its own; "
                          "synchronized BatchNorm normalises over the whole batch instead. "
                          "Build the model with synchronized=False, or train without "
                          "virtual_replicas.")
    if step.loss_scale is not None:
        raise ConfigError("virtual_replicas cannot train with a LossScaleOptimizer (its scale "
                          "depends on the number of replicas); train in float32 or bfloat16.")
    sums, total = virtual_replicas.train_step(
        model, options, data, step._forward_backward, step._empty_shard)
    grads = step._scaled(sums, total)
    step._metric_states = [[v.value for v in metric.variables] for metric in model.metrics]
    flat_states = [value for states in step._metric_states for value in states]
    reduced_states = (algorithms.all_reduce_sum(flat_states, "collective", options.bytes_per_pack)
                      if flat_states else [])
    _apply(model.optimizer, [step.variables[i] for i in step.present], grads, tf.constant(True))
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
        self.loss_scale_factor = optimizer_apply.inner_optimizer(model.optimizer).loss_scale_factor
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
    optimizer_apply.OptimizerUpdate(optimizer, variables, grads, finite).merge()
