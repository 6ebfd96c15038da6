"""Tests of the all-reduce step under model.fit: equality with one device, uneven data, options."""

import functools
import unittest
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import models
from tfpar import testing
from tfpar.allreduce import algorithms
from tfpar.allreduce import step
from tfpar.errors import ConfigError


def compiled(build, optimizer=lambda: keras.optimizers.SGD(0.1)):
    """Returns a model_fn: a new model from ``build`` compiled with a new optimizer."""

    def model_fn():
        model = build()
        model.compile(optimizer=optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    return model_fn


tiny_lenet = compiled(functools.partial(models.lenet, num_classes=3, input_shape=(18, 18, 1)))


def users_model():
    """A model a user might write: Sequential, regularised, with a constraint."""
    return keras.Sequential([
        keras.Input((18, 18, 1)), keras.layers.Flatten(),
        keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2),
                           kernel_constraint=keras.constraints.MaxNorm(1.0)),
        keras.layers.Dense(3)])


class EquivalenceTest(testing.StrategyTestCase):

    @parameterized.product(algorithm=("collective", "naive", "ring"), num_examples=(8, 24))
    def test_lenet_equals_single_device(self, algorithm, num_examples):
        # 8 examples: one step; 24: three steps of 8.
        self.assertMatchesSingleDevice(
            tiny_lenet, testing.tiny_dataset(num_examples=num_examples),
            self.strategy("allreduce", 2, algorithm=algorithm))

    def test_users_model_equals_single_device(self):
        self.assertMatchesSingleDevice(compiled(users_model), testing.tiny_dataset(),
                                       self.strategy("allreduce", 2))

    def test_mirrored_fit_equals_single_device(self):
        self.assertMatchesSingleDevice(tiny_lenet, testing.tiny_dataset(),
                                       self.strategy("mirrored", 2))

    @parameterized.named_parameters(
        ("momentum", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
        ("adam", lambda: keras.optimizers.Adam(1e-2)))
    def test_keras_optimizers(self, optimizer):
        self.assertMatchesSingleDevice(compiled(users_model, optimizer),
                                       testing.tiny_dataset(num_examples=24),
                                       self.strategy("allreduce", 2))

    def test_clipping_applies_to_the_reduced_gradient(self):
        def clipped():
            return keras.optimizers.SGD(0.1, global_clipnorm=0.05)
        self.assertMatchesSingleDevice(compiled(users_model, clipped), testing.tiny_dataset(),
                                       self.strategy("allreduce", 2))

    def test_mirrored_fit_clips_each_replica_before_reducing(self):
        # Keras 3's documented-here defect: under mirrored + fit, global_clipnorm clips each
        # replica's partial gradient, so the result differs from single-device training.
        def clipped():
            return keras.optimizers.SGD(0.1, global_clipnorm=0.05)
        with self.assertRaisesRegex(AssertionError, "differ"):
            self.assertMatchesSingleDevice(compiled(users_model, clipped),
                                           testing.tiny_dataset(),
                                           self.strategy("mirrored", 2))


class MixedPrecisionTest(testing.StrategyTestCase):

    def setUp(self):
        super().setUp()
        keras.mixed_precision.set_global_policy("mixed_float16")
        self.addCleanup(keras.mixed_precision.set_global_policy, "float32")

    def test_dynamic_loss_scaling_equals_single_device(self):
        def model_fn():
            model = testing.tiny_model()
            self.assertIsInstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            return model
        self.assertMatchesSingleDevice(model_fn, testing.tiny_dataset(24, batch_size=8),
                                       self.strategy("allreduce", 2),
                                       rtol=1e-3, atol=1e-4)

    def test_overflowing_step_is_skipped_and_the_scale_halved(self):
        def model_fn():
            model = testing.tiny_model()
            model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
                              keras.optimizers.SGD(0.1), initial_scale=2.0**40),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return model
        strategy = self.strategy("allreduce", 2)
        self.assertMatchesSingleDevice(model_fn, testing.tiny_dataset(8), strategy,
                                       rtol=1e-3, atol=1e-4)
        with strategy.scope():
            model = model_fn()
        before = model.get_weights()
        testing.fit_steps(model, testing.tiny_dataset(8), strategy)
        self.assertEqual(model.optimizer.dynamic_scale.numpy(), 2.0**39)
        self.assertAllClose(before, model.get_weights())

    def test_adamw_ema_and_accumulation_with_loss_scaling(self):
        def model_fn():
            model = testing.tiny_model()
            model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.AdamW(1e-2, weight_decay=0.05, use_ema=True,
                                       gradient_accumulation_steps=2)),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return model
        self.assertMatchesSingleDevice(model_fn, testing.tiny_dataset(21, batch_size=6),
                                       self.strategy("allreduce", 2), rtol=1e-3, atol=1e-4)


