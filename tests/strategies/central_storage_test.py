"""Tests of the central_storage entry: logged loss, metrics and evaluate equal one device; layers
with state (BatchNormalization, Dropout) train."""

import keras
import numpy as np
import tensorflow as tf

from tfpar import testing
from tfpar.compat import keras_fixes


def classifier():
    model = testing.tiny_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(
                      from_logits=True, name="xent")])
    return model


class CentralStorageMetricsTest(testing.StrategyTestCase):

    def check(self, strategy):
        data = testing.tiny_dataset(24, batch_size=8)
        self.assertMatchesSingleDevice(classifier, data, strategy)
        reference = classifier()
        with strategy.scope():
            model = classifier()
        model.set_weights(reference.get_weights())
        self.assertAllClose(reference.evaluate(data, verbose=0, return_dict=True),
                            model.evaluate(data, verbose=0, return_dict=True), rtol=1e-5)

    def test_logged_loss_metrics_and_evaluate_equal_one_device(self):
        self.check(self.strategy("central_storage", 2))

    def test_keras_miscounts_without_the_fix(self):
        # Keras 3 adds to a variable by assigning it `self + value`, which central storage
        # sums over the replicas. If this fails, Keras counts right by itself and the
        # aggregating_assign_add fixes can go.
        strategy = self.strategy("central_storage", 2)  # Installs the fixes.
        names = ("aggregating_assign_add", "aggregating_assign_sub")
        keras_fixes.uninstall(names)
        self.addCleanup(keras_fixes.install, names)
        with self.assertRaisesRegex(AssertionError, "differ"):
            self.check(strategy)


def batchnorm_model(dropout=0.0):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((6, 6, 1)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.Dropout(dropout), keras.layers.Flatten(),
        keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class CentralStorageLayerStateTest(testing.StrategyTestCase):

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(0)
        self.data = tf.data.Dataset.from_tensor_slices(
            (rng.random((32, 6, 6, 1), dtype=np.float32), rng.integers(0, 3, 32))).batch(8)

    def test_batchnorm_trains_and_its_moving_mean_follows_the_global_batch(self):
        # One step, from the same weights: each replica normalises its own half of the batch
        # (as under mirrored), and the one copy of the moving mean moves by the mean of the
        # replicas' batch means, the global batch's mean.
        one_batch = self.data.take(1)
        reference = batchnorm_model()
        reference.fit(one_batch, verbose=0)
        with self.strategy("central_storage", 2).scope():
            model = batchnorm_model()
        history = model.fit(one_batch, verbose=0).history
        self.assertTrue(np.isfinite(history["loss"]).all())
        moved = {v.path.rsplit("/", 1)[-1]: v.numpy() for v in model.non_trainable_variables}
        expected = {v.path.rsplit("/", 1)[-1]: v.numpy()
                    for v in reference.non_trainable_variables}
        self.assertNotAllClose(moved["moving_mean"], np.zeros(4))
        self.assertAllClose(expected["moving_mean"], moved["moving_mean"], rtol=1e-5, atol=1e-7)
        # The mean of the replicas' variances, as mirrored's copies average to: below the
        # global batch's by the spread of the replicas' means.
        self.assertAllClose(expected["moving_variance"], moved["moving_variance"], rtol=0.02)

    def test_dropout_trains(self):
        with self.strategy("central_storage", 2).scope():
            model = batchnorm_model(dropout=0.3)
        state = next(v for v in model.non_trainable_variables if "seed" in v.path)
        before = state.numpy().copy()
        history = model.fit(self.data, epochs=2, verbose=0).history
        self.assertTrue(np.isfinite(history["loss"]).all())
        self.assertNotAllEqual(before, state.numpy())  # Each step drew new masks.


if __name__ == "__main__":
    tf.test.main()
