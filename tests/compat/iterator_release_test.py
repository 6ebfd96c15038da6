"""Tests that tfpar's strategies free their input iterators on background threads, and that
their distributed datasets are otherwise TensorFlow's."""

import os
import signal
import subprocess
import sys
import threading
import time
from unittest import mock

import numpy as np
import tensorflow as tf

from tfpar import testing
from tfpar.compat import iterator_release
from tfpar.compat import versions

# The entries tfpar builds a strategy class for, in this process ("default" is TensorFlow's).
ENTRIES = ("one_device", "mirrored", "central_storage", "allreduce")


def wait_for_release(count: int, timeout: float = 60.0) -> int:
    """Waits until more than ``count`` iterators have been freed in the background; returns how
    many have been."""
    deadline = time.monotonic() + timeout
    while iterator_release.released_count() <= count and time.monotonic() < deadline:
        time.sleep(0.05)
    return iterator_release.released_count()


class IteratorReleaseTest(testing.StrategyTestCase):

    def test_an_exit_stopped_while_a_release_waits_is_quiet(self):
        # A destructor that waits (for a peer that hangs); the launcher stops the job meanwhile.
        waited = threading.Event()

        class Waits:
            def __del__(self):
                time.sleep(30)
                waited.set()

        # Ctrl-C as a program has it (Python's default), whatever ran before in this process.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        self.addCleanup(signal.signal, signal.SIGINT, previous)
        releaser = iterator_release._Releaser()
        releaser.put({"iterator": Waits()})
        threading.Timer(0.5, signal.pthread_kill, (threading.get_ident(), signal.SIGINT)).start()
        releaser._stop()  # What runs at exit: returns when interrupted, raising nothing.
        # It returned while the release still waited (an order of events, not a time bound).
        self.assertFalse(waited.is_set())

    @testing.for_each_strategy(num_devices=(1, 2), names=ENTRIES)
    def test_fit_iterators_are_freed_in_the_background(self, strategy_name, num_devices):
        strategy = self.strategy(strategy_name, num_devices)
        with strategy.scope():
            model = testing.tiny_model()
        before = iterator_release.released_count()
        model.fit(testing.tiny_dataset(), epochs=2, verbose=0)
        # A finite dataset: one iterator per epoch, dropped by Keras at the epoch's end.
        self.assertGreaterEqual(wait_for_release(before + 1) - before, 2)

    def test_datasets_from_function_iterators_are_freed_too(self):
        strategy = self.strategy("mirrored", 2)
        dataset = strategy.distribute_datasets_from_function(
            lambda context: tf.data.Dataset.range(8).batch(2))
        iterator = iter(dataset)
        next(iterator)
        before = iterator_release.released_count()
        del iterator
        self.assertGreater(wait_for_release(before), before)

    def test_distributed_dataset_still_works_inside_tf_function(self):
        strategy = self.strategy("mirrored", 2)
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.range(8, output_type=tf.float32).batch(4))
        self.assertIsInstance(dataset, tf.distribute.DistributedDataset)

        @tf.function
        def total(dataset):
            result = tf.constant(0.0)
            for batch in dataset:
                result += strategy.reduce("SUM", strategy.run(tf.reduce_sum, args=(batch,)),
                                          axis=None)
            return result

        self.assertEqual(float(total(dataset)), 28.0)

    def test_fit_results_unchanged(self):
        strategy = self.strategy("mirrored", 2)
        losses = []
        for release in (True, False):
            with mock.patch.object(iterator_release, "skip_reason",
                                   lambda release=release: None if release else "off"):
                with strategy.scope():
                    model = testing.tiny_model()
                    model.set_weights([np.full(w.shape, 0.1, w.dtype)
                                       for w in model.get_weights()])
                history = model.fit(testing.tiny_dataset(), epochs=2, verbose=0)
                losses.append(history.history["loss"])
        self.assertEqual(losses[0], losses[1])

    def test_not_applied_outside_the_verified_tensorflow(self):
        strategy = self.strategy("mirrored", 2)
        with mock.patch.object(iterator_release, "_tensorflow_version", lambda: "2.99.0"):
            self.assertEqual(iterator_release.skip_reason(),
                             "TensorFlow 2.99.0 is outside 2.16 to 2.21, and the preview "
                             f"{versions.PREVIEWS['tensorflow']}")
            dataset = strategy.experimental_distribute_dataset(
                tf.data.Dataset.range(8).batch(2))
        self.assertFalse(getattr(dataset, "_tfpar_releases_iterators", False))
        with mock.patch.dict(os.environ, {iterator_release.MODE_ENV: "off"}):
            self.assertEqual(iterator_release.status()["applied"],
                             "no: TFPAR_ITERATOR_RELEASE=off")
            self.assertFalse(getattr(strategy.experimental_distribute_dataset(
                tf.data.Dataset.range(8).batch(2)), "_tfpar_releases_iterators", False))
        self.assertIs(type(dataset), type(tf.distribute.MirroredStrategy(
            ["CPU:0"]).experimental_distribute_dataset(tf.data.Dataset.range(2))))

    def test_a_process_exits_cleanly_right_after_fit(self):
        code = ("from tfpar import strategies, testing\n"
                "strategy = strategies.get('mirrored', 2)\n"
                "with strategy.scope():\n"
                "    model = testing.tiny_model()\n"
                "model.fit(testing.tiny_dataset(), epochs=2, verbose=0)\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertNotIn("Exception ignored", result.stderr)
        self.assertNotIn("Traceback", result.stderr)