class CommunicationOptionsTest(testing.StrategyTestCase):

    @parameterized.product(accumulation_steps=(2, 3), algorithm=("collective", "ring"))
    def test_accumulation_equals_one_step_on_the_whole_batch(self, accumulation_steps,
                                                            algorithm):
        # Batches of 8, 8 and 7 over 2 replicas: shards of 4 (and 4+3) cut into 2 or 3
        # micro-batches, uneven ones among them (3 -> 2+1, 4 -> 2+1+1, 3 -> 1+1+1).
        self.assertMatchesSingleDevice(
            compiled(users_model), testing.tiny_dataset(23, batch_size=8),
            self.strategy("allreduce", 2, algorithm=algorithm,
                          accumulation_steps=accumulation_steps))

    def test_accumulation_with_more_micro_batches_than_examples(self):
        # Shards of 1 and 0 examples cut into 4 micro-batches: most are empty.
        self.assertMatchesSingleDevice(
            compiled(users_model), testing.tiny_dataset(3, batch_size=1),
            self.strategy("allreduce", 2, accumulation_steps=4))

    @parameterized.product(compression=("fp16", "bf16"), algorithm=("collective", "naive"))
    def test_compression_equals_single_device_within_its_rounding(self, compression,
                                                                  algorithm):
        # bf16 keeps 8 significant bits, fp16 11: one step's relative error is about 2^-8
        # or 2^-11 of a gradient, times the learning rate.
        tolerance = {"fp16": 1e-3, "bf16": 1e-2}[compression]
        self.assertMatchesSingleDevice(
            compiled(users_model), testing.tiny_dataset(16),
            self.strategy("allreduce", 2, algorithm=algorithm,
                          gradient_compression=compression), rtol=tolerance, atol=tolerance)

    @parameterized.parameters(
        # bf16 has float32's range: the gradient sums travel as they are, then the loss
        # tracker's float32 states with the example count, and the sums are divided after.
        ("bf16", (tf.bfloat16, tf.float32)),
        # fp16's range needs the gradients divided by the global count before the cast: the
        # count goes first, on its own.
        ("fp16", (tf.float32, tf.float16, tf.float32)))
    def test_compression_sends_half_the_bytes(self, compression, dtypes):
        calls = []
        original = algorithms._reduce

        def spy(flats, chosen, context):
            calls.extend(f.dtype for f in flats)
            return original(flats, chosen, context)

        strategy = self.strategy("allreduce", 2, gradient_compression=compression)
        with strategy.scope():
            model = compiled(users_model)()
        with mock.patch.object(algorithms, "_reduce", spy):
            model.fit(testing.tiny_dataset(8), verbose=0)
        # Each reduction by both replicas.
        self.assertEqual(calls, [dtype for dtype in dtypes for _ in range(2)])

    def test_bad_options(self):
        with self.assertRaisesRegex(ConfigError, r"Unknown gradient_compression 'int8'\. "
                                                 r"Allowed: none, fp16, bf16"):
            self.strategy("allreduce", 2, gradient_compression="int8")
        with self.assertRaisesRegex(ConfigError, r"accumulation_steps must be an integer >= 1\. "
                                                 r"Received: accumulation_steps=0"):
            self.strategy("allreduce", 2, accumulation_steps=0)

    def test_a_models_own_step_is_refused_keras_accumulation_with_the_alternative(self):
        # A train_step of the model's own calls the optimizer, which cannot accumulate under
        # tf.distribute; Keras's train_step (the all-reduce step) can.
        strategy = self.strategy("allreduce", 2)
        with strategy.scope():
            model = compiled(OwnStepModel.create, lambda: keras.optimizers.SGD(
                0.1, gradient_accumulation_steps=2))()
        with self.assertRaisesRegex(ConfigError, "A model's own train_step cannot use it here"):
            model.fit(testing.tiny_dataset(8), verbose=0)


