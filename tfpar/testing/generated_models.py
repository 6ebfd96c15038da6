"""Generated models and fits, each held to what its strategy entry promises.

Hand-picked cases cannot keep up with the models users train: this module describes a small
model and its fit as data (:class:`ModelCase`: its input, layers, form, loss, sample or class
weights, dtype policy, optimizer and batch edges), builds it, and generates such cases with
Hypothesis (:func:`model_cases`). :meth:`ModelCase.expected_promise` says what an entry
promises for the case on a number of devices, which
:meth:`tfpar.testing.StrategyTestCase.assertKeepsPromise` checks, with one device as the
reference implementation (differential testing):

- ``"same_on_any_world_size"``: with ``virtual_replicas``, every variable bit for bit the
  same on 1 device and on ``num_devices``;
- ``"matches_one_device"``: within rounding's measured reach of one device (tfpar's exact
  step; Keras's step where every batch divides evenly among the replicas);
- ``"in_sync"``: where per-replica BatchNorm statistics or random streams make one device a
  different computation (and Keras's step on uneven batches, Adam in 16 bits, whose
  rounding reaches a learning rate, and Adam on an Embedding under tfpar's step, whose
  second moment of a repeated token is the dense gradient's): every replica holds the same
  weights, optimizer state and random generators, and every copy is finite.

Whatever the promise, a case may instead be refused: by a
:class:`~tfpar.errors.TfparError` whose message is one line. Anything else (another
exception, a difference) is a counterexample.

Users hold their own layers to the same oracle by naming them::

    cases = tfpar.testing.model_cases(layers={"my_norm": lambda: MyNorm()})

A user's layer is held to matching one device without ``virtual_replicas`` (as ``Dense`` is):
one that draws random numbers or couples a batch's examples is checked with
``virtual_replicas`` only (draw ``virtual_replicas`` > 0 for it).

Hypothesis is needed only to generate (``pip install hypothesis``); a :class:`ModelCase`
built by hand needs nothing more than Keras.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfpar.errors import ConfigError

INPUTS = ("vector", "image", "tokens")
"""The kinds of input: 6 features, 6x6 images of 2 channels, or 5 token ids below 12."""
FORMS = ("sequential", "functional", "subclassed", "own_train_step")
"""How the model is written; ``own_train_step`` is a subclass with keras.io's own step."""
LOSSES = ("mean", "sum", "custom")
"""Sparse cross-entropy averaged (Keras's default) or summed, or a function of the user's."""
WEIGHTS = ("none", "sample", "class")
"""No weights, a weight per example in the data, or ``fit``'s ``class_weight``."""
DTYPES = ("float32", "bfloat16", "mixed_bfloat16")
"""The Keras dtype policies of the layers (the classifier stays float32 under a mixed one)."""
OPTIMIZERS = ("sgd_momentum", "adam_ema", "adamw", "clipped", "schedule")
"""SGD with momentum, Adam with EMA, AdamW, SGD with global-norm clipping, SGD on a schedule."""
BATCH_COUPLED = frozenset({"batch_norm"})
"""Layers whose output for an example depends on the other examples of its replica's batch."""
RANDOM = frozenset({"dropout", "gaussian_noise"})
"""Layers that draw random numbers in training."""
ADAPTIVE = frozenset({"adam_ema", "adamw"})
"""Optimizers that divide by a running gradient norm."""
KERAS_STEP_ENTRIES = frozenset({"mirrored", "central_storage", "default", "one_device"})
"""Entries that train with Keras's own step (the mean of the replicas' means)."""

_FEATURES = 4  # The last axis of every hidden layer.
_CLASSES = 3
_VOCABULARY = 12


