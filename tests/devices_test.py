"""Tests of device sets: counts, names, logical CPU splitting and its errors.

The pytest plugin splits the CPU into 4 logical devices before this module is imported
(``tfpar_devices = 4`` in setup.cfg).
"""

import os
import subprocess
import sys
import unittest
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

from tfpar import devices
from tfpar.errors import DeviceError

# Tests of a machine without GPUs, where a count means logical CPUs (on a GPU machine it means
# GPUs, and these are skipped rather than failed).
without_gpus = unittest.skipIf(bool(tf.config.list_physical_devices("GPU")),
                               "this machine has GPUs: device counts mean GPUs here")


class ResolveTest(tf.test.TestCase, parameterized.TestCase):

    @without_gpus
    def test_count_gives_logical_cpus_without_gpus(self):
        device_set = devices.resolve(2)
        self.assertEqual(device_set.names, ("CPU:0", "CPU:1"))
        self.assertEqual(str(device_set), "[CPU:0, CPU:1]")
        self.assertEqual(device_set.tf_names, ["/device:CPU:0", "/device:CPU:1"])
        self.assertEqual(len(tf.config.list_logical_devices("CPU")), 4)

    @without_gpus
    def test_fewer_gpus_than_asked_is_said_in_one_line(self):
        with mock.patch.object(devices, "gpu_count", return_value=1), \
                self.assertLogs(logger="absl", level="WARNING") as logs:
            device_set = devices.resolve(2)
        self.assertEqual(device_set.names, ("CPU:0", "CPU:1"))
        self.assertEqual(logs.output, [
            "WARNING:absl:2 devices asked and this process sees 1 GPU(s): training on 2 logical "
            "CPU devices instead. Ask for 1 devices to train on the GPUs."])

    @parameterized.parameters("CPU:0,CPU:1", "cpu:0, /device:CPU:1",
                              "/job:localhost/replica:0/task:0/device:CPU:1,CPU:0")
    def test_names(self, text):
        self.assertCountEqual(devices.resolve(text).names, ("CPU:0", "CPU:1"))

    def test_parse(self):
        self.assertEqual(devices.parse("3"), 3)
        self.assertEqual(devices.parse("GPU:0, GPU:1"), ("GPU:0", "GPU:1"))

    @parameterized.parameters(0, -1, "0", "-2")
    def test_non_positive_count(self, spec):
        with self.assertRaisesRegex(DeviceError, r"number of devices must be from 1 to 64\. "
                                                 r"Received: -?\d+\."):
            devices.resolve(spec)

    @without_gpus
    def test_too_many(self):
        with self.assertRaisesRegex(DeviceError, r"from 1 to 64\. Received: 65\."):
            devices.resolve(65)

    def test_non_numeric(self):
        with self.assertRaisesRegex(DeviceError, r"Device names look like CPU:0 or GPU:1\. "
                                                 r"Received: 'two'\."):
            devices.resolve("two")

    @without_gpus
    def test_missing_gpu_says_what_exists(self):
        with self.assertRaisesRegex(DeviceError, r"No such GPU: \['GPU:0'\] asks for GPU:0, but "
                                                 r"this machine has 4 logical CPU device\(s\), "
                                                 r"no GPU\."):
            devices.resolve("GPU:0")

    def test_repeated_device(self):
        with self.assertRaisesRegex(DeviceError, "cannot repeat a device"):
            devices.resolve("CPU:0,cpu:0")

    @without_gpus
    def test_too_late_to_split_more(self):
        tf.constant(1.0)  # TensorFlow is initialised (with 4 logical CPUs).
        with self.assertRaisesRegex(DeviceError, r"Cannot split the CPU into 5 logical devices: "
                                                 r"TensorFlow has already initialised with 4.*"
                                                 r"--tfpar-devices=5"):
            devices.resolve(5)

    @without_gpus
    def test_split_gpu_without_gpu(self):
        with self.assertRaisesRegex(DeviceError, "Cannot split a GPU: this machine has none"):
            devices.split_gpu(2, 1024)


class ThreadsTest(tf.test.TestCase):

    def test_each_logical_cpu_gets_its_share_of_the_cores(self):
        # The plugin split the CPU into 4 devices before TensorFlow started.
        cores = os.cpu_count()
        self.assertEqual(tf.config.threading.get_intra_op_parallelism_threads(),
                         max(1, cores // 4))
        self.assertEqual(tf.config.threading.get_inter_op_parallelism_threads(), 4)
        # Each device has a pool of those threads to itself rather than one shared pool.
        self.assertEqual(os.environ.get(devices.PER_DEVICE_THREAD_POOLS_ENV), "1")

    def test_threads_per_device_must_be_a_positive_integer(self):
        for bad in (0, -1, 1.5, True, "2"):
            with self.assertRaisesRegex(DeviceError, r"threads_per_device must be an integer >= "
                                                     rf"1\. Received: threads_per_device={bad!r}"):
                devices.ensure_logical_cpus(2, bad)

    def test_fewer_inter_op_threads_than_devices_are_kept_with_a_warning(self):
        # One inter-op thread for 2 devices halves every step (measured; README).
        for inter_op, warned in ((1, True), (2, False)):
            code = ("import tensorflow as tf\n"
                    f"tf.config.threading.set_inter_op_parallelism_threads({inter_op})\n"
                    "from tfpar import devices\n"
                    "devices.ensure_logical_cpus(2)\n"
                    "print('inter-op', tf.config.threading.get_inter_op_parallelism_threads())\n")
            result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                    text=True, timeout=120,
                                    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
            self.assertIn(f"inter-op {inter_op}", result.stdout, result.stderr[-2000:])
            warning = ("1 inter-op thread(s) set with tf.config.threading for 2 logical CPU "
                       "devices: the replicas take turns")
            self.assertEqual(warning in result.stderr, warned, result.stderr[-2000:])

    def test_threads_cannot_change_after_initialisation(self):
        tf.constant(1.0)
        other = tf.config.threading.get_intra_op_parallelism_threads() + 1
        with self.assertRaisesRegex(DeviceError, f"Cannot give each CPU device {other} thread"):
            devices.ensure_logical_cpus(2, other)


if __name__ == "__main__":
    tf.test.main()
