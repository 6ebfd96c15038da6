"""The host-memory mirror of a checkpoint writes what the checkpoint writes (every key, every
value, bit for bit) for generated models under every in-process entry, holds a snapshot while
training goes on, and the background writer runs one write at a time."""

import tempfile
import threading

import keras
import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from tfpar import errors
from tfpar import testing
from tfpar.callbacks import host_snapshot

EXAMPLES = 8  # Generated cases in the README's suite (each fits a small model once).


def checkpoint_of(model: keras.Model) -> tf.train.Checkpoint:
    """What EpochCheckpoint saves: the model's variables, the optimizer, the metrics'."""
    return tf.train.Checkpoint(model_variables=list(model.variables),
                               optimizer=model.optimizer,
                               metric_variables=list(model.metrics_variables))


def written(checkpoint: tf.train.Checkpoint, prefix: str) -> dict[str, np.ndarray]:
    path = checkpoint.write(prefix)
    reader = tf.train.load_checkpoint(path)
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
            if key != "_CHECKPOINTABLE_OBJECT_GRAPH"}


class HostMirrorTest(testing.StrategyTestCase):

    def assertSameCheckpoint(self, expected: dict, actual: dict) -> None:
        self.assertEqual(sorted(expected), sorted(actual))
        for key, value in expected.items():
            self.assertEqual(np.asarray(value).dtype, np.asarray(actual[key]).dtype, key)
            # Bit for bit (a NaN too: a replica left without examples sums one on Keras 3.16).
            self.assertEqual(np.asarray(value).tobytes(), np.asarray(actual[key]).tobytes(), key)

    def test_a_mirror_writes_what_the_checkpoint_writes_for_generated_models(self):
        failures = []

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.generate])
        @given(case=testing.model_cases(), entry=st.sampled_from(
            [("mirrored", 2), ("allreduce", 2), ("central_storage", 2), ("one_device", 1)]))
        def check(case, entry):
            strategy = self.strategy(*entry)
            try:
                with strategy.scope():
                    model = case.build()
                case.train(model, case.dataset())
            except errors.TfparError:  # The entry refuses the case in one line: no state.
                keras.config.set_dtype_policy("float32")
                return
            try:
                original = checkpoint_of(model)
                mirror = host_snapshot.HostMirror(original)
                mirror.take()
                expected = written(original, tempfile.mkdtemp(dir=self.get_temp_dir()) + "/ckpt")
                self.assertSameCheckpoint(expected, written(
                    mirror.checkpoint, tempfile.mkdtemp(dir=self.get_temp_dir()) + "/ckpt"))
            except Exception as e:  # noqa: BLE001 - every counterexample is reported.
                failures.append(f"{case} under {entry}: {type(e).__name__}: "
                                f"{str(e).strip()[:300]}")
            finally:
                keras.config.set_dtype_policy("float32")

        check()
        self.assertEqual(failures, [], f"{len(failures)} counterexamples")

    def test_the_mirror_holds_the_snapshot_and_the_state_restores_from_it(self):
        strategy = self.strategy("mirrored", 2)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                      keras.layers.BatchNormalization(), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse", metrics=["mae"])
        x, y = np.random.rand(16, 4).astype("float32"), np.random.rand(16, 2).astype("float32")
        model.fit(x, y, batch_size=8, verbose=0)
        original = checkpoint_of(model)
        mirror = host_snapshot.HostMirror(original)
        mirror.take()
        snapshot = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
        model.fit(x, y, batch_size=8, verbose=0)  # Training goes on after the snapshot.
        path = mirror.checkpoint.write(tempfile.mkdtemp(dir=self.get_temp_dir()) + "/ckpt")
        after = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
        self.assertFalse(all(np.array_equal(a, b) for a, b in zip(snapshot, after)))
        checkpoint_of(model).restore(path).expect_partial()
        for value, variable in zip(snapshot, model.variables + model.optimizer.variables):
            self.assertTrue(np.array_equal(value, variable.numpy()), variable.path)
        self.assertEqual(mirror.nbytes, sum(v.numpy().nbytes for v in (
            model.variables + model.optimizer.variables + model.metrics_variables)))

    def test_state_that_is_not_a_variable_is_not_mirrored(self):
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer([1, 2], [3, 4]), default_value=0)
        holder = tf.Module()
        holder.table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0)
        del table
        with self.assertRaisesRegex(host_snapshot.NotMirrored, "MutableHashTable holds state"):
            host_snapshot.HostMirror(tf.train.Checkpoint(holder=holder))


class BackgroundWriterTest(tf.test.TestCase):

    def test_one_write_at_a_time_and_a_failure_is_raised_at_the_next_wait(self):
        writer = host_snapshot.BackgroundWriter()
        release, order = threading.Event(), []

        def first():
            release.wait(60)
            order.append("first")

        writer.start(first)
        self.assertTrue(writer.in_flight)
        order.append("training goes on")  # The caller was not held by the write.
        release.set()
        writer.start(lambda: order.append("second"))  # Waits for the first.
        writer.wait()
        self.assertEqual(order, ["training goes on", "first", "second"])

        def failing():
            raise OSError(28, "No space left on device")

        writer.start(failing)
        with self.assertRaisesRegex(OSError, "No space left"):
            writer.wait()
        writer.wait()  # Raised once.


if __name__ == "__main__":
    tf.test.main()
