"""The hand-written data-parallel step (the seeds' from-scratch chapter), run by ``model.fit``.

:class:`AllReduceStrategy` (in one process) and :class:`MultiWorkerAllReduceStrategy` (across
worker processes) are ``tf.distribute`` strategies that carry tfpar's all-reduce options. A
model built and compiled in their scope trains with plain ``model.fit``, and every step is
tfpar's own::

    global batch --split--> replica shards        (the strategy's distributed dataset;
                                                   by ``split_weights`` for unequal devices)
    all replicas:  all-reduce the example counts  (issued first, needed after the backward)
    each replica:  forward, loss, backward         (tf.GradientTape on its shard, in
                                                   ``accumulation_steps`` micro-batches)
    all replicas:  all-reduce the gradients        (tfpar.allreduce: collective | naive | ring,
                                                   buckets of ``bytes_per_pack`` bytes, last
                                                   layer first; optionally in fp16/bf16)
    each replica:  the same update                 (the optimizer, applied once per replica)

The gradient is exact: each replica differentiates the *sum* of its examples' losses (its
mean loss, as ``model.compute_loss`` gives it, times its example count) and divides it by the
all-reduced global count before the gradients are all-reduced. So uneven
shards (a last partial batch, a batch that does not divide by the number of replicas, an empty
shard) weigh every example equally, unlike Keras's standard step, which averages the
replicas' means. Clipping applies to the reduced gradient, as on one device.

The optimizer must not reduce a second time: Keras 3's TensorFlow optimizer all-reduces
gradients itself whenever ``apply`` runs in a replica context. The step therefore leaves the
replica context with ``ReplicaContext.merge_call`` and updates each replica's copy of each
variable through ``strategy.extended.update`` and the optimizer's public ``update_step``.
Dynamic loss scaling (``LossScaleOptimizer``, mixed_float16) is done on the reduced gradient.
Optimizer features applied outside ``update_step`` (weight decay, EMA, gradient accumulation)
are refused with a clear error rather than silently skipped.

Everything else is Keras's ``fit``: compiled losses and metrics (any, per output), sample and
class weights, validation, callbacks, ``steps_per_execution``, ``evaluate`` and ``predict``.
How the strategy takes over the step: Keras calls ``strategy.run(model.train_step, ...)``; when
``train_step`` is Keras's own (not overridden by the model's class), the strategy runs
:func:`train_step` in its place. A model that overrides ``train_step`` keeps its own step.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from tfpar import allreduce
from tfpar.errors import ConfigError


# The dtypes gradients may travel in (``StepOptions.gradient_compression``).
COMPRESSIONS = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16}


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the all-reduce step reduces gradients.

    Attributes:
        algorithm: All-reduce algorithm, one of ``tfpar.allreduce.ALGORITHMS``.
        bytes_per_pack: Gradient bucket size in bytes (0: one reduction per variable).
        split_weights: Per-replica shares of each batch (e.g. ``(3, 1)`` for a fast and a slow
            device); an even split when ``None``.
        gradient_compression: ``"none"``, or ``"fp16"``/``"bf16"``: the gradients travel in
            that dtype (half the bytes) and are cast back to float32 after the all-reduce.
            They are divided by the global example count first, so they are in range.
        accumulation_steps: Each replica's shard of a batch is processed as this many
            micro-batches, one after the other (activations of one at a time in memory), their
            gradients summed locally, then all-reduced once: the update is exactly one step on
            the whole batch, with one all-reduce per ``accumulation_steps`` micro-batches.
    """

    algorithm: str = "collective"
    bytes_per_pack: int = allreduce.DEFAULT_BYTES_PER_PACK
    split_weights: Optional[tuple[float, ...]] = None
    gradient_compression: str = "none"
    accumulation_steps: int = 1

    def check(self, num_replicas: int, num_local_replicas: int) -> None:
        """Raises for options that cannot run on this many replicas.

        Raises:
            RegistryError: For an unknown algorithm.
            ConfigError: For a bad ``bytes_per_pack`` or ``split_weights``.
        """
        allreduce.check_algorithm(self.algorithm)
        if self.gradient_compression not in COMPRESSIONS:
            raise ConfigError(f"Unknown gradient_compression {self.gradient_compression!r}. "
                              f"Allowed: {', '.join(COMPRESSIONS)}.")
        if (isinstance(self.accumulation_steps, bool)
                or not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1):
            raise ConfigError("accumulation_steps must be an integer >= 1. Received: "
                              f"accumulation_steps={self.accumulation_steps!r}.")
        allreduce.check_bytes_per_pack(self.bytes_per_pack, "one reduction per variable")
        if self.algorithm != "collective" and num_local_replicas != num_replicas:
            raise ConfigError(f"All-reduce algorithm {self.algorithm!r} works within one "
                              "process; across workers use 'collective'.")
        if self.split_weights is None:
            return
        weights = list(self.split_weights)
        if (len(weights) != num_replicas
                or not all(isinstance(w, (int, float)) and w > 0 for w in weights)):
            raise ConfigError(f"split_weights needs one positive weight per replica "
                              f"({num_replicas}). Received: split_weights={weights}.")
        if num_local_replicas != num_replicas:
            raise ConfigError("split_weights works within one process, not across workers.")


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
        ConfigError: For no optimizer, weight decay, EMA or gradient accumulation.
    """
    if optimizer is None:
        raise ConfigError("Compile the model with an optimizer and a loss before training it, "
                          "e.g. model.compile(optimizer='sgd', loss=...).")
    optimizer = _inner(optimizer)
    unsupported = {
        "weight_decay": getattr(optimizer, "weight_decay", None),
        "use_ema": getattr(optimizer, "use_ema", False),
        "gradient_accumulation_steps": getattr(optimizer, "gradient_accumulation_steps", None),
    }
    used = [name for name, value in unsupported.items() if value]
    if used:
        hint = (" For gradient accumulation, give the strategy accumulation_steps instead "
                "(exact, and one all-reduce per accumulated batch)."
                if "gradient_accumulation_steps" in used else "")
        raise ConfigError(f"The all-reduce step does not support optimizer {', '.join(used)}. "
                          f"Use an optimizer without it, or the 'mirrored' strategy.{hint}")


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

        all-reduce the example count   (tiny; issued first, runs during the forward pass)
        forward, backward              (per micro-batch, one after the other, summed locally)
        scale by 1 / global count      (then cast to the compression dtype, if any)
        all-reduce the gradients       (buckets from the last layer to the first, each issued
                                        as soon as its gradients exist) and the metrics' states
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
    # Issued before the model runs and needed only after the backward pass.
    total = allreduce.all_reduce_sum([tf.reshape(count, [1])], options.algorithm,
                                     options.bytes_per_pack)[0][0]
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
    # Scaled to the global mean before the all-reduce (exact: every replica divides by the
    # same global count), so compressed gradients are in range and the sum needs no division.
    scale = 1.0 / tf.maximum(total, 1.0)
    if loss_scale is not None:
        scale /= tf.cast(loss_scale.dynamic_scale, scale.dtype)
    wire = COMPRESSIONS[options.gradient_compression]
    sent = [g * tf.cast(scale, g.dtype) for g in grads]
    if wire is not None:
        sent = [tf.cast(g, wire) if g.dtype.is_floating else g for g in sent]
    # The metrics' states (the epoch's running totals of this replica) travel with the
    # gradients: summed, they are the global batch's.
    metric_states = [[v.value for v in metric.variables] for metric in model.metrics]
    flat_states = [value for states in metric_states for value in states]
    # From the last layer to the first: the order the backward pass produces them in.
    reduced = allreduce.all_reduce_sum(sent[::-1] + flat_states, options.algorithm,
                                       options.bytes_per_pack)
    reduced_grads = [tf.cast(r, g.dtype) for r, g in zip(reduced[:len(sent)][::-1], grads)]
    reduced_states = reduced[len(sent):]
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


def is_keras_step(fn, step: str) -> bool:
    """Whether ``fn`` is a model's Keras ``step`` (``"train_step"``, ``"test_step"``) that its
    class did not override: what Keras's ``fit``/``evaluate`` pass to ``Strategy.run``."""
    return (isinstance(getattr(fn, "__self__", None), keras.Model)
            and getattr(fn, "__func__", None) is getattr(keras.Model, step))


