"""Tests of the epoch timer: first epoch apart, figures in logs and History."""

import keras
import numpy as np
import tensorflow as tf

from tfpar.callbacks import timing


class FakeClock:

    def __init__(self, epoch_seconds):
        self.times = []
        now = 0.0
        for seconds in epoch_seconds:
            self.times += [now, now + seconds]
            now += seconds + 1.0

    def __call__(self):
        return self.times.pop(0)


class EpochTimerTest(tf.test.TestCase):

    def test_first_epoch_reported_apart(self):
        timer = timing.EpochTimer(100, clock=FakeClock([5.0, 2.0, 4.0]))
        logs = [{}, {}, {}]
        for epoch in range(3):
            timer.on_epoch_begin(epoch)
            timer.on_epoch_end(epoch, logs[epoch])
        self.assertEqual(timer.epoch_seconds, [5.0, 2.0, 4.0])
        self.assertEqual(timer.first_epoch_seconds, 5.0)
        self.assertEqual(timer.steady_epoch_seconds, 3.0)
        self.assertAlmostEqual(timer.steady_images_per_second, 100 / 3.0)
        self.assertEqual(logs[1], {"epoch_seconds": 2.0, "images_per_second": 50.0})

    def test_one_epoch_is_its_own_steady_state(self):
        timer = timing.EpochTimer(10, clock=FakeClock([2.0]))
        timer.on_epoch_begin(0)
        timer.on_epoch_end(0, {})
        self.assertEqual(timer.steady_epoch_seconds, 2.0)

    def test_figures_land_in_history(self):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        history = model.fit(np.zeros((4, 2)), np.zeros((4, 1)), epochs=2, verbose=0,
                            callbacks=[timing.EpochTimer(4)])
        self.assertLen(history.history["epoch_seconds"], 2)
        self.assertGreater(history.history["images_per_second"][1], 0)

    def test_rejects_empty_epochs(self):
        with self.assertRaisesRegex(ValueError, "examples_per_epoch must be >= 1"):
            timing.EpochTimer(0)


if __name__ == "__main__":
    tf.test.main()
