"""Tests of the coordination service's configuration: a heartbeat timeout on a TensorFlow
outside the verified range is refused in one line, and left to TensorFlow when unset."""

from unittest import mock

import tensorflow as tf

from tfpar.compat import coordination
from tfpar.compat import versions
from tfpar.errors import ConfigError

CLUSTER = tf.train.ClusterSpec({"worker": ["localhost:2000", "localhost:2001"]})


class CoordinationTest(tf.test.TestCase):

    def test_a_heartbeat_timeout_on_an_unverified_tensorflow_is_refused_in_one_line(self):
        with mock.patch.object(tf, "__version__", "2.99.0"):
            with self.assertRaises(ConfigError) as refused:
                coordination.configure(CLUSTER, "worker", 30.0, 60.0)
            coordination.configure(CLUSTER, "worker", None, 60.0)  # Left to TensorFlow.
        self.assertEqual(
            str(refused.exception),
            "heartbeat_timeout is set through TensorFlow internals verified on TensorFlow "
            f"{versions.tensorflow_range_text()}; this is 2.99.0. Leave it unset "
            "(TensorFlow's default, 10 s).")
