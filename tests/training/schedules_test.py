"""Tests of the linear warm-up schedule, alone and under fit with every kind of step."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import testing
from tfpar.training import schedules
from tfpar.training.config import TrainConfig


class LinearWarmupTest(testing.StrategyTestCase):

    def test_rises_linearly_then_stays(self):
        schedule = schedules.LinearWarmup(0.1, 0.4, 3)
        self.assertAllClose([schedule(s) for s in range(6)], [0.1, 0.2, 0.3, 0.4, 0.4, 0.4])

    def test_round_trips_through_keras_serialization(self):
        schedule = schedules.LinearWarmup(0.0, 0.2, 10)
        again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
        self.assertEqual(again.get_config(), schedule.get_config())

    @parameterized.parameters("default", "mirrored", "allreduce")
    def test_the_update_uses_the_warmed_up_rate(self, name):
        # Plain SGD on a linear model: after 2 steps the optimizer has used rates 0.1 and 0.2.
        strategy = self.strategy(name, 1 if name == "default" else 2)
        with strategy.scope():
            model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
                1, use_bias=False, kernel_initializer="zeros")])
            model.compile(optimizer=keras.optimizers.SGD(schedules.LinearWarmup(0.1, 0.3, 2)),
                          loss="mse")
        x = np.ones((4, 1), np.float32)
        model.fit(tf.data.Dataset.from_tensor_slices((x, x)).batch(4).repeat(2), verbose=0)
        # Gradient of mean (w - 1)^2 is 2(w - 1): w1 = 0 + 0.1 * 2 = 0.2, w2 = 0.2 + 0.2 * 1.6.
        self.assertAllClose(model.get_weights()[0], [[0.52]])

    def test_where_the_warm_up_starts(self):
        self.assertEqual(TrainConfig(lr=0.1, scale_with_devices=True).warmup_start(4), 0.1)
        self.assertEqual(TrainConfig(lr=0.1).warmup_start(4), 0.0)

    def test_bad_warmup_epochs(self):
        with self.assertRaisesRegex(ValueError, r"warmup_epochs must be a number >= 0\. "
                                                r"Received: warmup_epochs=-1\."):
            TrainConfig(warmup_epochs=-1)


if __name__ == "__main__":
    tf.test.main()
