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

Why one module of this length: the step is one argument, that every example weighs the same on
any split; its checks of the loss and optimizer, the replica's objective and the update read
together, in the order the step runs them.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from tfpar import errors
from tfpar.allreduce import algorithms
from tfpar.allreduce import virtual_replicas
from tfpar.allreduce.options import StepOptions
from tfpar.compat import keras_fixes
from tfpar.compat import keras_internals
from tfpar.compat import optimizer_apply
from tfpar.compat.keras_fixes import scaled_losses
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


_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def sums_losses(model: keras.Model) -> bool:
    """Whether a compiled loss of ``model`` adds its examples' losses up rather than averaging
    them (``reduction="sum"``, or none): such a loss must stay whole on each replica, where
    a mean loss is weighed by the replica's share of the global batch.

    Read from ``model.loss`` (what ``compile`` was given): a loss given by name or as a
    function is Keras's mean (``sum_over_batch_size``).
    """
    return any(isinstance(loss, keras.losses.Loss) and loss.reduction not in _MEAN_REDUCTIONS
               for loss in tree.flatten(getattr(model, "loss", None)))


def _means_by_weight(model: keras.Model) -> list[str]:
    """The compiled losses that divide by their examples' summed weights."""
    return [getattr(loss, "name", type(loss).__name__)
            for loss in tree.flatten(getattr(model, "loss", None))
            if isinstance(loss, keras.losses.Loss)
            and loss.reduction == "mean_with_sample_weight"]


def _local_objective(model: keras.Model, x, y, y_pred, sample_weight, count: tf.Tensor,
                     total: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor]:
    """This replica's part of the global loss, and the loss it logs for its examples.

    With ``total`` unknown (every loss a mean), the part is the *sum* of the replica's
    examples' losses: Keras's ``compute_loss`` (and every loss it adds up) divides a mean loss
    by the number of replicas, expecting their gradients to be summed; that is multiplied
    back, then by the replica's example count, and the step divides the all-reduced sum by the
    global count. With ``total`` known (a sum loss among them), Keras weighs each mean loss by
    the replica's share of the global batch (``count / total``) and keeps each sum loss whole,
    so the replicas' parts add up to the global loss itself.

    Returns:
        ``(objective, logged)``: what is differentiated, and the loss logged weighted by
        ``count`` (its weighted replicas' sum is the global batch's loss).
    """
    kwargs = {"training": True} if _accepts_training(model.compute_loss) else {}
    if total is None:
        loss = model.compute_loss(x, y, y_pred, sample_weight, **kwargs)
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        mean = tf.cast(loss * tf.cast(replicas, loss.dtype), tf.float32)
        return mean * count, mean
    with scaled_losses.mean_losses_scaled_by(count / total):
        loss = model.compute_loss(x, y, y_pred, sample_weight, **kwargs)
    part = tf.cast(loss, tf.float32)
    if part.shape.rank != 0:
        # An unreduced loss (reduction=None): its examples' losses, whose gradient is that of
        # their sum. Keras logs their mean; logged times total / count would be N times it.
        return part, tf.math.divide_no_nan(tf.reduce_sum(part), tf.cast(tf.size(part),
                                                                         tf.float32))
    return part, tf.math.divide_no_nan(part * total, count)


def _check_losses(model: keras.Model, sample_weight: Any) -> None:
    """Raises for a compiled loss the step cannot weigh exactly across replicas."""
    by_weight = _means_by_weight(model)
    if by_weight and sample_weight is not None:
        raise ConfigError(
            f"The all-reduce step cannot train {', '.join(by_weight)} with "
            "reduction='mean_with_sample_weight' and sample or class weights: each replica "
            "would divide by its own examples' weights, not the batch's. Use "
            "reduction='sum_over_batch_size' (Keras's default) or 'sum'.")
    if sums_losses(model):
        reason = keras_fixes.unavailable("scaled_loss_records")
        if reason:
            raise ConfigError(
                "The all-reduce step weighs a loss with reduction='sum' through tfpar's fix "
                f"'scaled_loss_records', not applied here: {reason}. Use "
                "reduction='sum_over_batch_size' (Keras's default).")
        keras_fixes.install(("scaled_loss_records",))


def _synchronizes(layer: keras.layers.Layer) -> bool:
    """Whether ``layer`` or a layer inside it communicates across replicas in its call."""
    return bool(getattr(layer, "synchronized", False)) or any(
        _synchronizes(inner) for inner in getattr(layer, "layers", ()))


