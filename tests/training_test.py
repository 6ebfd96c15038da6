"""Tests of training runs' performance options: dtype policies, XLA, profiling."""

import dataclasses
import glob
import os

import keras
import tensorflow as tf
from absl.testing import parameterized

from tfpar import data
from tfpar import testing
from tfpar import training
from tfpar.errors import ConfigError


def splits():
    return data.load("synthetic", image_shape=(28, 28, 1), synthetic_size=(64, 16))


CONFIG = training.TrainConfig(dataset="synthetic", epochs=1, batch_size=32, verbose=0)


class OptionsTest(testing.StrategyTestCase):

    @parameterized.product(strategy=("mirrored", "allreduce"),
                           dtype=("mixed_float16", "mixed_bfloat16"))
    def test_mixed_precision_trains_and_restores_the_policy(self, strategy, dtype):
        result = training.train_on_devices(
            dataclasses.replace(CONFIG, strategy=strategy, dtype=dtype), 2, splits())
        self.assertTrue(all(map(lambda v: v == v, result.history["loss"])))  # Finite.
        self.assertEqual(keras.mixed_precision.global_policy().name, "float32")

    @parameterized.parameters("mirrored", "allreduce")
    def test_jit_compile_on_one_device(self, strategy):
        result = training.train_on_devices(
            dataclasses.replace(CONFIG, strategy=strategy, jit_compile=True), 1, splits())
        self.assertLen(result.epoch_seconds, 1)

    def test_jit_compile_refused_on_cpu_replicas(self):
        with self.assertRaisesRegex(ConfigError, "--jit_compile cannot run on 2 CPU replicas"):
            training.train_on_devices(dataclasses.replace(CONFIG, jit_compile=True), 2,
                                      splits())

    def test_profile_steps_write_a_trace(self):
        folder = os.path.join(self.get_temp_dir(), "profile")
        training.train_on_devices(
            dataclasses.replace(CONFIG, profile_steps=(1, 1), profile_dir=folder), 1, splits())
        self.assertNotEmpty(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))

    def test_bad_options(self):
        with self.assertRaisesRegex(ConfigError, "dtype must be one of float32, bfloat16"):
            dataclasses.replace(CONFIG, dtype="float8")
        with self.assertRaisesRegex(ConfigError, r"profile_steps is \(first, last\)"):
            dataclasses.replace(CONFIG, profile_steps=(3, 2))


if __name__ == "__main__":
    tf.test.main()