class OwnStepModel(keras.Model):
    """A subclassed model with its own train_step."""

    @classmethod
    def create(cls):
        inputs = keras.Input((18, 18, 1))
        return cls(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(inputs)))

    def train_step(self, data):
        return super().train_step(data)


class OptimizerFeaturesTest(testing.StrategyTestCase):
    """What Keras's Optimizer.apply does around update_step, under the all-reduce step: the
    same weights and losses as one device, over steps with an uneven last batch."""

    DATA = dict(num_examples=21, batch_size=6)  # Batches 6, 6, 6, 3: shards 3+3 ... 2+1.

    def check(self, optimizer, num_devices=2, build=users_model, **options):
        self.assertMatchesSingleDevice(compiled(build, optimizer),
                                       testing.tiny_dataset(**self.DATA),
                                       self.strategy("allreduce", num_devices, **options))

    @parameterized.named_parameters(
        ("adamw", lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05)),
        ("lion", lambda: keras.optimizers.Lion(1e-3, weight_decay=0.1)),
        ("sgd", lambda: keras.optimizers.SGD(0.1, weight_decay=0.05)),
        ("adam", lambda: keras.optimizers.Adam(1e-2, weight_decay=0.05)))
    def test_weight_decay(self, optimizer):
        self.check(optimizer)

    def test_weight_decay_honours_exclusions(self):
        def optimizer():
            adamw = keras.optimizers.AdamW(1e-2, weight_decay=0.5)
            adamw.exclude_from_weight_decay(var_names=["bias"])
            return adamw
        self.check(optimizer)

    @parameterized.named_parameters(
        ("every_step", lambda: keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)),
        ("overwrite_every_2", lambda: keras.optimizers.Adam(
            1e-2, use_ema=True, ema_momentum=0.7, ema_overwrite_frequency=2)))
    def test_ema(self, optimizer):
        self.check(optimizer)

    @parameterized.product(steps=(2, 3), micro_batches=(1, 2))
    def test_keras_gradient_accumulation(self, steps, micro_batches):
        # With the strategy's own micro-batches too: they compose (micro-batches within a
        # batch, one update every `steps` batches).
        self.check(lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=steps,
                                                 global_clipnorm=0.1),
                   accumulation_steps=micro_batches)

    def test_the_users_adamw_with_ema(self):
        self.check(lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01, use_ema=True))

    @parameterized.named_parameters(
        ("clipnorm", lambda: keras.optimizers.SGD(0.1, clipnorm=0.02)),
        ("clipvalue", lambda: keras.optimizers.SGD(0.1, clipvalue=0.001)),
        ("loss_scale_factor", lambda: keras.optimizers.SGD(0.1, loss_scale_factor=128.0)))
    def test_clipping_and_loss_scale_factor(self, optimizer):
        self.check(optimizer)

    def test_one_device(self):
        self.check(lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05, use_ema=True,
                                                  gradient_accumulation_steps=2),
                   num_devices=1)

    @parameterized.named_parameters(
        ("nadam", keras.optimizers.Nadam, "Nadam: .*_backend_update_step"),
        ("muon", keras.optimizers.Muon, "Muon: .*_apply_weight_decay"))
    def test_optimizers_that_change_apply_are_refused(self, optimizer, message):
        strategy = self.strategy("allreduce", 2)
        with strategy.scope():
            model = compiled(users_model, optimizer)()
        before = model.get_weights()
        with self.assertRaisesRegex(ConfigError, "The all-reduce step cannot train with "
                                    + message):
            model.fit(testing.tiny_dataset(8), verbose=0)
        self.assertAllClose(before, model.get_weights())


