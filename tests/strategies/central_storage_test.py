"""Tests of the central_storage entry (Keras logs a wrong running loss; training is exact)."""

import tensorflow as tf

from tfpar import strategies
from tfpar import testing


class CentralStorageLossTest(testing.StrategyTestCase):

    def test_keras_logs_a_wrong_running_loss_but_trains_exactly(self):
        # Records the Keras 3 defect behind StrategyEntry.logs_exact_loss=False: if Keras
        # fixes it, this fails and the flag can go.
        self.assertFalse(strategies.entry("central_storage").logs_exact_loss)
        model_fn = testing.tiny_model
        strategy = self.strategy("central_storage", 2)
        self.assertMatchesSingleDevice(model_fn, testing.tiny_dataset(24, batch_size=8),
                                       strategy)
        # The same strategy without tfpar's record of the defect: the losses are compared.
        plain = tf.distribute.experimental.CentralStorageStrategy(
            strategy.tfpar.devices.tf_names, parameter_device=strategy.tfpar.devices.tf_names[0])
        with self.assertRaisesRegex(AssertionError, "per-step losses differ"):
            self.assertMatchesSingleDevice(model_fn, testing.tiny_dataset(24, batch_size=8),
                                           plain)


if __name__ == "__main__":
    tf.test.main()
