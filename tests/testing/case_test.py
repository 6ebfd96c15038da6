"""Tests of tfpar.testing: the assertions must fail on wrong distributed training."""

import functools
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from cpu_kernels import needs_bfloat16_kernels

from tfpar import data as data_lib
from tfpar import devices
from tfpar import strategies
from tfpar import testing
from tfpar.errors import DeviceError
from tfpar.strategies import registry
from tfpar.testing import case

model_fn = functools.partial(testing.tiny_model, lr=0.5)


def wrong_step(reduce_twice: bool):
    """A hand-made data-parallel step that reduces gradients twice, or not at all."""

    def train(model, dataset, strategy):
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum")

        @tf.function
        def step(x, y):
            def replica_fn(x, y):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x)) / 8.0
                grads = tape.gradient(loss, model.trainable_variables)
                context = tf.distribute.get_replica_context()
                if reduce_twice:  # The optimizer all-reduces again inside apply().
                    grads = context.all_reduce("sum", grads)
                    model.optimizer.apply(grads, model.trainable_variables)
                else:  # Each replica applies only its own gradient: replicas drift apart.
                    def apply(strategy, grads):
                        for g, v in zip(grads, model.trainable_variables):
                            strategy.extended.update(
                                v.value, lambda var, g: var.assign_sub(0.5 * g), args=(g,))
                    context.merge_call(apply, args=(grads,))
                return loss
            return strategy.run(replica_fn, args=(x, y))

        for x, y in data_lib.distribute(strategy, dataset):
            step(x, y)
        return None  # No losses logged: compare weights only.

    return train


class AssertMatchesSingleDeviceTest(testing.StrategyTestCase):

    def _assert_matches(self, train):
        self.assertMatchesSingleDevice(model_fn, testing.tiny_dataset(),
                                       self.strategy("mirrored", 2), train=train)

    def test_passes_for_correct_training(self):
        self.assertMatchesSingleDevice(model_fn, testing.tiny_dataset(),
                                       self.strategy("mirrored", 2))

    def test_fails_when_gradients_are_reduced_twice(self):
        with self.assertRaisesRegex(AssertionError, "differs from single-device training"):
            self._assert_matches(wrong_step(reduce_twice=True))

    def test_fails_when_gradients_are_not_reduced(self):
        with self.assertRaisesRegex(AssertionError, "differs from single-device training"):
            self._assert_matches(wrong_step(reduce_twice=False))


