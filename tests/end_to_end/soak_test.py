"""Soak test: many epochs under mirrored and allreduce without memory growth.

Slow, so excluded from the default run; run it with ``pytest -m slow``.
"""

import os
import subprocess
import sys

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



@pytest.mark.slow
class QuietEndTest(tf.test.TestCase):
    """Ten 2-worker jobs that end well in a row print no TensorFlow abort line (before the
    chief left last, worker 1 printed StartAbort UNAVAILABLE lines in about 1 run in 8)."""

    def test_ten_good_jobs_print_no_abort_lines(self):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        for run in range(10):
            result = subprocess.run(
                [sys.executable, os.path.join(root, "scripts", "launch.py"), "--num_workers=2",
                 "--", sys.executable, os.path.join(root, "scripts", "train.py"),
                 "--strategy=multi_worker", "--dataset=digits", "--epochs=1", "--verbose=0"],
                capture_output=True, text=True, timeout=300)
            output = result.stdout + result.stderr
            self.assertEqual(result.returncode, 0, output[-3000:])
            self.assertNotRegex(output, "StartAbort|UNAVAILABLE", f"run {run + 1}")

if __name__ == "__main__":
    tf.test.main()
