"""Tests of the built-in registry entries."""

import tensorflow as tf

from tfpar import devices
from tfpar import strategies
from tfpar import testing
from tfpar.errors import ConfigError
from tfpar.errors import RegistryError
from tfpar.strategies import cross_device_ops


class BuiltinsTest(testing.StrategyTestCase):

    def test_available_lists_builtins_with_descriptions(self):
        listed = strategies.available()
        for name in ("default", "one_device", "mirrored", "central_storage", "allreduce"):
            self.assertIn(name, listed)
            self.assertTrue(listed[name])

    @testing.for_each_strategy(num_devices=(1, 2))
    def test_get_returns_a_strategy_with_one_replica_per_device(self, strategy_name,
                                                               num_devices):
        strategy = self.strategy(strategy_name, num_devices)
        self.assertIsInstance(strategy, tf.distribute.Strategy)
        self.assertEqual(strategy.num_replicas_in_sync, num_devices)

    def test_mirrored_uses_the_devices(self):
        strategy = strategies.get("mirrored", "CPU:0,CPU:1")
        self.assertEqual(strategy.extended.worker_devices,
                         ("/job:localhost/replica:0/task:0/device:CPU:0",
                          "/job:localhost/replica:0/task:0/device:CPU:1"))

    def test_cross_device_ops_default_on_cpu(self):
        ops = cross_device_ops.make_cross_device_ops("auto", devices.resolve(2))
        self.assertIsInstance(ops, tf.distribute.ReductionToOneDevice)

    def test_nccl_on_cpu_is_refused(self):
        with self.assertRaisesRegex(ConfigError, r"cross_device_ops='nccl' needs GPUs only"):
            strategies.get("mirrored", 2, cross_device_ops="nccl")

    def test_a_multi_worker_process_refuses_cpus_and_gpus_together(self):
        from tfpar.strategies import multi_worker
        from tfpar.strategies.multi_worker_options import MultiWorkerOptions

        with self.assertRaisesRegex(ConfigError, r"^A multi_worker process runs on its GPUs or "
                                                   r"on CPU devices, not both\. Received: "
                                                   r"\[CPU:0, GPU:0\]\.$"):
            multi_worker.make(tf.distribute.MultiWorkerMirroredStrategy,
                              devices.DeviceSet(("CPU:0", "GPU:0")), MultiWorkerOptions())

    def test_one_device_entries_refuse_two_devices(self):
        with self.assertRaisesRegex(RegistryError, r"Strategy 'one_device' runs on at most 1 "
                                                   r"device\(s\)\. Received: \[CPU:0, CPU:1\]"):
            strategies.get("one_device", 2)

    def test_unknown_name_lists_what_exists(self):
        with self.assertRaisesRegex(RegistryError, r"Unknown strategy 'mirroed'\. Available "
                                                   r"strategies: .*allreduce.*mirrored"):
            strategies.get("mirroed")

    def test_unknown_option_lists_options(self):
        with self.assertRaisesRegex(RegistryError, r"Strategy 'mirrored' has no option\(s\) "
                                                   r"num_packs\. Its options: cross_device_ops\."):
            strategies.get("mirrored", 2, num_packs=2)

    def test_bad_allreduce_algorithm(self):
        with self.assertRaisesRegex(ConfigError, r"^algorithm must be one of collective, naive, "
                                                   r"ring \(the all-reduce algorithm\)\. "
                                                   r"Received: algorithm='tree'\.$"):
            strategies.get("allreduce", 2, algorithm="tree")


if __name__ == "__main__":
    tf.test.main()
