"""Tests of training runs' performance options: dtype policies, XLA, profiling."""

import dataclasses
import glob
import io
import json
import math
import os
from unittest import mock

import keras
import tensorflow as tf
from absl.testing import parameterized
from cpu_kernels import BFLOAT16_REASON
from cpu_kernels import BFLOAT16_WITHOUT_KERNELS

from tfpar import data
from tfpar import strategies
from tfpar import testing
from tfpar import training
from tfpar.errors import ConfigError
from tfpar.host import onednn
from tfpar.strategies import registry
from tfpar.training import run


def splits():
    return data.load("synthetic", image_shape=(28, 28, 1), synthetic_size=(64, 16))


CONFIG = training.TrainConfig(dataset="synthetic", epochs=1, batch_size=32, verbose=0)


class OptionsTest(testing.StrategyTestCase):

    @parameterized.product(strategy=("mirrored", "allreduce"),
                           dtype=("mixed_float16", "mixed_bfloat16"))
    def test_mixed_precision_trains_and_restores_the_policy(self, strategy, dtype):
        if "bfloat16" in dtype and BFLOAT16_WITHOUT_KERNELS:
            self.skipTest(BFLOAT16_REASON)
        result = training.train_on_devices(
            dataclasses.replace(CONFIG, strategy=strategy, dtype=dtype), 2, splits())
        self.assertTrue(all(map(math.isfinite, result.history["loss"])))
        self.assertEqual(keras.mixed_precision.global_policy().name, "float32")

    @testing.for_each_strategy(num_devices=(1,))
    def test_every_entry_trains_on_one_device(self, strategy_name, num_devices):
        self.strategy(strategy_name, num_devices)  # Skips what cannot run in this process.
        result = training.train_on_devices(
            dataclasses.replace(CONFIG, strategy=strategy_name), num_devices, splits())
        # A device count means GPUs on a machine that has them.
        gpus = tf.config.list_physical_devices("GPU")
        self.assertEqual(result.devices, ["GPU:0" if gpus else "CPU:0"])
        self.assertTrue(all(map(math.isfinite, result.history["loss"])))

    @parameterized.parameters("mirrored", "allreduce")
    def test_jit_compile_on_one_device(self, strategy):
        result = training.train_on_devices(
            dataclasses.replace(CONFIG, strategy=strategy, jit_compile=True), 1, splits())
        self.assertLen(result.epoch_seconds, 1)

    @parameterized.parameters("mirrored", "allreduce")
    def test_every_epoch_runs_exactly_its_steps_whatever_steps_per_execution(self, strategy):
        # 64 examples in batches of 24: 3 steps an epoch; calls of 2 steps must not run a 4th.
        iterations = []
        record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: iterations.append(
            int(record.model.optimizer.iterations.numpy())))
        training.train_on_devices(
            dataclasses.replace(CONFIG, strategy=strategy, epochs=2, batch_size=24,
                                steps_per_execution=2), 2, splits(), callbacks=[record])
        self.assertEqual(iterations, [3, 6])

    def test_logdir_writes_tensorboard_scalars_per_device_set(self):
        logdir = self.get_temp_dir()
        training.train_on_devices(dataclasses.replace(CONFIG, epochs=2, logdir=logdir), 2,
                                  splits())
        events = glob.glob(os.path.join(logdir, "mirrored_2_devices", "train", "events.*"))
        self.assertLen(events, 1)
        scalars = {}
        for event in tf.compat.v1.train.summary_iterator(events[0]):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    float(tf.make_ndarray(value.tensor)))
        self.assertLen(scalars["epoch_loss"], 2)
        self.assertLen(scalars["epoch_accuracy"], 2)
        self.assertTrue(all(math.isfinite(v) for v in scalars["epoch_loss"]))
        for tfpar_scalar in ("epoch_test_accuracy", "epoch_epoch_seconds",
                             "epoch_images_per_second"):
            self.assertLen(scalars[tfpar_scalar], 2, msg=tfpar_scalar)
        texts = [tf.make_ndarray(value.tensor).item().decode()
                 for path in glob.glob(os.path.join(logdir, "mirrored_2_devices", "tfpar", "*"))
                 for event in tf.compat.v1.train.summary_iterator(path)
                 for value in event.summary.value if value.tag == "device_set"]
        self.assertEqual(texts, ["CPU:0, CPU:1"])

    @parameterized.parameters(-1, 2**32, 1.5)
    def test_seed_out_of_range(self, seed):
        with self.assertRaisesRegex(ConfigError, r"seed must be an integer from 0 to 2\*\*32 - 1\. "
                                                 rf"Received: seed={seed}"):
            dataclasses.replace(CONFIG, seed=seed)

    def test_jit_compile_refused_on_cpu_replicas(self):
        with self.assertRaisesRegex(ConfigError, "^jit_compile=True cannot run on 2 replicas "
                                                 "with CPUs among them"):
            training.train_on_devices(dataclasses.replace(CONFIG, jit_compile=True), 2,
                                      splits())

    def test_bfloat16_is_refused_where_the_cap_leaves_it_without_kernels(self):
        # An AVX-512 CPU capped at AVX by hand: one line before any step, not an abort.
        zen4 = {"sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"}
        capped = onednn.choose(zen4, {onednn.ENABLE_ENV: "1", onednn.CAP_ENV: "AVX"})
        with mock.patch.object(onednn, "current", return_value=capped), \
                mock.patch.object(run, "cpu_flags", return_value=zen4), \
                self.assertRaisesRegex(ConfigError, r"^dtype=mixed_bfloat16 has no convolution "
                                                    r"under ONEDNN_MAX_CPU_ISA=AVX on this "
                                                    r"AVX-512 CPU, where TensorFlow hands "
                                                    r"bfloat16 ops to oneDNN: use float32, or "
                                                    r"start without ONEDNN_MAX_CPU_ISA\.$"):
            training.train_on_devices(dataclasses.replace(CONFIG, dtype="mixed_bfloat16"), 2,
                                      splits())

    def test_profile_steps_write_a_trace(self):
        folder = os.path.join(self.get_temp_dir(), "profile")
        training.train_on_devices(
            dataclasses.replace(CONFIG, profile_steps=(1, 1), profile_dir=folder), 1, splits())
        self.assertNotEmpty(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))

    def test_the_strategy_is_resolved_once_when_the_config_is_made(self):
        config = dataclasses.replace(
            CONFIG, strategy=strategies.choose("allreduce", accumulation_steps=2))
        self.assertEqual(config.strategy.micro_batches, 2)
        # One field: a copy with another setting keeps the strategy and its options.
        self.assertEqual(dataclasses.replace(config, epochs=3).strategy, config.strategy)
        self.assertEqual(config.for_devices(2), (64, 0.05))
        with mock.patch.object(registry, "entry", side_effect=AssertionError("looked up")):
            result = training.train_each(config, [2])
        self.assertEqual(result[0].strategy, "allreduce")
        self.assertEqual(result[0].global_batch_size, 64)

    def test_bad_options(self):
        with self.assertRaisesRegex(ConfigError, "dtype must be one of float32, bfloat16"):
            dataclasses.replace(CONFIG, dtype="float8")
        with self.assertRaisesRegex(ConfigError, r"profile_steps is \(first, last\)"):
            dataclasses.replace(CONFIG, profile_steps=(3, 2))


