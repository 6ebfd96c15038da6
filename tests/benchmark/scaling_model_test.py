"""Tests of the all-reduce latency-bandwidth model: its formulas, its fit, its refusals."""

import math

import tensorflow as tf
from absl.testing import parameterized

from tfpar.benchmark import scaling_model
from tfpar.errors import ConfigError


class ScalingModelTest(tf.test.TestCase, parameterized.TestCase):

    def test_ring_and_tree_times(self):
        network = scaling_model.Network(latency=1e-4, bandwidth=1e9)
        # Ring at 8: 14 messages of 0.1 ms, and 2 * 7/8 of 1 GB over 1 GB/s.
        self.assertAllClose(scaling_model.predict(network, 8, 1e9), 14e-4 + 1.75)
        # Tree at 8: 2 * log2(8) = 6 messages, the same bytes.
        self.assertAllClose(scaling_model.predict(network, 8, 1e9, "tree"), 6e-4 + 1.75)
        self.assertEqual(scaling_model.predict(network, 1, 1e9), 0.0)  # Nothing to exchange.

    @parameterized.parameters("ring", "tree")
    def test_the_fit_finds_the_network_that_made_the_times(self, algorithm):
        network = scaling_model.Network(latency=3e-5, bandwidth=2.5e9)
        size = 44.7e6  # ResNet-18's float32 gradients.
        measured = [(n, scaling_model.predict(network, n, size, algorithm)) for n in (2, 4, 8)]
        fitted = scaling_model.fit(measured, size, algorithm)
        self.assertAllClose(fitted.latency, network.latency, rtol=1e-6)
        self.assertAllClose(fitted.bandwidth, network.bandwidth, rtol=1e-6)

    def test_latency_bound_times_fit_an_unbounded_bandwidth(self):
        # Times that grow exactly with the ring's 2 (N - 1) messages: latency alone.
        fitted = scaling_model.fit([(2, 2e-3), (4, 6e-3), (8, 14e-3)], 5e5)
        self.assertAllClose(fitted.latency, 1e-3)
        self.assertEqual(fitted.bandwidth, math.inf)
        self.assertAllClose(scaling_model.predict(fitted, 32, 5e5), 62e-3)

    def test_what_cannot_be_fitted_or_predicted_is_refused(self):
        with self.assertRaisesRegex(ConfigError, "needs measurements at two or more worker "
                                                 r"counts above 1\. Received: \[\(1, 0\.0\), "
                                                 r"\(2, 0\.001\)\]\."):
            scaling_model.fit([(1, 0.0), (2, 1e-3)], 1e6)
        with self.assertRaisesRegex(ConfigError, "Unknown all-reduce algorithm 'star'. Allowed: "
                                                 "ring, tree."):
            scaling_model.predict(scaling_model.Network(1e-4, 1e9), 4, 1e6, "star")


if __name__ == "__main__":
    tf.test.main()
