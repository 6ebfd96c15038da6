"""Tests of BatchNorm statistics across replicas: averaged per-replica ones, synchronized ones."""

import keras
import numpy as np
import tensorflow as tf

import tfpar
from tfpar import testing
from tfpar.callbacks import batchnorm_statistics


def bn_model(synchronized=False):
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.BatchNormalization(synchronized=synchronized),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def skewed_batch():
    """Replica 0 gets zeros, replica 1 tens: per-replica statistics differ."""
    x = np.concatenate([np.zeros((4, 4)), np.full((4, 4), 10.0)]).astype(np.float32)
    return tf.data.Dataset.from_tensors((x, np.zeros(8, np.int32)))


class ReplicaStatisticsTest(testing.StrategyTestCase):

    def test_average_makes_per_replica_statistics_well_defined(self):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = bn_model()
        model.fit(skewed_batch(), verbose=0,
                  callbacks=[batchnorm_statistics.AverageAtEpochEnd(strategy)])
        self.assertReplicasInSync(model)
        # Momentum 0.99: each replica moved 1% of the way to its mean (0 and 10); the
        # average is 1% of 5.
        self.assertAllClose(model.layers[0].moving_mean, np.full(4, 0.05), rtol=1e-5)

    def test_the_models_own_strategy_by_default(self):
        # As the saving guide writes it: tfpar.callbacks.AverageAtEpochEnd().
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = bn_model()
        model.fit(skewed_batch(), verbose=0, callbacks=[tfpar.callbacks.AverageAtEpochEnd()])
        self.assertReplicasInSync(model)
        self.assertAllClose(model.layers[0].moving_mean, np.full(4, 0.05), rtol=1e-5)

    def test_the_epoch_end_averaging_is_traced_once(self):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = bn_model()
        callback = batchnorm_statistics.AverageAtEpochEnd(strategy)
        model.fit(skewed_batch(), epochs=3, verbose=0, callbacks=[callback])
        self.assertEqual(callback._average.experimental_get_tracing_count(), 1)

    def test_allreduce_step_with_per_replica_statistics(self):
        strategy = self.strategy("allreduce", 2)
        with strategy.scope():
            model = bn_model()
        model.fit(skewed_batch(), verbose=0)
        with self.assertRaisesRegex(AssertionError, "moving_mean: replica 1 differs"):
            self.assertReplicasInSync(model)
        batchnorm_statistics.average(model, strategy)
        self.assertReplicasInSync(model)

    def test_synchronized_batchnorm_equals_single_device(self):
        for name in ("mirrored", "allreduce"):
            self.assertMatchesSingleDevice(lambda: bn_model(synchronized=True),
                                           skewed_batch(), self.strategy(name, 2))

    def test_one_replica_is_left_alone(self):
        strategy = self.strategy("mirrored", 1)
        with strategy.scope():
            model = bn_model()
        batchnorm_statistics.average(model, strategy)
        self.assertAllClose(model.layers[0].moving_mean, np.zeros(4))


if __name__ == "__main__":
    tf.test.main()