class ProgressVerbosityTest(tf.test.TestCase):

    def test_auto_is_bars_on_a_terminal_and_lines_elsewhere(self):
        class Terminal(io.StringIO):
            def isatty(self):
                return True

        self.assertEqual(run.progress_verbosity("auto", Terminal()), 1)
        self.assertEqual(run.progress_verbosity("auto", io.StringIO()), 2)
        self.assertEqual(run.progress_verbosity(1, io.StringIO()), 1)
        self.assertEqual(run.progress_verbosity(0, Terminal()), 0)


if __name__ == "__main__":
    tf.test.main()


class VirtualReplicasThreadsTest(tf.test.TestCase):
    """The threads world-size invariance trains with: one intra-op thread per CPU device, an
    inter-op thread per core of the process's share of the host."""

    def layout_for(self, choice, device_sets, environ):
        with mock.patch.dict(os.environ, environ, clear=False), \
                mock.patch("os.cpu_count", return_value=4), \
                mock.patch.object(run.devices_lib, "gpu_count", return_value=0), \
                mock.patch.object(run.devices_lib, "ensure_logical_cpus") as ensure:
            run._pin_for_virtual_replicas(device_sets, choice)
        (count,), kwargs = ensure.call_args
        return count, kwargs["layout"]

    def test_one_process_has_every_core_and_a_worker_its_share_of_the_host(self):
        from tfpar.host import thread_layouts
        alone = registry.choose("allreduce", virtual_replicas=4)
        self.assertEqual(self.layout_for(alone, [1, 2], {}),
                         (2, thread_layouts.ThreadLayout(1, inter_op_threads=4)))
        # Two workers of a job on this host: 4 cores, 2 each.
        cluster = {"cluster": {"worker": ["localhost:2222", "localhost:2223"]},
                   "task": {"type": "worker", "index": 1}}
        worker = registry.choose("multi_worker_allreduce", virtual_replicas=4)
        self.assertEqual(self.layout_for(worker, [1], {"TF_CONFIG": json.dumps(cluster)}),
                         (1, thread_layouts.ThreadLayout(1, inter_op_threads=2)))
