"""Tests of the central_storage entry: logged loss, metrics and evaluate equal one device."""

import keras
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


if __name__ == "__main__":
    tf.test.main()