def paired_data(cancelling: bool = True):
    """Examples in pairs x, -x. With equal targets (``cancelling``), the gradient of a linear
    model from zero weights is a sum that cancels exactly in exact arithmetic, so its float32
    rounding, which the order of the sum decides, is all Adam normalises (it divides by
    sqrt(v) + epsilon); with targets of a linear function, it is far from zero."""
    x = np.random.default_rng(0).standard_normal((32, 4)).astype(np.float32)
    x = np.concatenate([x, -x])
    y = np.ones((64, 1), np.float32) if cancelling else x @ np.ones((4, 1), np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(64).repeat(3)


def adam_linear_model():
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    return model


def reordered_training(scale: float = 1.0):
    """One device, each batch's examples in another order (and the learning rate times
    ``scale``); weights compared only."""
    def train(model, dataset, strategy):
        model.compile(optimizer=keras.optimizers.Adam(0.1 * scale), loss="mse")
        rolled = dataset.map(lambda x, y: (tf.roll(x, 7, 0), tf.roll(y, 7, 0)))
        testing.reference_runs.fit_steps(model, rolled, strategy)
        return None
    return train


class RoundingReachTest(testing.StrategyTestCase):
    """Beyond the default tolerance, a weight is held to how far rounding alone moves it."""

    def assert_matches(self, train, cancelling=True, **tolerances):
        with tf.device("CPU:0"):
            self.assertMatchesSingleDevice(adam_linear_model, paired_data(cancelling),
                                           self.strategy("default", 1), train=train,
                                           **tolerances)

    def test_the_same_computation_summed_otherwise_passes(self):
        # Rounding moves these weights far beyond the default tolerance (measured: 2e-2, the
        # sign of each step's update), and within rounding's reach.
        with self.assertRaisesRegex(AssertionError, "differs from single-device training"):
            self.assert_matches(reordered_training(), rtol=1e-5, atol=1e-6)
        self.assert_matches(reordered_training())

    def test_a_wrong_update_still_fails(self):
        self.assert_matches(reordered_training(), cancelling=False)
        with self.assertRaisesRegex(AssertionError, "beyond rounding's reach"):
            self.assert_matches(reordered_training(scale=1.01), cancelling=False)


@needs_bfloat16_kernels
class MixedPrecisionTest(testing.StrategyTestCase):
    """The equivalence helper under a mixed policy: its own tolerance, and it still fails on
    wrong training."""

    def setUp(self):
        super().setUp()
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        self.addCleanup(keras.mixed_precision.set_global_policy, "float32")

    def test_passes_for_correct_training_under_every_in_process_entry(self):
        for name in ("mirrored", "allreduce"):
            self.assertMatchesSingleDevice(testing.tiny_model, testing.tiny_dataset(8),
                                           self.strategy(name, 2))

    def test_bf16_gradient_compression_composes_with_it(self):
        self.assertMatchesSingleDevice(
            testing.tiny_model, testing.tiny_dataset(8),
            self.strategy("allreduce", 2, gradient_compression="bf16"))

    def test_still_fails_when_gradients_are_reduced_twice(self):
        self.assertEqual(case.TOLERANCES["mixed_bfloat16"], (1e-2, 1e-3))
        with self.assertRaisesRegex(AssertionError, "differs from single-device training"):
            self.assertMatchesSingleDevice(model_fn, testing.tiny_dataset(),
                                           self.strategy("mirrored", 2),
                                           train=wrong_step(reduce_twice=True))


class AssertReplicasInSyncTest(testing.StrategyTestCase):

    def test_detects_per_replica_batchnorm_statistics(self):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(),
                                      keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        self.assertReplicasInSync(model)
        # Replica 0 sees zeros, replica 1 tens: their moving means drift apart.
        x = np.concatenate([np.zeros((4, 4)), np.full((4, 4), 10.0)]).astype(np.float32)
        model.fit(x, np.zeros((8, 1), np.float32), batch_size=8, shuffle=False, verbose=0)
        with self.assertRaisesRegex(AssertionError, "moving_mean: replica 1 differs"):
            self.assertReplicasInSync(model)


class ResolvedOnceTest(testing.StrategyTestCase):

    def test_a_strategy_by_name_is_looked_up_once(self):
        with mock.patch.object(registry, "entry", wraps=registry.entry) as entry:
            strategy = self.strategy("allreduce", 2, accumulation_steps=2)
        self.assertEqual(entry.call_count, 1)
        self.assertEqual(strategies.selection(strategy).options["accumulation_steps"], 2)


class DevicesTest(testing.StrategyTestCase):

    def test_too_late_says_how_to_fix(self):
        tf.constant(0)
        with self.assertRaisesRegex(DeviceError, r"--tfpar-devices=9"):
            testing.ensure_devices(9)

    def test_skip_reasons(self):
        default, mirrored = strategies.choose("default"), strategies.choose("mirrored")
        self.assertEqual(case._skip_reason(default, 2),
                         "strategy 'default' runs on at most 1 device(s)")
        self.assertIn("--tfpar-devices=8", case._skip_reason(mirrored, 8))
        self.assertIsNone(case._skip_reason(mirrored, devices.logical_cpu_count()))

    @testing.for_each_strategy(num_devices=(2,), names=["default", "mirrored"])
    def test_parameterised_names(self, strategy_name, num_devices):
        self.assertEqual(self._testMethodName, f"test_parameterised_names_{strategy_name}_2")
        self.strategy(strategy_name, num_devices)  # default_2 skips with its reason.
        self.assertEqual(strategy_name, "mirrored")


if __name__ == "__main__":
    tf.test.main()
