"""Tests of the all-reduce algorithms against a numpy reference, and of gradient packing."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import testing
from tfpar.allreduce import algorithms
from tfpar.errors import ConfigError
from tfpar.errors import OptionValueError
from tfpar.errors import RegistryError

# Sizes that do not divide by 2, 3 or 4 replicas, and a tensor smaller than the replica count.
SHAPES = [(3,), (5, 7), (1,), (2, 3, 2)]


class AllReduceTest(testing.StrategyTestCase):

    NUM_DEVICES = 4

    @parameterized.product(num_replicas=(1, 2, 3, 4), algorithm=algorithms.ALGORITHMS,
                           bytes_per_pack=(0, 64, 2**20))
    def test_sums_like_numpy(self, num_replicas, algorithm, bytes_per_pack):
        strategy = self.strategy("mirrored", num_replicas)
        rng = np.random.default_rng(num_replicas)
        values = [[rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
                  for _ in range(num_replicas)]
        stacked = [tf.constant(np.stack([v[i] for v in values])) for i in range(len(SHAPES))]

        @tf.function
        def reduce():
            def replica_fn():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                return algorithms.all_reduce_sum([tf.gather(s, replica) for s in stacked],
                                                algorithm, bytes_per_pack)
            return strategy.run(replica_fn)

        result = reduce()
        for i in range(len(SHAPES)):
            expected = np.sum([v[i] for v in values], axis=0)
            for copy in strategy.experimental_local_results(result[i]):
                self.assertAllClose(copy, expected, rtol=1e-6, atol=1e-6)

    def test_unknown_algorithm(self):
        # A value out of range: a ConfigError, not a RegistryError (the name was right).
        with self.assertRaisesRegex(ConfigError, r"Received: algorithm='tree'") as e:
            algorithms.check_algorithm("tree")
        self.assertIsInstance(e.exception, OptionValueError)
        self.assertNotIsInstance(e.exception, RegistryError)


class PackTest(tf.test.TestCase):

    def test_buckets_respect_size_and_dtype(self):
        tensors = [tf.zeros([4]), tf.zeros([4]), tf.zeros([100]), tf.zeros([2], tf.float64),
                   tf.zeros([1])]
        # float32: 16 + 16 bytes fit in 40; 400 bytes gets its own; float64 apart.
        self.assertEqual(algorithms.pack(tensors, 40), [[0, 1], [2], [3], [4]])
        self.assertEqual(algorithms.pack(tensors, 0), [[0], [1], [2], [3], [4]])
        self.assertEqual(algorithms.pack(tensors, 10**6), [[0, 1, 2, 4], [3]])


if __name__ == "__main__":
    tf.test.main()
