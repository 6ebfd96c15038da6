"""Tests of the learning-rate schedules (linear warm-up, cosine decay), alone and under fit
with every kind of step, and of the train command's choice between them."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import data
from tfpar import testing
from tfpar import training
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


class LearningRateTest(testing.StrategyTestCase):

    def test_constant_is_the_number_itself(self):
        self.assertEqual(schedules.learning_rate(0.1, total_steps=10), 0.1)

    def test_constant_after_a_warm_up(self):
        rate = schedules.learning_rate(0.4, warmup_start=0.1, warmup_steps=3, total_steps=10)
        self.assertAllClose([rate(s) for s in (0, 3, 9)], [0.1, 0.4, 0.4])

    def test_cosine_decays_to_zero_at_the_end(self):
        rate = schedules.learning_rate(0.2, total_steps=10, decay="cosine")
        # A half cosine: the peak at step 0, half of it midway, 0 at the last step.
        self.assertAllClose([rate(s) for s in (0, 5, 10)], [0.2, 0.1, 0.0], atol=1e-7)

    def test_cosine_after_a_warm_up(self):
        rate = schedules.learning_rate(0.4, warmup_start=0.0, warmup_steps=4, total_steps=12,
                                       decay="cosine")
        self.assertAllClose([rate(s) for s in (0, 2, 4, 8, 12)], [0.0, 0.2, 0.4, 0.2, 0.0],
                            atol=1e-7)

    def test_an_unknown_decay(self):
        with self.assertRaisesRegex(ValueError, r"decay must be one of constant, cosine\. "
                                                r"Received: decay='step'\."):
            schedules.learning_rate(0.1, decay="step")
        with self.assertRaisesRegex(ValueError, r"lr_decay must be one of"):
            TrainConfig(lr_decay="step")

    @parameterized.parameters("mirrored", "allreduce")
    def test_a_run_decays_to_zero_at_its_end(self, strategy):
        # 64 examples in batches of 16, 2 epochs: 8 updates; the rate after 4 is half the peak.
        rates = []
        record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: rates.append(
            float(record.model.optimizer.learning_rate)))
        config = TrainConfig(strategy=strategy, dataset="synthetic", epochs=2, batch_size=16,
                             lr=0.1, lr_decay="cosine", verbose=0)
        training.train_on_devices(config, 2, data.load("synthetic", synthetic_size=(64, 16)),
                                  callbacks=[record])
        self.assertAllClose(rates, [0.05, 0.0], atol=1e-6)

if __name__ == "__main__":
    tf.test.main()