class HeldConvolution(keras.layers.Layer):
    """A convolution held by a plain layer, as an attribute."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.convolution = keras.layers.Conv2D(4, 3)

    def call(self, x):
        return self.convolution(x)


class OwnConvolution(keras.layers.Layer):
    """A layer that convolves with its own kernel (``keras.ops.conv``)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(3, 3, input_shape[-1], 4))

    def call(self, x):
        return keras.ops.conv(x, self.kernel)


CONVOLUTIONS = {
    "conv2d": lambda: keras.layers.Conv2D(4, 3),
    "separable": lambda: keras.layers.SeparableConv2D(4, 3),
    "held_by_a_layer": HeldConvolution,
    "own_kernel": OwnConvolution,
    "time_distributed": lambda: keras.layers.TimeDistributed(keras.layers.Conv1D(4, 3)),
}


def synchronized_convnet(convolution: str = "conv2d"):
    """A convolution and a BatchNormalization that normalises over every replica's examples."""
    return lambda: keras.Sequential([
        keras.Input((18, 18, 1)), CONVOLUTIONS[convolution](),
        keras.layers.BatchNormalization(synchronized=True), keras.layers.Flatten(),
        keras.layers.Dense(3)])


class UnevenDataTest(testing.StrategyTestCase):

    @parameterized.named_parameters(
        # A batch of 5 on 2 replicas splits 3+2: each example must weigh the same.
        ("five_split_three_two", 10, 5),
        # A last batch of 1 splits 1+0: a full step, not half of one.
        ("last_batch_of_one", 9, 8),
        # The very first batch does not split evenly (Keras's symbolic build crashed on it).
        ("first_batch_uneven", 3, 3))
    def test_allreduce_is_exact(self, num_examples, batch_size):
        self.assertMatchesSingleDevice(
            compiled(users_model), testing.tiny_dataset(num_examples, batch_size=batch_size),
            self.strategy("allreduce", 2))

    def test_three_replicas_with_remainders(self):
        self.assertMatchesSingleDevice(
            compiled(users_model), testing.tiny_dataset(11, batch_size=4),
            self.strategy("allreduce", 3))

    @parameterized.parameters(*CONVOLUTIONS)
    def test_a_synchronized_convnet_on_a_replica_without_examples_is_refused(self, convolution):
        # The model runs on every replica (its BatchNormalization all-reduces), and the CPU
        # kernels cannot convolve an empty batch (oneDNN's fail; without oneDNN a depthwise
        # filter's gradient is garbage): the last batch of 1 is refused in one line.
        strategy = self.strategy("allreduce", 2)
        with strategy.scope():
            model = compiled(synchronized_convnet(convolution))()
        with self.assertRaises(ConfigError) as refused:
            model.fit(testing.tiny_dataset(9, batch_size=8), verbose=0)
        self.assertEqual(str(refused.exception), step.EMPTY_SHARD_REFUSAL)

    def test_a_synchronized_convnet_whose_batches_fill_every_replica_trains(self):
        self.assertMatchesSingleDevice(compiled(synchronized_convnet()),
                                       testing.tiny_dataset(10, batch_size=8),
                                       self.strategy("allreduce", 2))

    @parameterized.parameters((10, 5), (9, 8), (3, 3))
    def test_mirrored_fit_does_not_crash(self, num_examples, batch_size):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = compiled(users_model)()
        history = model.fit(testing.tiny_dataset(num_examples, batch_size=batch_size),
                            verbose=0)
        self.assertTrue(np.isfinite(history.history["loss"][0]))