class _AllReduceStep:
    """Mixin for a ``tf.distribute`` strategy: ``model.fit`` runs :func:`train_step`."""

    step_options: StepOptions

    def run(self, fn, args=(), kwargs=None, options=None):
        """``Strategy.run``; Keras's own ``train_step`` is replaced by the all-reduce step.

        The step's logs are the global batch's on every replica already, so the first local
        replica's are returned as plain tensors: Keras then logs them as they are instead of
        averaging every scalar across the replicas (across workers, one collective per log
        per step; their cost was within the benchmark's noise for 2 workers on loopback).
        """
        if not is_keras_step(fn, "train_step"):
            return super().run(fn, args=args, kwargs=kwargs, options=options)
        logs = super().run(functools.partial(train_step, fn.__self__, self.step_options),
                           args=args, kwargs=kwargs, options=options)
        return tree.map_structure(lambda v: self.experimental_local_results(v)[0], logs)

    def experimental_distribute_dataset(self, dataset, options=None):
        """``Strategy.experimental_distribute_dataset``, split by ``split_weights`` if set."""
        weights = self.step_options.split_weights
        if weights is None:
            return super().experimental_distribute_dataset(dataset, options)
        replicas = self.num_replicas_in_sync

        def shards(*batch):
            # One global batch becomes `replicas` consecutive elements, which the strategy
            # deals out to the replicas in turn.
            element = batch[0] if len(batch) == 1 else batch
            size = tf.shape(next(t for t in tree.flatten(element) if t is not None))[0]
            sizes = split_sizes(size, weights)
            starts = tf.cumsum(sizes, exclusive=True)
            return tf.data.Dataset.range(replicas).map(
                lambda r: tree.map_structure(
                    lambda t: t[starts[r]:starts[r] + sizes[r]], element))

        split = dataset.flat_map(shards)
        return self.distribute_datasets_from_function(lambda _: split, options)


class AllReduceStrategy(_AllReduceStep, tf.distribute.MirroredStrategy):
    """``MirroredStrategy`` whose ``model.fit`` steps are tfpar's exact all-reduce step.

    Attributes:
        step_options: The :class:`StepOptions` it trains with.
    """

    def __init__(self, devices: Sequence[str], cross_device_ops: tf.distribute.CrossDeviceOps,
                 step_options: StepOptions = StepOptions()):
        super().__init__(list(devices), cross_device_ops=cross_device_ops)
        step_options.check(self.num_replicas_in_sync, len(self.extended.worker_devices))
        self.step_options = step_options


class MultiWorkerAllReduceStrategy(_AllReduceStep, tf.distribute.MultiWorkerMirroredStrategy):
    """``MultiWorkerMirroredStrategy`` whose ``model.fit`` steps are tfpar's all-reduce step.

    Attributes:
        step_options: The :class:`StepOptions` it trains with (``collective`` only).
    """

    def __init__(self, cluster_resolver, communication_options,
                 step_options: StepOptions = StepOptions()):
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options)
        step_options.check(self.num_replicas_in_sync, len(self.extended.worker_devices))
        self.step_options = step_options