class RunningMean(keras.layers.Layer):
    """A layer that assigns its state in ``call``: it subtracts a running mean of its inputs
    (features on the last axis), updated in training as BatchNormalization's is."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=(input_shape[-1],), initializer="zeros",
                                    trainable=False, aggregation="mean", name="mean")

    def call(self, inputs, training=False):
        if training:
            # A replica may get no examples (Keras's step runs the model on it): its batch's
            # mean is then taken as the running one, not 0 / 0.
            flat = ops.cast(ops.reshape(inputs, (-1, inputs.shape[-1])), self.mean.dtype)
            count = ops.cast(ops.shape(flat)[0], self.mean.dtype)
            batch_mean = ops.where(count > 0, ops.sum(flat, axis=0) / ops.maximum(count, 1.0),
                                   self.mean)
            self.mean.assign(0.9 * self.mean + 0.1 * batch_mean)
        return inputs - ops.cast(self.mean, inputs.dtype)


def _layer_makers() -> dict[str, Callable[[str, int], keras.layers.Layer]]:
    """Hidden layers by name: each takes the dtype policy and a seed, keeps the last axis at
    ``_FEATURES`` and works on any rank."""
    return {
        "dense": lambda dtype, seed: keras.layers.Dense(_FEATURES, activation="tanh",
                                                        dtype=dtype),
        "batch_norm": lambda dtype, seed: keras.layers.BatchNormalization(momentum=0.8,
                                                                          dtype=dtype),
        "layer_norm": lambda dtype, seed: keras.layers.LayerNormalization(dtype=dtype),
        "group_norm": lambda dtype, seed: keras.layers.GroupNormalization(groups=2,
                                                                          dtype=dtype),
        "dropout": lambda dtype, seed: keras.layers.Dropout(0.3, seed=seed, dtype=dtype),
        "gaussian_noise": lambda dtype, seed: keras.layers.GaussianNoise(0.1, seed=seed,
                                                                         dtype=dtype),
        "running_mean": lambda dtype, seed: RunningMean(dtype=dtype),
    }


def _recurrent_initializer(dtype: str) -> str:
    """Keras's default for a recurrent kernel, where Keras can build it: its ``Orthogonal``
    initializer computes a QR decomposition, which TensorFlow has no bfloat16 kernel for (a
    GRU of bfloat16 variables fails to build on one device too)."""
    return "glorot_uniform" if dtype == "bfloat16" else "orthogonal"


_RANK_LAYERS: dict[str, dict[str, Callable[[str, int], keras.layers.Layer]]] = {
    "vector": {},
    "image": {"conv": lambda dtype, seed: keras.layers.Conv2D(_FEATURES, 3, padding="same",
                                                              dtype=dtype)},
    "tokens": {"gru": lambda dtype, seed: keras.layers.GRU(
                   _FEATURES, return_sequences=True, dtype=dtype,
                   recurrent_initializer=_recurrent_initializer(dtype)),
               "lstm": lambda dtype, seed: keras.layers.LSTM(
                   _FEATURES, return_sequences=True, dtype=dtype,
                   recurrent_initializer=_recurrent_initializer(dtype))},
}


def layer_names(inputs: str, extra: Mapping[str, Callable[[], keras.layers.Layer]] = {}
                ) -> list[str]:
    """The hidden layers a case of ``inputs`` may hold (with the user's ``extra``)."""
    return [*_layer_makers(), *_RANK_LAYERS[inputs], *extra]


def custom_loss(y_true, y_pred):
    """A user's loss function: the squared distance of the softmax from the one-hot label."""
    target = ops.one_hot(ops.cast(ops.reshape(y_true, (-1,)), "int32"), _CLASSES)
    return ops.mean(ops.square(target - ops.softmax(ops.cast(y_pred, "float32"))), axis=-1)


class SubclassedModel(keras.Model):
    """A subclassed model: its layers in a list, called in turn."""

    def __init__(self, stack: list[keras.layers.Layer], **kwargs):
        super().__init__(**kwargs)
        self.stack = stack

    def call(self, inputs, training=False):
        for layer in self.stack:
            inputs = layer(inputs, training=training)
        return inputs


class OwnTrainStepModel(SubclassedModel):
    """A subclassed model with its own ``train_step``, written as keras.io's "customizing what
    happens in fit" guide teaches."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred, sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight)
        return {m.name: m.result() for m in self.metrics}


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """One small model and its fit, as data.

    Attributes:
        inputs: One of :data:`INPUTS`.
        layers: Hidden layers' names (:func:`layer_names`), in order.
        form: One of :data:`FORMS`.
        loss: One of :data:`LOSSES`.
        weights: One of :data:`WEIGHTS`.
        dtype: One of :data:`DTYPES`.
        optimizer: One of :data:`OPTIMIZERS`.
        examples: Examples in the data.
        batch_size: The global batch size (the last batch holds the rest).
        seed: Seeds the data and the random layers.
        extra_layers: The user's layers by name (``make()`` returns a new layer).
    """

    inputs: str = "vector"
    layers: tuple[str, ...] = ()
    form: str = "sequential"
    loss: str = "mean"
    weights: str = "none"
    dtype: str = "float32"
    optimizer: str = "sgd_momentum"
    examples: int = 16
    batch_size: int = 8
    seed: int = 0
    extra_layers: Mapping[str, Callable[[], keras.layers.Layer]] = dataclasses.field(
        default_factory=dict, compare=False)

    def __post_init__(self):
        for field, allowed in (("inputs", INPUTS), ("form", FORMS), ("loss", LOSSES),
                               ("weights", WEIGHTS), ("dtype", DTYPES),
                               ("optimizer", OPTIMIZERS)):
            if getattr(self, field) not in allowed:
                raise ConfigError(f"ModelCase {field} must be one of {', '.join(allowed)}. "
                                  f"Received: {field}={getattr(self, field)!r}.")
        unknown = [name for name in self.layers
                   if name not in layer_names(self.inputs, self.extra_layers)]
        if unknown:
            raise ConfigError(f"ModelCase layers for {self.inputs!r} inputs must be among "
                              f"{', '.join(layer_names(self.inputs, self.extra_layers))}. "
                              f"Received: {', '.join(unknown)}.")
        if self.examples < 1 or self.batch_size < 1:
            raise ConfigError("ModelCase examples and batch_size must be >= 1. Received: "
                              f"examples={self.examples}, batch_size={self.batch_size}.")

    def __str__(self) -> str:
        return (f"{self.form} {self.inputs} [{', '.join(self.layers) or 'no hidden layers'}], "
                f"{self.loss} loss, {self.weights} weights, {self.dtype}, {self.optimizer}, "
                f"{self.examples} examples in batches of {self.batch_size}, seed {self.seed}")

    # What it is made of.

    def _layer(self, name: str, index: int) -> keras.layers.Layer:
        if name in self.extra_layers:
            return self.extra_layers[name]()
        makers = {**_layer_makers(), **_RANK_LAYERS[self.inputs]}
        return makers[name](self.dtype, self.seed * 100 + index)

    def _stack(self) -> list[keras.layers.Layer]:
        dtype = self.dtype
        head = {"vector": lambda: keras.layers.Dense(_FEATURES, dtype=dtype),
                "image": lambda: keras.layers.Conv2D(_FEATURES, 3, padding="same", dtype=dtype),
                "tokens": lambda: keras.layers.Embedding(_VOCABULARY, _FEATURES, dtype=dtype)}
        classifier_dtype = "float32" if dtype.startswith("mixed") else dtype
        return [head[self.inputs](),
                *(self._layer(name, i) for i, name in enumerate(self.layers)),
                keras.layers.Flatten(dtype=dtype),
                keras.layers.Dense(_CLASSES, dtype=classifier_dtype)]

    def _input_shape(self) -> tuple[int, ...]:
        return {"vector": (6,), "image": (6, 6, 2), "tokens": (5,)}[self.inputs]

    def _optimizer(self) -> keras.optimizers.Optimizer:
        return {
            "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
            "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
            "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
            "clipped": lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5),
            "schedule": lambda: keras.optimizers.SGD(
                keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)),
        }[self.optimizer]()

    def _loss(self) -> Any:
        if self.loss == "custom":
            return custom_loss
        reduction = "sum" if self.loss == "sum" else "sum_over_batch_size"
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)

    # Building and training.

    def build(self) -> keras.Model:
        """A new compiled model (new variables and optimizer); call it in a strategy's scope
        to build it there."""
        stack = self._stack()
        inputs = keras.Input(self._input_shape(),
                             dtype="int32" if self.inputs == "tokens" else "float32")
        if self.form == "sequential":
            model = keras.Sequential([inputs, *stack])
        elif self.form == "functional":
            outputs = inputs
            for layer in stack:
                outputs = layer(outputs)
            model = keras.Model(inputs, outputs)
        else:
            model = (OwnTrainStepModel if self.form == "own_train_step" else SubclassedModel)(stack)
            model(inputs)
        model.compile(optimizer=self._optimizer(), loss=self._loss())
        return model

    def dataset(self) -> tf.data.Dataset:
        """The global batches (the same examples in the same order on every call)."""
        rng = np.random.default_rng(self.seed)
        shape = (self.examples, *self._input_shape())
        x = (rng.integers(0, _VOCABULARY, shape).astype("int32") if self.inputs == "tokens"
             else rng.random(shape, dtype=np.float32))
        y = rng.integers(0, _CLASSES, self.examples).astype("int32")
        parts: tuple = (x, y)
        if self.weights == "sample":
            parts = (x, y, rng.uniform(0.5, 2.0, self.examples).astype("float32"))
        return tf.data.Dataset.from_tensor_slices(parts).batch(self.batch_size)

    def train(self, model: keras.Model, dataset: tf.data.Dataset,
              strategy: tf.distribute.Strategy | None = None) -> list[float]:
        """Trains ``model`` one pass over ``dataset`` as the case says (its class weights);
        returns the loss logged after each step. A training function for
        :meth:`~tfpar.testing.StrategyTestCase.assertMatchesSingleDevice`."""
        del strategy  # fit uses the strategy the model was built under.
        losses: list[float] = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
        class_weight = {0: 1.0, 1: 2.0, 2: 0.5} if self.weights == "class" else None
        model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[record],
                  class_weight=class_weight)
        return losses

    # What it is held to.

    def batches(self) -> list[int]:
        """The global batches' sizes."""
        full, rest = divmod(self.examples, self.batch_size)
        return [self.batch_size] * full + ([rest] if rest else [])

    def expected_promise(self, entry: str, num_devices: int, virtual_replicas: int = 0) -> str:
        """What ``entry`` on ``num_devices`` promises for this case (the module docstring's
        names): ``same_on_any_world_size``, ``matches_one_device`` or ``in_sync``."""
        if virtual_replicas:
            return "same_on_any_world_size"
        if num_devices == 1:
            return "matches_one_device"
        if BATCH_COUPLED & set(self.layers) or RANDOM & set(self.layers):
            return "in_sync"
        if self.dtype != "float32" and self.optimizer in ADAPTIVE:
            # 16-bit arithmetic on a shard rounds otherwise than on the batch, and Adam turns
            # the rounding of a near-zero gradient into a step of up to its learning rate.
            return "in_sync"
        if self.inputs == "tokens" and self.optimizer in ADAPTIVE and entry == "allreduce":
            # Keras's sparse update on one device squares each occurrence of a repeated token
            # in Adam's second moment; tfpar's step squares their sum (the dense gradient).
            return "in_sync"
        if self.form == "own_train_step" and self.loss == "sum":
            # A model's own step with a sum loss logs N times the loss on N replicas (its
            # weights are one device's): a known defect, held by a named expected failure.
            return "in_sync"
        keras_step = entry in KERAS_STEP_ENTRIES or self.form == "own_train_step"
        if keras_step and (self.optimizer == "clipped"
                           or any(size % num_devices for size in self.batches())):
            # Keras's step clips each replica's gradient (warned) and averages the replicas'
            # means, which weighs uneven shards unequally (documented).
            return "in_sync"
        return "matches_one_device"


def model_cases(layers: Mapping[str, Callable[[], keras.layers.Layer]] | None = None, *,
                max_layers: int = 3, max_batch_size: int = 9) -> Any:
    """A Hypothesis strategy of :class:`ModelCase`: every input, form, loss, weighting,
    dtype policy and optimizer, up to ``max_layers`` hidden layers, and batch edges (a last
    batch of 1, smaller than the replicas, than ``virtual_replicas``).

    Args:
        layers: The user's own layers by name, each ``make()`` returning a new layer that
            keeps its input's shape; drawn beside tfpar's.
        max_layers: The most hidden layers in a case.
        max_batch_size: The largest global batch.

    Returns:
        A ``hypothesis.strategies.SearchStrategy`` of cases.

    Raises:
        ConfigError: If Hypothesis is not installed.
    """
    try:
        from hypothesis import strategies as st
    except ImportError:
        raise ConfigError("tfpar.testing.model_cases generates cases with Hypothesis, which is "
                          "not installed: pip install hypothesis.") from None
    extra = dict(layers or {})

    @st.composite
    def cases(draw):
        inputs = draw(st.sampled_from(INPUTS))
        hidden = draw(st.lists(st.sampled_from(layer_names(inputs, extra)),
                               max_size=max_layers))
        batch_size = draw(st.integers(1, max_batch_size))
        full = draw(st.integers(1, 2))
        rest = draw(st.sampled_from([0, 1, 2, 3]))
        return ModelCase(
            inputs=inputs, layers=tuple(hidden), form=draw(st.sampled_from(FORMS)),
            loss=draw(st.sampled_from(LOSSES)), weights=draw(st.sampled_from(WEIGHTS)),
            dtype=draw(st.sampled_from(DTYPES)), optimizer=draw(st.sampled_from(OPTIMIZERS)),
            examples=batch_size * full + (rest % batch_size if batch_size > 1 else 0),
            batch_size=batch_size, seed=draw(st.integers(0, 3)),
            extra_layers={name: extra[name] for name in hidden if name in extra})

    return cases()
