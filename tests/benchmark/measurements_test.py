"""Tests of benchmark configurations and sweeps."""

import os

import tensorflow as tf

from tfpar import benchmark
from tfpar.benchmark import Configuration


class ConfigurationsTest(tf.test.TestCase):

    def test_every_device_gets_the_same_share_by_default(self):
        sweep = benchmark.configurations(["mirrored", "allreduce"], [1, 4], ["lenet"], 32,
                                         baseline=True, dtype="bfloat16")
        threads = max(1, os.cpu_count() // 4)
        self.assertEqual(sweep, [
            Configuration("keras", 1, "lenet", 32, dtype="bfloat16"),
            Configuration("mirrored", 1, "lenet", 32, threads, dtype="bfloat16"),
            Configuration("mirrored", 4, "lenet", 32, threads, dtype="bfloat16"),
            Configuration("allreduce", 1, "lenet", 32, threads, dtype="bfloat16"),
            Configuration("allreduce", 4, "lenet", 32, threads, dtype="bfloat16")])
        self.assertEqual(Configuration.from_json(sweep[2].to_json()), sweep[2])

    def test_options_are_swept_for_the_entries_that_take_them(self):
        sweep = benchmark.configurations(
            ["mirrored", "allreduce"], [2], ["lenet"], 32, threads_per_device=1,
            strategy_options={"algorithm": ["collective", "ring", "naive"],
                              "bytes_per_pack": [0]})
        self.assertEqual([c.label for c in sweep], [
            "mirrored", "allreduce(algorithm=collective,bytes_per_pack=0)",
            "allreduce(algorithm=ring,bytes_per_pack=0)",
            "allreduce(algorithm=naive,bytes_per_pack=0)"])
        self.assertEqual(Configuration.from_json(sweep[2].to_json()), sweep[2])


if __name__ == "__main__":
    tf.test.main()