class OptionsTest(testing.StrategyTestCase):

    def test_split_weights_keep_the_gradient_exact(self):
        self.assertMatchesSingleDevice(compiled(users_model), testing.tiny_dataset(),
                                       self.strategy("allreduce", 2, split_weights=(3, 1)))

    def test_split_weights_give_each_replica_its_share(self):
        strategy = self.strategy("allreduce", 2, split_weights=(3, 1))
        shards = strategy.experimental_distribute_dataset(testing.tiny_dataset(8, batch_size=8))
        x, _ = next(iter(shards))
        self.assertEqual([len(v) for v in strategy.experimental_local_results(x)], [6, 2])

    def test_split_sizes(self):
        self.assertAllEqual(step.split_sizes(tf.constant(8), [3, 1]), [6, 2])
        self.assertAllEqual(step.split_sizes(tf.constant(5), [1, 1, 1]), [2, 2, 1])
        self.assertAllEqual(step.split_sizes(tf.constant(1), [1, 3]), [0, 1])

    @parameterized.parameters("collective", "naive", "ring")
    def test_the_chosen_algorithm_and_buckets_run(self, algorithm):
        # A user's unchanged fit must reduce with the options the strategy was given.
        calls = []
        original = algorithms._reduce

        def spy(flats, chosen, context):
            calls.append((chosen, [int(f.shape[0]) for f in flats]))
            return original(flats, chosen, context)

        strategy = self.strategy("allreduce", 2, algorithm=algorithm, bytes_per_pack=64)
        with strategy.scope():
            model = compiled(users_model)()
        with mock.patch.object(algorithms, "_reduce", spy):
            model.fit(testing.tiny_dataset(8), verbose=0)
        # One step, traced once: users_model's gradients (2,592, 8, 24 and 3 floats) from
        # the last layer to the first, in 64-byte buckets, each its own reduction (no two
        # neighbours fit together), then the loss tracker's total and count with the
        # step's example count, together.
        # Both replicas make each call, in step (merge_call synchronises them).
        expected = [[3], [24], [8], [2592], [3]]
        self.assertEqual(calls, [(algorithm, sizes) for sizes in expected for _ in range(2)])

    def test_steps_per_execution(self):
        # 5 steps run as executions of 3 + 2 must train exactly as 5 single steps.
        strategy = self.strategy("allreduce", 2)
        histories, weights, initial = [], [], None
        for steps in (1, 3):
            with strategy.scope():
                model = compiled(users_model)()
                model.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=steps,
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            if initial is None:
                initial = model.get_weights()
            model.set_weights(initial)  # Both runs start from the first one's weights.
            histories.append(model.fit(testing.tiny_dataset(40, batch_size=8),
                                       verbose=0).history)
            weights.append(model.get_weights())
        self.assertAllClose(histories[0], histories[1], rtol=1e-6)
        self.assertAllClose(weights[0], weights[1], rtol=1e-6, atol=1e-7)

    def test_dataset_of_unknown_length(self):
        # filter() hides the length.
        dataset = testing.tiny_dataset(40, batch_size=8).filter(lambda x, y: True)
        self.assertEqual(int(dataset.cardinality()), tf.data.UNKNOWN_CARDINALITY)
        self.assertMatchesSingleDevice(compiled(users_model), dataset,
                                       self.strategy("allreduce", 2))

    def test_a_model_that_overrides_train_step_keeps_it(self):
        steps = []

        class OwnStep(keras.Model):
            def train_step(self, data):
                steps.append("own")
                return super().train_step(data)

        strategy = self.strategy("allreduce", 2)
        with strategy.scope():
            inputs = keras.Input((18, 18, 1))
            model = OwnStep(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(inputs)))
            model.compile(optimizer="sgd",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(testing.tiny_dataset(), verbose=0)
        self.assertNotEmpty(steps)

    def test_errors(self):
        with self.assertRaisesRegex(ConfigError, r"one positive weight per replica \(2\)\. "
                                                 r"Received: split_weights=\[1\]"):
            self.strategy("allreduce", 2, split_weights=[1])
        with self.assertRaisesRegex(ConfigError, "bytes_per_pack must be an integer >= 0"):
            self.strategy("allreduce", 2, bytes_per_pack=-1)


def vectors(examples: int, batch: int, tokens: bool = False, weights: bool = False
            ) -> tf.data.Dataset:
    """Six features (or six token ids below 20) and labels of 3 classes, in batches."""
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 20, (examples, 6)).astype("int32") if tokens
         else rng.random((examples, 6), dtype=np.float32))
    y = rng.integers(0, 3, examples)
    parts = (x, y, rng.random(examples).astype("float32")) if weights else (x, y)
    return tf.data.Dataset.from_tensor_slices(parts).batch(batch)


