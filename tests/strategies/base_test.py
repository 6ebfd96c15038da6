"""Tests of the strategies' base class: refusals as data, the step hook, what it does when
built (TF_CONFIG checked, Keras fixes installed)."""

import os
import types
from unittest import mock

import keras
import numpy as np
import tensorflow as tf

from tfpar import testing
from tfpar.compat import collective_keys
from tfpar.compat import keras_fixes
from tfpar.errors import ClusterError
from tfpar.errors import ConfigError
from tfpar.strategies import refusals
from tfpar.strategies.base import TfparStrategy
from tfpar.strategies.mirrored import MirroredStrategy


def _refuse_dropout(strategy, step):
    if any(isinstance(layer, keras.layers.Dropout) for layer in step.model.layers):
        raise ConfigError("Dropout is not allowed here.")


class NoDropoutStrategy(TfparStrategy, tf.distribute.MirroredStrategy):
    """A user's strategy that refuses dropout in fit and evaluate, and counts its steps."""

    refusals = (refusals.Refusal("no_dropout", ("train_step", "test_step"), _refuse_dropout),)


class CountingStrategy(TfparStrategy, tf.distribute.MirroredStrategy):
    """A user's strategy whose hook runs Keras's own train_step and counts the calls."""

    traced = 0

    def replacement_step(self, step):
        if step.name != "train_step":
            return None

        def counted(data):
            CountingStrategy.traced += 1
            return step.model.train_step(data)

        return counted


def _model(*layers):
    model = keras.Sequential([keras.Input((3,)), *layers, keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


class BaseTest(testing.StrategyTestCase):

    def setUp(self):
        super().setUp()
        self.x = np.ones((8, 3), "float32")
        self.y = np.ones((8, 1), "float32")

    def test_refusals_are_checked_on_each_step_they_name(self):
        strategy = NoDropoutStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            plain, dropping = _model(), _model(keras.layers.Dropout(0.5))
        plain.fit(self.x, self.y, batch_size=4, verbose=0)
        for run in (lambda: dropping.fit(self.x, self.y, batch_size=4, verbose=0),
                    lambda: dropping.evaluate(self.x, self.y, batch_size=4, verbose=0)):
            with self.assertRaisesRegex(ConfigError, r"^Dropout is not allowed here\.$"):
                run()
        dropping.predict(self.x, batch_size=4, verbose=0)  # predict_step is not named.

    def test_replacement_step_runs_and_its_logs_are_global(self):
        strategy = CountingStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model = _model()
        history = model.fit(self.x, self.y, batch_size=4, epochs=1, verbose=0)
        self.assertEqual(CountingStrategy.traced, 2)  # Traced once per replica.
        self.assertIn("loss", history.history)
        logs = strategy.run(model.train_step, args=(
            (tf.constant(self.x[:4]), tf.constant(self.y[:4])),))
        self.assertTrue(strategy.is_global_value(logs["loss"]))
        self.assertFalse(strategy.is_global_value(tf.constant(1.0)))

    def test_a_malformed_tf_config_is_one_line_before_tensorflow_reads_it(self):
        with mock.patch.dict(os.environ, {"TF_CONFIG": "{bad"}), \
                self.assertRaisesRegex(ClusterError, r"TF_CONFIG is not valid JSON"):
            MirroredStrategy(["/cpu:0", "/cpu:1"])

    @testing.for_each_strategy(num_devices=(1, 2), names=(
        "one_device", "mirrored", "central_storage", "allreduce"))
    def test_one_replica_on_the_cpu_reads_the_dataset_itself(self, strategy_name, num_devices):
        strategy = self.strategy(strategy_name, num_devices)
        dataset = tf.data.Dataset.range(8).batch(4)
        distributed = strategy.experimental_distribute_dataset(dataset)
        self.assertEqual(isinstance(distributed, tf.distribute.DistributedDataset),
                         num_devices > 1)
        self.assertEqual(isinstance(distributed, tf.data.Dataset), num_devices == 1)
        self.assertTrue(distributed._tfpar_releases_iterators)
        self.assertFalse(hasattr(dataset, "_tfpar_releases_iterators"))  # The user's, as it was.
        if num_devices == 1:
            self.assertEqual([batch.numpy().tolist() for batch in distributed],
                             [[0, 1, 2, 3], [4, 5, 6, 7]])
        if num_devices == 1 and strategy_name != "central_storage":
            # Input options are TensorFlow's to honour: its input path. (TensorFlow 2.21's
            # CentralStorageStrategy fails on any options: `experimental_replication_moden`.)
            self.assertIsInstance(strategy.experimental_distribute_dataset(
                dataset, tf.distribute.InputOptions(experimental_fetch_to_device=False)),
                tf.distribute.DistributedDataset)

    def test_xla_is_refused_wherever_a_cpu_replica_takes_part(self):
        def strategy(replicas, *devices):  # What check_xla reads of a strategy.
            return types.SimpleNamespace(num_replicas_in_sync=replicas,
                                         extended=types.SimpleNamespace(worker_devices=devices))

        worker_cpu = "/job:worker/replica:0/task:0/device:CPU:0"  # One per worker process.
        with self.assertRaisesRegex(ConfigError, "^jit_compile=True cannot run on 2 replicas"):
            refusals.check_xla(True, strategy(2, worker_cpu))
        for jit_compile, replicas_and_devices in (
                (True, (4, "/job:worker/replica:0/task:0/device:GPU:0",
                        "/job:worker/replica:0/task:0/device:GPU:1")),
                (True, (1, worker_cpu)), (False, (2, worker_cpu)), ("auto", (2, worker_cpu))):
            refusals.check_xla(jit_compile, strategy(*replicas_and_devices))

    def test_several_steps_per_call_across_workers_are_refused_only_without_the_fix(self):
        workers = types.SimpleNamespace(  # 2 replicas, 1 in this process.
            num_replicas_in_sync=2, extended=types.SimpleNamespace(worker_devices=("CPU:0",)))
        step = refusals.KerasStep(_model(), "train_step", is_keras_own=True)
        step.model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
        refusals.MULTI_STEP_EXECUTION(workers, step)  # The fix applies on this TensorFlow.
        with mock.patch.object(collective_keys, "skip_reason", return_value="TensorFlow 9.0 "
                               "is outside the versions it was verified against (2.16 to 2.21)"):
            refusals.MULTI_STEP_EXECUTION(
                types.SimpleNamespace(num_replicas_in_sync=2, extended=types.SimpleNamespace(
                    worker_devices=("CPU:0", "CPU:1"))), step)  # One process: no collective key.
            with self.assertRaisesRegex(ConfigError, (
                    r"^steps_per_execution > 1 runs across workers only with tfpar's fix of "
                    r"Keras's multi-step loop \(keras-team/keras#19246\), not applied here: "
                    r"TensorFlow 9.0 is outside .*\. Use steps_per_execution=1\. Received: "
                    r"steps_per_execution=3\.$")):
                refusals.MULTI_STEP_EXECUTION(workers, step)

    def test_several_replicas_install_the_keras_fixes(self):
        keras_fixes.uninstall()
        MirroredStrategy(["/cpu:0"])
        self.assertFalse(keras_fixes.installed())
        MirroredStrategy(["/cpu:0", "/cpu:1"])
        self.assertEqual(keras_fixes.installed(), not keras_fixes.skip_reason())


if __name__ == "__main__":
    tf.test.main()
