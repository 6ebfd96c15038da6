"""Tests that tfpar's fix is what makes Keras fit survive batches that split unevenly."""

import keras
import numpy as np
import tensorflow as tf

from tfpar import keras_fixes
from tfpar import testing


def fit_first_batch_of_five(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((5, 4), np.float32), np.ones((5, 1), np.float32)
    return model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(5), verbose=0)


class KerasFixesTest(testing.StrategyTestCase):

    def test_uneven_first_batch_crashes_without_the_fix(self):
        strategy = self.strategy("mirrored", 2)  # Installs the fix.
        self.assertTrue(keras_fixes.installed())
        keras_fixes.uninstall()
        try:
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "same size and shape"):
                fit_first_batch_of_five(strategy)
        finally:
            keras_fixes.install()

    def test_uneven_first_batch_trains_with_the_fix(self):
        history = fit_first_batch_of_five(self.strategy("mirrored", 2))
        self.assertTrue(np.isfinite(history.history["loss"][0]))

    def test_install_is_idempotent(self):
        keras_fixes.install()
        keras_fixes.install()
        keras_fixes.uninstall()
        self.assertFalse(keras_fixes.installed())
        keras_fixes.install()
        self.assertTrue(keras_fixes.installed())


if __name__ == "__main__":
    tf.test.main()