def dense_model(reduction="sum_over_batch_size", regularizer=None):
    def model_fn():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
            3, kernel_regularizer=regularizer)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True, reduction=reduction))
        return model

    return model_fn


def embedding_model():
    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 4),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def dropout_model():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                              keras.layers.Dropout(0.5, seed=1), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class LossReductionTest(testing.StrategyTestCase):
    """A sum loss stays whole on each replica; a mean loss is weighed by the replica's share."""

    NUM_DEVICES = 4

    @parameterized.named_parameters(("sum", "sum", None), ("sum_regularized", "sum", 0.5),
                                    ("mean_regularized", "sum_over_batch_size", 0.5))
    def test_uneven_shards_equal_one_device(self, reduction, l2):
        # 19 examples in batches of 7: the last batch of 5 is cut 3 and 2.
        regularizer = keras.regularizers.L2(l2) if l2 else None
        self.assertMatchesSingleDevice(dense_model(reduction, regularizer), vectors(19, 7),
                                       self.strategy("allreduce", 2))

    def test_a_sum_loss_with_sample_weights_and_fp16_compression(self):
        self.assertMatchesSingleDevice(dense_model("sum"), vectors(19, 7, weights=True),
                                       self.strategy("allreduce", 2, gradient_compression="fp16"),
                                       rtol=1e-2, atol=1e-3)

    def test_a_mean_by_weight_with_weights_is_refused(self):
        strategy = self.strategy("allreduce", 2)
        with strategy.scope():
            model = dense_model("mean_with_sample_weight")()
        with self.assertRaisesRegex(ConfigError, "mean_with_sample_weight' and sample or class "
                                                 "weights: each replica would divide"):
            model.fit(vectors(8, 4, weights=True), verbose=0)

    def test_which_losses_sum(self):
        self.assertTrue(step.sums_losses(dense_model("sum")()))
        self.assertFalse(step.sums_losses(dense_model()()))
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(loss=["mse"])
        self.assertFalse(step.sums_losses(model))


class SparseGradientTest(testing.StrategyTestCase):

    @parameterized.parameters(8, 9)
    def test_an_embedding_equals_one_device(self, examples):
        # 9 at 8: a last batch of 1, so one replica's shard is empty.
        self.assertMatchesSingleDevice(embedding_model, vectors(examples, 8, tokens=True),
                                       self.strategy("allreduce", 2))


class RandomGeneratorsTest(testing.StrategyTestCase):

    def test_a_replica_without_examples_draws_as_the_others(self):
        # 9 at 8: the last batch of 1 leaves replica 1 no examples; its Dropout generator
        # must still end where replica 0's does.
        strategy = self.strategy("allreduce", 2)
        with strategy.scope():
            model = dropout_model()
        model.fit(vectors(9, 8), verbose=0)
        self.assertReplicasInSync(model)


def _with_added_loss(reduce):
    """A model_fn: a layer adds ``0.5 * reduce(square(its input))`` with add_loss."""

    class AddsLoss(keras.layers.Layer):
        def call(self, inputs):
            self.add_loss(0.5 * reduce(keras.ops.square(inputs)))
            return inputs

    def model_fn():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                  AddsLoss(), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
        return model

    return model_fn