def aggregated_state(model: keras.Model) -> list[str]:
    """The paths of the model's non-trainable variables that replicas aggregate when one is
    assigned (``add_weight(..., aggregation="mean")``, ``"sum"``,
    ``"only_first_replica"``): an assignment in a layer's call is then a synchronization
    point of every replica, which cannot sit in a conditional branch."""
    return [v.path for v in model.non_trainable_variables
            if str(getattr(v, "aggregation", "none") or "none").lower() != "none"
            and not v.path.endswith("seed_generator_state")]


EMPTY_SHARD_REFUSAL = (
    "A batch left a replica (or one of its accumulation_steps micro-batches) without "
    "examples, and this model must run on every replica (a layer synchronizes across "
    "replicas, or assigns a variable with an aggregation) while it convolves, which the "
    "CPU kernels of TensorFlow cannot do on an empty batch; give every batch at least "
    "replicas x accumulation_steps examples (drop_remainder=True, or a batch size that "
    "leaves a last batch that large).")
"""The refusal of a step that would run a convolution on an empty shard of a CPU device.
TensorFlow 2.21's CPU kernels: with oneDNN, the convolution of an empty batch fails ("input
depth must be evenly divisible by filter depth"); without it, the depthwise convolution's
filter gradient of an empty batch is uninitialised memory (up to 1e34 in the weights). No
quote marks: TensorFlow escapes them in an assertion's text."""


def _convolves(model: keras.Model) -> bool:
    """Whether ``model`` holds a convolution's kernel: a variable of three or more dimensions
    (Keras's convolution layers', wherever they are held, and a kernel a layer convolves with
    itself; a dense or embedding kernel has two)."""
    return any(len(v.shape) >= 3 for v in model.trainable_variables)


