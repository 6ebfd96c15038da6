"""The hand-written data-parallel training loop (the seeds' from-scratch chapter, in TensorFlow).

One step, on every replica at once::

    global batch --split--> replica shards        (the strategy's distributed dataset, or
                                                   split_weights for unequal devices)
    each replica:  forward, loss, backward         (tf.GradientTape on its shard)
    all replicas:  all-reduce the gradient sums    (tfpar.allreduce: collective | naive | ring)
    each replica:  the same update                 (the optimizer, applied once per replica)

The gradient is exact: each replica differentiates the *sum* of its examples' losses, the sums
and the example counts are all-reduced together, and the total is divided by the global count.
So uneven shards (a last partial batch, a batch that does not divide by the number of
replicas, an empty shard) weigh every example equally, unlike Keras ``fit``, which averages
the replicas' means. Gradient clipping applies to the reduced gradient.

The optimizer must not reduce a second time: Keras 3's TensorFlow optimizer all-reduces
gradients itself whenever ``apply`` runs in a replica context, and cannot run ``apply`` in a
cross-replica context. The loop therefore leaves the replica context with
``ReplicaContext.merge_call`` and updates each replica's copy of each variable with that
replica's copy of the reduced gradient through ``strategy.extended.update`` and the
optimizer's public ``update_step`` (then counts the step in ``optimizer.iterations``).
Dynamic loss scaling (``LossScaleOptimizer``, mixed_float16) is done by the loop itself,
on the reduced gradient. Optimizer features applied outside ``update_step`` (weight decay,
EMA, gradient accumulation) are refused with a clear error rather than silently skipped.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfpar import allreduce
from tfpar import data as data_lib
from tfpar.errors import ConfigError

# Compiled steps per model (weakly held: they go with the model).
_STEPS: "weakref.WeakKeyDictionary[keras.Model, dict]" = weakref.WeakKeyDictionary()

_LOOP_OPTIONS = ("algorithm", "bytes_per_pack", "split_weights")


def loop_options(strategy_options: dict[str, Any]) -> dict[str, Any]:
    """Returns the options of a registry entry that configure the loop rather than the strategy."""
    return {k: v for k, v in strategy_options.items() if k in _LOOP_OPTIONS}


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


def check_split_weights(weights: Optional[Sequence[float]], strategy: tf.distribute.Strategy
                        ) -> Optional[list[float]]:
    """Returns the weights as floats after checking there is one positive weight per replica.

    Raises:
        ConfigError: If not, or if the strategy spans several workers.
    """
    if weights is None:
        return None
    weights = [float(w) for w in weights]
    if len(weights) != strategy.num_replicas_in_sync or min(weights) <= 0:
        raise ConfigError(f"split_weights needs one positive weight per replica "
                          f"({strategy.num_replicas_in_sync}). Received: {weights}.")
    if len(strategy.extended.worker_devices) != strategy.num_replicas_in_sync:
        raise ConfigError("split_weights works within one process, not across workers.")
    return weights


def build_optimizer(model: keras.Model, strategy: tf.distribute.Strategy) -> None:
    """Creates the optimizer's slot variables under ``strategy`` if they do not exist yet.

    Building twice would replace the slots (and with them restored state) on optimizers that
    do not guard against it, so this builds only an unbuilt optimizer.
    """
    if not model.optimizer.built:
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)


def _per_example_loss(model: keras.Model):
    loss = model.loss
    if loss is None:
        raise ConfigError("Compile the model with a loss before training it with the "
                          "all-reduce loop, e.g. model.compile(optimizer=..., loss=...).")
    if isinstance(loss, (dict, list, tuple)):
        raise ConfigError("The all-reduce loop supports one loss for one output. Received: "
                          f"loss={loss!r}.")
    loss = keras.losses.get(loss)
    # A Loss object's call() is its unreduced, per-example loss; plain loss functions already
    # return per-example values.
    return loss.call if isinstance(loss, keras.losses.Loss) else loss


def _inner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def check_optimizer(optimizer: keras.optimizers.Optimizer) -> None:
    """Raises for optimizer features the loop's update path does not apply.

    A ``LossScaleOptimizer`` (mixed_float16) is supported: its inner optimizer is checked.

    Raises:
        ConfigError: For weight decay, EMA or gradient accumulation.
    """
    optimizer = _inner(optimizer)
    unsupported = {
        "weight_decay": getattr(optimizer, "weight_decay", None),
        "use_ema": getattr(optimizer, "use_ema", False),
        "gradient_accumulation_steps": getattr(optimizer, "gradient_accumulation_steps", None),
    }
    used = [name for name, value in unsupported.items() if value]
    if used:
        raise ConfigError(f"The all-reduce loop does not support optimizer {', '.join(used)}. "
                          "Use an optimizer without it, or the 'mirrored' strategy with fit.")


def _clip(optimizer: keras.optimizers.Optimizer, grads: list) -> list:
    if optimizer.global_clipnorm:
        return tf.clip_by_global_norm(grads, optimizer.global_clipnorm)[0]
    if optimizer.clipnorm:
        return [tf.clip_by_norm(g, optimizer.clipnorm) for g in grads]
    if optimizer.clipvalue:
        return [tf.clip_by_value(g, -optimizer.clipvalue, optimizer.clipvalue) for g in grads]
    return grads


class _Step:
    """Builds the compiled multi-step training function for one model and strategy."""

    def __init__(self, model, strategy, algorithm, bytes_per_pack, steps_per_execution,
                 split_weights, jit_compile=False):
        self.model = model
        self.strategy = strategy
        self.algorithm = algorithm
        self.bytes_per_pack = bytes_per_pack
        self.steps_per_execution = steps_per_execution
        self.split_weights = split_weights
        self.loss_fn = _per_example_loss(model)
        # Mixed float16 training wraps the optimizer for dynamic loss scaling.
        self.loss_scale = (model.optimizer if isinstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer) else None)
        self.inner = _inner(model.optimizer)
        # Running totals of the epoch: [loss sum, correct predictions, examples].
        self.totals = tf.Variable(tf.zeros([3], tf.float64), trainable=False, name="totals")
        self._functions = {}
        self._compute = (tf.function(self._forward_backward, jit_compile=True) if jit_compile
                         else self._forward_backward)

    def _forward_backward(self, x, y):
        """This replica's loss sum, correct predictions, example count and gradients.

        The compute-heavy part of a step, and the part XLA compiles with ``jit_compile``
        (the all-reduce and the update around it stay outside).
        """
        model = self.model
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            per_example = tf.cast(self.loss_fn(y, y_pred), tf.float32)
            count = tf.cast(tf.shape(per_example)[0], tf.float32)
            loss_sum = tf.reduce_sum(per_example)
            # Regularisation counts once per example, so the global objective is
            # mean(per-example loss) + regularisation, as in single-device training.
            if model.losses:
                loss_sum += tf.add_n(model.losses) * count
            objective = loss_sum
            if self.loss_scale is not None:
                # In float16 the backward pass of a loss *sum* overflows where Keras's mean
                # does not: shrink it to about a mean first (by this replica's share of the
                # global batch) and undo that in float32 below, so the sum stays exact.
                shrink = 1.0 / (tf.maximum(count, 1.0)
                                * self.strategy.num_replicas_in_sync)
                objective = self.loss_scale.scale_loss(objective * shrink)
        grads = tape.gradient(objective, model.trainable_variables)
        if self.loss_scale is not None:
            grads = [None if g is None else g / tf.cast(shrink, g.dtype) for g in grads]
        correct = tf.constant(0.0)
        if len(y_pred.shape) == 2 and len(y.shape) == 1:
            predicted = tf.argmax(y_pred, axis=-1, output_type=tf.int32)
            correct = tf.reduce_sum(tf.cast(tf.equal(predicted, tf.cast(y, tf.int32)),
                                            tf.float32))
        return loss_sum, correct, count, grads

    def _replica_step(self, x, y):
        variables = self.model.trainable_variables
        loss_sum, correct, count, grads = self._compute(x, y)
        present = [i for i, g in enumerate(grads) if g is not None]
        stats = tf.stack([loss_sum, correct, count])
        # The statistics travel in the same all-reduce as the gradients.
        reduced = allreduce.all_reduce_sum([stats] + [grads[i] for i in present],
                                           self.algorithm, self.bytes_per_pack)
        stats, reduced_grads = reduced[0], reduced[1:]
        scale = 1.0 / tf.maximum(stats[2], 1.0)
        if self.loss_scale is not None:
            scale /= tf.cast(self.loss_scale.dynamic_scale, scale.dtype)
        reduced_grads = [g * tf.cast(scale, g.dtype) for g in reduced_grads]
        # Identical on every replica, since the gradients were all-reduced. Only loss scaling
        # needs it (it is a pass over every gradient).
        finite = (tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in reduced_grads])
                  if self.loss_scale is not None else tf.constant(True))
        reduced_grads = _clip(self.inner, reduced_grads)
        present_vars = [variables[i] for i in present]

        def apply(strategy, grads, learning_rate, finite):
            # Cross-replica context: each replica's copy of each variable is updated with that
            # replica's copy of the (already reduced) gradient, and nothing is reduced again.
            def update():
                for grad, variable in zip(grads, present_vars):
                    strategy.extended.update(variable.value, self._update, group=False,
                                             args=(grad, learning_rate, variable.constraint))
                self.inner.iterations.assign_add(1)
                return tf.constant(True)

            if self.loss_scale is None:
                update()
                return
            # Dynamic loss scaling, as LossScaleOptimizer does: skip a step whose gradients
            # overflowed and halve the scale; double it after enough finite steps.
            tf.cond(strategy.experimental_local_results(finite)[0],
                    lambda: tf.logical_and(update(), self._grow_scale()), self._shrink_scale)

        # The learning rate is read here, in the replica context, so every replica's update uses
        # its local copy: read in the cross-replica context, every device would wait for the
        # first device's copy (measured: half the throughput of ResNet-18 on 2 devices).
        learning_rate = tf.identity(self.inner.learning_rate)
        tf.distribute.get_replica_context().merge_call(
            apply, args=(reduced_grads, learning_rate, finite))
        return stats

    def _grow_scale(self):
        scaler = self.loss_scale
        grow = tf.equal(scaler.step_counter, scaler.dynamic_growth_steps - 1)
        scaler.dynamic_scale.assign(tf.where(grow, scaler.dynamic_scale * 2.0,
                                             scaler.dynamic_scale))
        scaler.step_counter.assign(tf.where(grow, tf.zeros_like(scaler.step_counter),
                                            scaler.step_counter + 1))
        return tf.constant(True)

    def _shrink_scale(self):
        self.loss_scale.step_counter.assign(tf.zeros_like(self.loss_scale.step_counter))
        self.loss_scale.dynamic_scale.assign(self.loss_scale.dynamic_scale * 0.5)
        return tf.constant(False)

    def _update(self, variable, grad, learning_rate, constraint):
        self.inner.update_step(grad, variable, learning_rate)
        if constraint is not None:
            variable.assign(constraint(variable))

    def _distribute_batch(self, batch):
        x, y = batch
        sizes = split_sizes(tf.shape(y)[0], self.split_weights)
        xs, ys = tf.split(x, sizes), tf.split(y, sizes)
        return (self.strategy.experimental_distribute_values_from_function(
                    lambda ctx: xs[ctx.replica_id_in_sync_group]),
                self.strategy.experimental_distribute_values_from_function(
                    lambda ctx: ys[ctx.replica_id_in_sync_group]))

    def _one_step(self, batch):
        if self.split_weights is not None:
            batch = self._distribute_batch(batch)
        stats = self.strategy.run(self._replica_step, args=batch)
        # Every replica holds the same reduced statistics: take the first local copy.
        self.totals.assign_add(tf.cast(self.strategy.experimental_local_results(stats)[0],
                                       tf.float64))

    def steps_function(self, steps: int):
        """Returns a compiled function that runs ``steps`` steps from an iterator.

        The number of steps is fixed per function (one for full executions, one for an
        epoch's remainder), so no step needs a host round-trip to learn whether data is left.
        """
        if steps not in self._functions:
            def run(iterator):
                if steps == 1:  # The common case needs no while loop around the step.
                    self._one_step(next(iterator))
                else:
                    for _ in tf.range(steps):
                        self._one_step(next(iterator))
                return self._logs()
            self._functions[steps] = tf.function(run)
        return self._functions[steps]

    @tf.function
    def until_exhausted(self, iterator):
        """Runs up to ``steps_per_execution`` steps; for datasets of unknown length."""
        steps = tf.constant(0)
        for _ in tf.range(self.steps_per_execution):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            self._one_step(optional.get_value())
            steps += 1
        return steps, self._logs()

    def _logs(self) -> dict[str, tf.Tensor]:
        count = tf.maximum(self.totals[2], 1.0)
        return {"loss": self.totals[0] / count, "accuracy": self.totals[1] / count}


def _run_known_length(step, iterator, steps_per_epoch, callbacks, model):
    # Steps are dispatched without waiting for the previous ones (the logs stay tensors), as
    # Keras fit does; a callback that reads a figure waits for it.
    logs, done = {}, 0
    while done < steps_per_epoch and not model.stop_training:
        steps = min(step.steps_per_execution, steps_per_epoch - done)
        callbacks.on_train_batch_begin(done)
        logs = step.steps_function(steps)(iterator)
        done += steps
        callbacks.on_train_batch_end(done - 1, logs)
    return logs


def _run_until_exhausted(step, iterator, callbacks, model):
    logs, done = step._logs(), 0
    while not model.stop_training:
        callbacks.on_train_batch_begin(done)
        ran, new_logs = step.until_exhausted(iterator)
        if int(ran) == 0:
            break
        logs, done = new_logs, done + int(ran)
        callbacks.on_train_batch_end(done - 1, logs)
    return logs


def fit(model: keras.Model, dataset: tf.data.Dataset, *, epochs: int = 1,
        strategy: Optional[tf.distribute.Strategy] = None,
        callbacks: Optional[Sequence[keras.callbacks.Callback]] = None, verbose: int = 1,
        algorithm: str = "collective", bytes_per_pack: int = allreduce.DEFAULT_BYTES_PER_PACK,
        steps_per_execution: int = 1, split_weights: Optional[Sequence[float]] = None,
        initial_epoch: int = 0, steps_per_epoch: Optional[int] = None,
        jit_compile: bool = False) -> keras.callbacks.History:
    """Trains a compiled model with the hand-written all-reduce loop, like ``model.fit``.

    Keras callbacks, progress bars and ``History`` work as with ``fit``; the logs hold ``loss``
    (mean per-example loss of the epoch so far) and ``accuracy`` (for class-id labels).

    Args:
        model: A model built and compiled (optimizer, loss) under ``strategy``'s scope.
        dataset: ``(x, y)`` batches of the global batch size.
        epochs: Index of the last epoch to train (as in ``fit``).
        strategy: The strategy; the model's own by default.
        callbacks: Keras callbacks.
        verbose: 0 silent, 1 progress bar, 2 one line per epoch.
        algorithm: All-reduce algorithm, one of ``tfpar.allreduce.ALGORITHMS``.
        bytes_per_pack: Gradient bucket size in bytes (0: one reduction per variable).
        steps_per_execution: Training steps per compiled call.
        split_weights: Per-replica shares of each batch (e.g. ``[3, 1]`` for a fast and a slow
            device); an even split when ``None``.
        initial_epoch: Epoch to start from (for resumed training).
        steps_per_epoch: Steps in an epoch; the dataset's length by default (needed for a
            repeated dataset).
        jit_compile: Compile the steps with XLA (one replica, or GPUs).

    Returns:
        The ``History`` callback.

    Raises:
        ConfigError: If an argument is invalid or the model is not compiled.
        RegistryError: If ``algorithm`` is unknown.
    """
    strategy = strategy or model.distribute_strategy
    allreduce.check_algorithm(algorithm)
    if not isinstance(steps_per_execution, int) or steps_per_execution < 1:
        raise ConfigError("steps_per_execution must be an integer >= 1. "
                          f"Received: {steps_per_execution!r}.")
    if getattr(model, "optimizer", None) is None:
        raise ConfigError("Compile the model (optimizer and loss) before training it.")
    check_optimizer(model.optimizer)
    split_weights = check_split_weights(split_weights, strategy)
    build_optimizer(model, strategy)  # Slots exist before tracing.
    # Like Keras's model.train_function, the compiled step is kept for later calls: tracing a
    # model such as ResNet-18 takes seconds.
    key = (id(strategy), id(model.optimizer), algorithm, bytes_per_pack, steps_per_execution,
           tuple(split_weights or ()), jit_compile)
    steps_of_model = _STEPS.setdefault(model, {})
    if key not in steps_of_model:
        steps_of_model[key] = _Step(model, strategy, algorithm, bytes_per_pack,
                                    steps_per_execution, split_weights, jit_compile)
    step = steps_of_model[key]
    distributed = (dataset if split_weights is not None
                   else data_lib.distribute(strategy, dataset))
    # With steps_per_epoch given, the dataset is one stream over all epochs (as in Keras fit);
    # otherwise every epoch iterates the whole dataset afresh.
    repeated = steps_per_epoch is not None
    if steps_per_epoch is None and dataset.cardinality() >= 0:
        steps_per_epoch = int(dataset.cardinality())
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=epochs,
        steps=steps_per_epoch, model=model)
    model.stop_training = False
    callback_list.on_train_begin()
    logs = {}
    iterator = None
    for epoch in range(initial_epoch, epochs):
        step.totals.assign(tf.zeros([3], tf.float64))
        callback_list.on_epoch_begin(epoch)
        if iterator is None or not repeated:
            iterator = iter(distributed)
        if steps_per_epoch is not None:
            logs = _run_known_length(step, iterator, steps_per_epoch, callback_list, model)
        else:
            logs = _run_until_exhausted(step, iterator, callback_list, model)
        # One host round-trip per epoch: the epoch's figures as Python numbers.
        logs = {k: float(v) for k, v in logs.items()}
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history
