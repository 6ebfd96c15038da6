"""Soak test: many epochs under mirrored and allreduce without memory growth.

Slow, so excluded from the default run; run it with ``pytest -m slow``.
"""

import os

import keras
import pytest
import tensorflow as tf
from absl.testing import parameterized

from tfpar import data
from tfpar import testing
from tfpar import training


def resident_megabytes() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class MemoryPerEpoch(keras.callbacks.Callback):

    def __init__(self):
        super().__init__()
        self.megabytes = []

    def on_epoch_end(self, epoch, logs=None):
        self.megabytes.append(resident_megabytes())


@pytest.mark.slow
class SoakTest(testing.StrategyTestCase):

    @parameterized.parameters("mirrored", "allreduce")
    def test_memory_does_not_grow_epoch_over_epoch(self, strategy_name):
        epochs = 60
        splits = data.load("synthetic", image_shape=(28, 28, 1), synthetic_size=(1024, 64))
        config = training.TrainConfig(strategy=strategy_name, dataset="synthetic",
                                      epochs=epochs, batch_size=64, verbose=0)
        memory = MemoryPerEpoch()
        training.train_on_devices(config, 2, splits, callbacks=[memory])
        self.assertLen(memory.megabytes, epochs)
        # After warm-up (tracing, allocator pools), the rest of the run may not keep growing.
        growth = memory.megabytes[-1] - memory.megabytes[9]
        self.assertLess(growth, 30.0, f"resident memory per epoch: {memory.megabytes}")


if __name__ == "__main__":
    tf.test.main()