class _StatelessPass(keras.StatelessScope):
    """A shard's stateless pass (``keras.StatelessScope``), which also keeps the variables
    assigned in it (the scope keeps their values only), and in which a value a layer assigns
    reads back as a variable's read does: without a gradient through what computed it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.assigned: dict[int, Any] = {}

    def add_update(self, update):
        variable, value = update
        self.assigned[id(variable)] = variable
        super().add_update((variable, tf.stop_gradient(value)))


def _assigned_in(scope: _StatelessPass, model: keras.Model, stateless: list) -> tuple[list, list]:
    """What a stateless pass assigned: the values ``stateless``'s variables end at (their
    given value where it did not assign them), and every other variable it assigned (metrics:
    Keras's per-output loss trackers update inside ``compute_loss``, a layer or a nested model
    may update its own) with its value, in the order assigned.

    Raises:
        ConfigError: If the pass assigned a trainable variable: the step's gradient is of the
            value the step started with, and an assignment in one shard's pass would be lost.
    """
    given = {id(variable) for variable, _ in stateless}
    trainable = [variable.path for variable in model.trainable_variables
                 if id(variable) in scope.assigned]
    if trainable:
        raise ConfigError(
            f"virtual_replicas runs a replica's shards side by side, each from the step's "
            f"start; the model assigns the trainable variable(s) {', '.join(trainable)} in its "
            "call, which would be lost. Assign only non-trainable variables (or update "
            "metrics) in call().")
    ends = [scope.get_current_value(variable) if scope.get_current_value(variable) is not None
            else value for variable, value in stateless]
    return ends, [(variable, scope.get_current_value(variable))
                  for key, variable in scope.assigned.items() if key not in given]


def empty_shard_fails(model: keras.Model) -> bool:
    """Whether running ``model`` on an empty shard fails or goes wrong: it convolves, on CPU
    devices (GPUs' kernels are not known to: they are not refused)."""
    devices = model.distribute_strategy.extended.worker_devices
    return _convolves(model) and any("CPU" in device.upper() for device in devices)


Shapes = tuple[tuple[int | None, ...] | None, ...]
"""A dataset's element shapes, flattened (``None`` for a component of unknown rank or not a
tensor)."""


def declared_shapes(element_spec: Any) -> Shapes:
    """The shapes a dataset declares for its elements (:data:`Shapes`)."""
    return tuple(tuple(spec.shape.as_list()) if isinstance(spec, tf.TensorSpec)
                 and spec.shape.rank is not None else None
                 for spec in tree.flatten(element_spec))


def _as_declared(data: Any, declared: Sequence[Shapes], always: tf.Tensor, *,
                 exact: bool) -> Any:
    """``data`` with the shapes its dataset declares, to the trace and to graph optimization.

    Keras traces a step with the batches' static shapes (Keras 3.16 does, for
    ``steps_per_execution=1``, relaxing a dimension only once it has changed), so whether a
    replica's batch size (or a padded sequence's length) is known depends on how the batches
    happened to be dealt: on 4 devices a replica given one example of every batch so far has a
    static batch of 1, on one device the same shard is cut from a batch whose size changed.
    Grappler specializes a graph to the sizes it knows (a mean's gradient divides by a known
    count, which constant folding turns into a multiplication by its reciprocal: other bits),
    so under ``virtual_replicas`` (``exact``) the same shard's gradient would differ with the
    world size.

    Where ``exact``, the batch size is hidden (the shards are cut at run time on any world
    size), and a dimension past it where the datasets distributed for the step whose shapes fit
    the trace's (``declared``) all leave it unknown; one they declare stays known, as a layer
    may need it. Otherwise only a batch size of 0 is hidden: Keras's losses then return their
    unreduced per-example values (shape ``(0,)``) instead of a mean, which fails while tracing
    (the step never runs the model on such a shard, but it is traced).

    ``tf.compat.v1.placeholder_with_default`` hides a shape from the trace but not from
    Grappler, which infers through it. A conditional does: its result's shape is what both
    branches share, and ``always`` (a scalar ``True`` read from a variable, which Grappler
    cannot fold) keeps the branch of other sizes from ever running.
    """
    flat = tree.flatten(data)
    hidden: dict[int, list[int]] = {}
    for i, tensor in enumerate(flat):
        if not isinstance(tensor, tf.Tensor) or tensor.shape.rank in (None, 0):
            continue
        shape = tensor.shape.as_list()
        fitting = [each for shapes in declared if len(shapes) == len(flat)
                   for each in (shapes[i],) if each is not None and len(each) == len(shape)
                   and all(size in (None, traced) for size, traced in zip(each[1:], shape[1:]))]
        dims = [k for k in range(1, len(shape)) if exact and shape[k] is not None and fitting
                and all(each[k] is None for each in fitting)]
        if shape[0] is not None and (exact or shape[0] == 0):
            dims.insert(0, 0)
        if dims:
            hidden[i] = dims
    if not hidden:
        return data

    def other_sizes():
        # Tensors of other static sizes in the hidden dimensions (1 where the size is 0, else
        # 0), never used.
        return [tf.zeros(tf.stack([(1 if flat[i].shape[k] == 0 else 0) if k in dims
                                   else tf.shape(flat[i])[k]
                                   for k in range(flat[i].shape.rank)]), flat[i].dtype)
                for i, dims in hidden.items()]

    relaxed = tf.cond(always, lambda: [tf.identity(flat[i]) for i in hidden], other_sizes)
    for i, tensor in zip(hidden, relaxed):
        flat[i] = tensor
    return tree.pack_sequence_as(data, flat)


def _micro_batches(data, count: tf.Tensor, k: int,
                   always: tf.Tensor) -> list[tuple[Any, tf.Tensor]]:
    """Splits this replica's shard into ``k`` consecutive micro-batches (sizes differ by <= 1),
    a micro-batch the trace knows is empty given an unknown size (:func:`_as_declared`)."""
    if k == 1:
        return [(data, count)]
    sizes = split_sizes(tf.cast(count, tf.int32), [1.0] * k)
    starts = tf.cumsum(sizes, exclusive=True)

    def part(j: int):
        return _as_declared(tree.map_structure(
            lambda t: None if t is None else t[starts[j]:starts[j] + sizes[j]], data), (),
            always, exact=False)

    return [(part(j), tf.cast(sizes[j], tf.float32)) for j in range(k)]


def train_step(model: keras.Model, options: StepOptions, data: Any,
               declared: Sequence[Shapes] = ()) -> dict[str, Any]:
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
        declared: The element shapes of the datasets distributed for it
            (:func:`declared_shapes`): the step traces the shapes they declare (see
            :func:`_as_declared`).

    Returns:
        The metrics, as Keras's ``train_step`` returns them.

    Raises:
        ConfigError: For an optimizer feature the step cannot apply.
    """
    check_optimizer(model.optimizer, model.trainable_variables)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
        _as_declared(data, declared, model.optimizer.iterations >= 0,
                     exact=bool(options.virtual_replicas)))
    _check_losses(model, sample_weight)
    step = _ReplicaStep(model, options)
    first_input = next(t for t in tree.flatten(x) if t is not None)
    count = tf.cast(tf.shape(first_input)[0], tf.float32)
    # A sum loss is weighed by the global count before the backward pass (see
    # _local_objective); fp16 has too little range for a sum of losses' gradients, so they are
    # divided by it before the cast. Either needs the count reduced on its own, issued before
    # the model runs. Otherwise the count travels in the last bucket and the sums are divided
    # after it: one collective fewer per step.
    if step.weighs_in_loss or options.gradient_compression == "fp16":
        step.total = algorithms.all_reduce_sum([tf.reshape(count, [1])], options.algorithm,
                                               options.bytes_per_pack)[0][0]
    if options.virtual_replicas:
        return _virtual_replicas_step(model, options, step, (x, y, sample_weight))
    grads = step.local_gradients(x, y, sample_weight, count)
    reduced_grads, reduced_states = step.all_reduce(grads, count)
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
    aggregated = aggregated_state(model)
    if aggregated:
        raise ConfigError(
            f"virtual_replicas keeps each shard's layer state its own; {', '.join(aggregated)} "
            "is aggregated across replicas when assigned (add_weight(aggregation=...)). "
            "Create it with aggregation='none' (as BatchNormalization's statistics are), or "
            "train without virtual_replicas.")
    if step.loss_scale is not None:
        raise ConfigError("virtual_replicas cannot train with a LossScaleOptimizer (its scale "
                          "depends on the number of replicas); train in float32 or bfloat16.")
    sums, total = virtual_replicas.train_step(model, options, data, step)
    grads = step.scaled(sums, total)
    reduced_states = step.reduced_metric_states()
    _apply(model.optimizer, [step.variables[i] for i in step.present], grads, tf.constant(True))
    return step.logs(reduced_states)


def seed_states(model: keras.Model) -> list[Any]:
    """The model's random generators' states (``[seed, counter]`` each: a draw adds 1 to the
    counter)."""
    return [v for v in model.non_trainable_variables if v.path.endswith("seed_generator_state")]


class _ReplicaStep:
    """One replica's part of a traced step: what it trains with, and its phases (local
    gradients, their all-reduce, the logs).

    Attributes:
        variables: The model's trainable variables.
        present: Indices of the variables that get a gradient (known once traced).
        loss_scale: The ``LossScaleOptimizer``, if the model's optimizer is one.
        seeds: The model's random generators' states.
        weighs_in_loss: Whether a mean loss is weighed by the replica's share of the global
            batch inside the loss (a sum loss among the compiled losses), rather than the
            gradients' sum divided by the global count after the all-reduce.
        total: The global example count, where it is reduced before the backward pass.
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
        self.seeds = seed_states(model)
        self.weighs_in_loss = sums_losses(model)
        self.total: tf.Tensor | None = None
        self._metric_states: list[list] = []  # Read after the forward passes updated them.

    def local_gradients(self, x, y, sample_weight, count: tf.Tensor) -> list:
        """The gradient of the sum of this replica's examples' losses, micro-batch by
        micro-batch (``accumulation_steps``), summed locally."""
        grads: list = []
        # Layers that all-reduce inside the forward pass (synchronized BatchNormalization), or
        # assign variables replicas aggregate, cannot sit in a conditional branch: the model
        # then runs on an empty shard too.
        synchronizes = _synchronizes(self.model) or bool(aggregated_state(self.model))
        refuses_empty = synchronizes and empty_shard_fails(self.model)
        self._seeds_at_start = [tf.identity(v.value) for v in self.seeds]
        self._ran = tf.constant(0.0)
        for micro, micro_count in _micro_batches(
                (x, y, sample_weight), count, self.options.accumulation_steps,
                self.model.optimizer.iterations >= 0):
            micro_x, micro_y, micro_weight = micro

            def run_micro_batch(x=micro_x, y=micro_y, weight=micro_weight, n=micro_count):
                return self.forward_backward(x, y, weight, n)

            # One micro-batch after the other: the next starts once this one's gradients exist.
            checks = [tf.debugging.Assert(
                micro_count > 0, [errors.RUN_TIME_REFUSAL + EMPTY_SHARD_REFUSAL])
            ] if refuses_empty else []
            with tf.control_dependencies([*grads, *checks]):
                if synchronizes:
                    step_grads = run_micro_batch()
                else:
                    # tf.cond traces the forward pass first, which fills `present`.
                    step_grads = tf.cond(micro_count > 0, run_micro_batch, self.empty_shard)
            self._ran += tf.cast(micro_count > 0, tf.float32)
            grads = [a + b for a, b in zip(grads, step_grads)] if grads else step_grads
        return grads

    def forward_backward(self, x, y, sample_weight, count) -> list:
        """One shard's forward and backward pass: the gradient of its part of the global loss
        (of the variables that get one, as dense tensors), its loss and metrics recorded."""
        grads, logged, y_pred, _, _ = self.gradients(x, y, sample_weight, count)
        self.record(x, y, sample_weight, count, logged, y_pred)
        return grads

    def gradients(self, x, y, sample_weight, count, stateless: list | None = None
                  ) -> tuple[list, tf.Tensor, Any, list, list]:
        """One shard's forward and backward pass, recording nothing: the gradient of its part
        of the global loss (of the variables that get one, as dense tensors), the mean loss
        to log, the predictions, the values ``stateless``'s variables end at, and the other
        variables the pass updated (metrics'), with their values (``(variable, value)``: to
        assign when the shard is recorded).

        Args:
            x, y, sample_weight: The shard's data.
            count: Its example count.
            stateless: ``(variable, value)`` pairs: the pass runs in a ``keras.StatelessScope``
                that reads each variable as its value and assigns nothing (so that passes can
                run side by side); ``None``: on the variables themselves.

        Raises:
            ConfigError: If, in a stateless pass, the model assigns a trainable variable (it
                would be lost).
        """
        model, loss_scale = self.model, self.loss_scale
        with tf.GradientTape() as tape:
            with contextlib.ExitStack() as stack:
                scope = None
                if stateless is not None:
                    # The trainable variables read inside the tape (their gradient flows
                    # through the read), as a regularizer reads them in a stateless scope.
                    scope = stack.enter_context(_StatelessPass(
                        [(v, v.value) for v in model.trainable_variables] + stateless,
                        collect_losses=True))
                y_pred = model(x, training=True)
                objective, logged = _local_objective(
                    model, x, y, y_pred, sample_weight, count,
                    self.total if self.weighs_in_loss else None)
            ends, updates = ([], []) if scope is None else _assigned_in(
                scope, model, stateless or [])
            if self.loss_scale_factor and loss_scale is None:
                objective = objective * self.loss_scale_factor
            if loss_scale is not None:
                # In float16 the backward pass of a loss *sum* overflows where Keras's mean
                # does not: shrink it to about a mean first (by this replica's share of the
                # global batch) and undo that in float32 below, so the sum stays exact.
                replicas = tf.distribute.get_replica_context().num_replicas_in_sync
                shrink = (tf.constant(1.0) if self.weighs_in_loss
                          else 1.0 / (tf.maximum(count, 1.0) * replicas))
                objective = loss_scale.scale_loss(objective * shrink)
        grads = tape.gradient(objective, self.variables)
        # An Embedding's gradient is sparse (IndexedSlices), and its dense form may have lost
        # its static shape; the empty shard's branch and the all-reduce's buckets are dense,
        # of the variable's shape.
        grads = [g if g is None or (isinstance(g, tf.Tensor) and g.shape.is_fully_defined())
                 else tf.reshape(tf.convert_to_tensor(g), v.shape)
                 for g, v in zip(grads, self.variables)]
        if loss_scale is not None:
            grads = [None if g is None else g / tf.cast(shrink, g.dtype) for g in grads]
        if not self.present:
            self.present.extend(i for i, g in enumerate(grads) if g is not None)
        return [grads[i] for i in self.present], logged, y_pred, ends, updates

    def record(self, x, y, sample_weight, count, logged, y_pred) -> None:
        """Records a shard's loss and metrics (see :meth:`gradients`)."""
        model = self.model
        # The mean loss logged, weighted by the examples: its replicas' sum is the global
        # mean. No public API updates the loss Keras logs (tfpar.compat.keras_internals).
        keras_internals.loss_tracker(model).update_state(logged, sample_weight=count)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def empty_shard(self) -> list:
        """The zero gradients of a shard without examples."""
        # A replica with no examples (a batch smaller than the number of replicas) adds
        # nothing; it must not run the model (TensorFlow's CPU convolution backward fails on
        # an empty batch).
        return [tf.zeros_like(self.variables[i]) for i in self.present]

    def scaled(self, grads: list, total: tf.Tensor) -> list:
        """``grads`` divided by the global count ``total`` (unless the loss weighed them
        already) and by the loss scale."""
        # Every replica scales by the same factors (1 / the global count, 1 / the loss
        # scale), so scaling before or after the sum is exact; fp16 scales before (into its
        # range), the others after (with the count from the last bucket).
        scale = tf.constant(1.0) if self.weighs_in_loss else 1.0 / tf.maximum(total, 1.0)
        if self.loss_scale is not None:
            scale /= tf.cast(self.loss_scale.dynamic_scale, scale.dtype)
        if self.loss_scale_factor:
            scale /= self.loss_scale_factor
        return [g * tf.cast(scale, g.dtype) for g in grads]

    def seed_draws(self) -> list[tf.Tensor]:
        """How far this replica's shards moved each random generator, as float32 (0 where
        a shard did not run)."""
        return [tf.cast(v.value - start, tf.float32)
                for v, start in zip(self.seeds, self._seeds_at_start)]

    def end_seeds(self, start: list[tf.Tensor], draws: list[tf.Tensor], ran: tf.Tensor,
                  runs: int) -> None:
        """Sets every random generator to where ``runs`` shards' draws leave it from ``start``,
        on every replica alike, from the draws of all shards that ran (``draws`` summed,
        ``ran`` counted): a shard without examples does not run the model, so its replica
        would otherwise end behind the others."""
        for variable, value, moved in zip(self.seeds, start, draws):
            per_shard = tf.round(moved / tf.maximum(ran, 1.0))
            variable.assign(value + tf.cast(per_shard * runs, value.dtype))

    def metric_states(self) -> list:
        """The metrics' states (each replica's running totals, this step's included), flat."""
        self._metric_states = [[v.value for v in metric.variables]
                               for metric in self.model.metrics]
        return [value for states in self._metric_states for value in states]

    def reduced_metric_states(self) -> list:
        """The metrics' states summed over the replicas, in one all-reduce of their own."""
        flat_states = self.metric_states()
        return (algorithms.all_reduce_sum(flat_states, "collective", self.options.bytes_per_pack)
                if flat_states else [])

    def all_reduce(self, grads: list, count: tf.Tensor) -> tuple[list, list]:
        """All-reduces the gradients (in buckets, last layer first) with the metrics' states,
        the random generators' draws and, unless :attr:`total` is known already, the example
        count in the last bucket.

        Returns:
            The global gradient (divided by the global count) and the metrics' global states.
        """
        options, total = self.options, self.total
        sent = self.scaled(grads, total) if total is not None else grads
        wire = _WIRE_DTYPES[options.gradient_compression]
        if wire is not None:
            sent = [tf.cast(g, wire) if g.dtype.is_floating else g for g in sent]
        # The metrics' states (the epoch's running totals of this replica, this step's
        # included) travel with the gradients: summed, they are the global batch's.
        flat_states = self.metric_states()
        draws = self.seed_draws()
        tail = (flat_states + ([tf.concat([tf.reshape(d, [-1]) for d in draws]
                                          + [tf.reshape(self._ran, [1])], 0)] if draws else [])
                + ([tf.reshape(count, [1])] if total is None else []))
        # From the last layer to the first: the order the backward pass produces them in.
        reduced = algorithms.all_reduce_sum(sent[::-1] + tail, options.algorithm,
                                           options.bytes_per_pack)
        reduced_grads = [tf.cast(r, g.dtype) for r, g in zip(reduced[:len(sent)][::-1], grads)]
        if total is None:
            reduced_grads = self.scaled(reduced_grads, reduced[-1][0])
        if draws:
            summed = reduced[len(sent) + len(flat_states)]
            self.end_seeds(self._seeds_at_start, _split_like(summed[:-1], draws), summed[-1],
                           self.options.accumulation_steps)
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


def _split_like(flat: tf.Tensor, like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``flat`` cut into tensors of the shapes of ``like``, in order."""
    parts, offset = [], 0
    for tensor in like:
        n = int(np.prod(tensor.shape))
        parts.append(tf.reshape(flat[offset:offset + n], tensor.shape))
        offset += n
    return parts


def _apply(optimizer: keras.optimizers.Optimizer, variables: list, grads: list,
           finite: tf.Tensor) -> None:
    """Updates every replica's copy of ``variables`` with its copy of the reduced gradients,
    as Keras's ``Optimizer.apply`` would on one device (see the module docstring)."""
    optimizer_apply.OptimizerUpdate(optimizer, variables, grads, finite).merge()