class ReviewAttacksTest(testing.StrategyTestCase):
    """A reviewer's attacks on the step's promises: what held is kept as tests, what broke is
    a test fixed or an expected failure saying why."""

    NUM_DEVICES = 4

    def tearDown(self):
        keras.config.set_dtype_policy("float32")
        super().tearDown()

    def test_an_unreduced_loss_logs_what_one_device_logs(self):
        # reduction=None: trained as one device (the gradient of the examples' losses' sum),
        # but the logged loss was 2x on 2 devices (the examples' losses times total / count).
        self.assertMatchesSingleDevice(dense_model(None), vectors(19, 7),
                                       self.strategy("allreduce", 2))

    def test_a_dict_of_sum_and_mean_losses_with_loss_weights(self):
        def model_fn():
            inputs = keras.Input((6,))
            hidden = keras.layers.Dense(4, activation="tanh")(inputs)
            model = keras.Model(inputs, {"a": keras.layers.Dense(3, name="a")(hidden),
                                         "b": keras.layers.Dense(2, name="b")(hidden)})
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss_weights={"a": 0.3, "b": 2.0},
                          loss={"a": keras.losses.SparseCategoricalCrossentropy(
                                    from_logits=True, reduction="sum"),
                                "b": keras.losses.MeanSquaredError()})
            return model

        rng = np.random.default_rng(0)
        data = tf.data.Dataset.from_tensor_slices((
            rng.random((19, 6), dtype=np.float32),
            {"a": rng.integers(0, 3, 19), "b": rng.random((19, 2), dtype=np.float32)},
            rng.random(19).astype("float32"))).batch(7)
        self.assertMatchesSingleDevice(model_fn, data, self.strategy("allreduce", 4))

    def test_accumulation_with_a_sum_loss_and_a_last_batch_of_one(self):
        self.assertMatchesSingleDevice(dense_model("sum", keras.regularizers.L2(0.1)),
                                       vectors(17, 8), self.strategy("allreduce", 2,
                                                                     accumulation_steps=2))

    def test_dropout_and_a_last_batch_of_one_on_four_devices(self):
        strategy = self.strategy("allreduce", 4)
        with strategy.scope():
            model = dropout_model()
            model.compile(optimizer=model.optimizer, loss=model.loss, steps_per_execution=2)
        model.fit(vectors(17, 8), epochs=2, verbose=0)
        self.assertReplicasInSync(model)

    @unittest.expectedFailure
    def test_a_sum_loss_with_dynamic_loss_scaling(self):
        # Each replica differentiates its part of the sum in float16, which overflows less than
        # one device's whole sum: one device skips the first step (its scale halves to 16384),
        # two devices apply it (32768): 0.23 apart after 3 steps. The mean losses' gradients
        # are shrunk to about a mean before the backward pass (as one device's are); a sum
        # loss has no such size to match. Refuse, or shrink by the share of the batch?
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)  # Initial weights whose first step overflows on one device.
        self.assertMatchesSingleDevice(dense_model("sum"), vectors(19, 7),
                                       self.strategy("allreduce", 2))

    @unittest.expectedFailure
    def test_adam_on_an_embedding_with_a_repeated_token(self):
        # Keras on one device hands Adam the Embedding's IndexedSlices, one slice per token:
        # ops.square squares each before they are added, so a token twice in the batch gets
        # v = g1^2 + g2^2. The step makes the gradient dense first ((g1 + g2)^2): 0.004 apart
        # after one step at learning rate 0.01, on 1 device as on 4 (SGD agrees). Found by the
        # cluster stage's generated models ("sequential tokens [no hidden layers], custom loss,
        # class weights, float32, adamw, 1 examples in batches of 1, seed 3 under allreduce on
        # 4"): that suite fails on this.
        def model_fn():
            model = embedding_model()
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss=model.loss)
            return model

        tokens = np.array([[1, 1, 2, 3, 4, 5]], "int32")
        data = tf.data.Dataset.from_tensor_slices((tokens, np.array([1]))).batch(1)
        self.assertMatchesSingleDevice(model_fn, data, self.strategy("allreduce", 2))

    def test_add_loss_of_a_batch_mean_in_a_layer(self):
        self.assertMatchesSingleDevice(_with_added_loss(keras.ops.mean), vectors(19, 7),
                                       self.strategy("allreduce", 2))

    @unittest.expectedFailure
    def test_add_loss_of_a_batch_sum_in_a_layer(self):
        # The step weighs every add_loss value as a mean over the replica's examples (by its
        # share of the batch), as Keras's own step divides it by the replica count; a layer
        # adding its batch's *sum* then trains on about 1/N of it (logged 2.89 on 2 devices
        # where one device logs 4.61). Nothing says which an added loss is: document it?
        self.assertMatchesSingleDevice(_with_added_loss(keras.ops.sum), vectors(19, 7),
                                       self.strategy("allreduce", 2))

    @unittest.expectedFailure
    def test_evaluate_with_a_sum_loss_after_training(self):
        # evaluate runs Keras's test_step: each replica's sum is multiplied by the replica count
        # and averaged, weighed by its examples; with a last batch of 1 on 2 devices the loss is
        # 8.678 where one device says 8.635 (README: fit, evaluate and predict "as on one
        # device"). A mean loss evaluates right; a multi-output model's per-output mean loss
        # does not (Keras weighs each replica's by its static batch size).
        reference = dense_model("sum")()
        initial = reference.get_weights()
        with self.strategy("allreduce", 2).scope():
            model = dense_model("sum")()
        model.set_weights(initial)
        data = vectors(17, 8)
        reference.fit(data, verbose=0, shuffle=False)
        model.fit(data, verbose=0, shuffle=False)
        self.assertAllClose(model.get_weights(), reference.get_weights(), rtol=1e-5, atol=1e-6)
        self.assertAllClose(model.evaluate(data, verbose=0), reference.evaluate(data, verbose=0),
                            rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    tf.test.main()


class BatchReshaped(keras.layers.Layer):
    """A user's layer that needs the static batch size (which ``drop_remainder`` gives)."""

    def call(self, x):
        return keras.ops.reshape(x, (x.shape[0], -1))

    def compute_output_shape(self, shape):
        return (shape[0], int(np.prod(shape[1:])))


class Halves(keras.layers.Layer):
    """A user's layer that needs its input's static width."""

    def call(self, x):
        return keras.ops.reshape(x, (-1, x.shape[1] // 2, 2))

    def compute_output_shape(self, shape):
        return (shape[0], shape[1] // 2, 2)


def halves_model():
    inputs = keras.Input((12,))
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(keras.layers.Dense(4)(
        Halves()(inputs))))
    return compiled(lambda: keras.Model(inputs, outputs))()


class TracedShapesTest(testing.StrategyTestCase):
    """The shapes the step is traced with: what a user's layer may read, as on one device."""

    NUM_DEVICES = 4

    def test_a_static_batch_a_layer_reads(self):
        def model_fn():
            inputs = keras.Input((6, 6, 1))
            features = BatchReshaped()(keras.layers.Conv2D(2, 3)(inputs))
            return compiled(lambda: keras.Model(inputs, keras.layers.Dense(3)(features)))()

        rng = np.random.default_rng(0)
        images = tf.data.Dataset.from_tensor_slices(
            (rng.random((32, 6, 6, 1), dtype=np.float32), rng.integers(0, 3, 32))).batch(
                8, drop_remainder=True)
        self.assertMatchesSingleDevice(model_fn, images, self.strategy("allreduce", 2))

    def test_a_width_a_layer_reads_after_other_data_on_the_strategy(self):
        rng = np.random.default_rng(1)

        def data(width):
            return tf.data.Dataset.from_tensor_slices(
                (rng.random((16, width), dtype=np.float32), rng.integers(0, 3, 16))).batch(8)

        for strategy in (self.strategy("allreduce", 2),
                         self.strategy("allreduce", 2, virtual_replicas=4)):
            with strategy.scope():
                other = compiled(lambda: keras.Sequential([keras.Input((6,)),
                                                           keras.layers.Dense(3)]))()
                model = halves_model()
            other.fit(data(6), epochs=1, verbose=0)  # Another width, before.
            model.fit(data(12), epochs=1, verbose=0, validation_data=data(6).map(
                lambda x, y: (tf.pad(x, [[0, 0], [0, 6]]), y)))
            self.assertTrue(np.all(np.isfinite(model.get_weights()[0])))
