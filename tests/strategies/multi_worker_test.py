"""Tests of the multi-worker strategies' check that every worker has as many devices, without
processes: the coordination service's store is stood in for (the jobs of unequal counts run in
tests/keras_distribution_test.py)."""

from unittest import mock

import tensorflow as tf

from tfpar.cluster import peers
from tfpar.compat import coordination_values
from tfpar.errors import ConfigError
from tfpar.strategies import multi_worker


class _Clock:
    """A clock that moves only when a wait for a key times out."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


def _resolver(workers: int, index: int = 0):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": [f"localhost:{2000 + i}" for i in range(workers)]}),
        task_type="worker", task_id=index)


class SameReplicasTest(tf.test.TestCase):

    def check(self, store: dict, workers: int, local: int, timeout: float = 300.0):
        clock, waits = _Clock(), []

        def wait_for(key, seconds):
            waits.append((key, seconds))
            if key in store:
                return store[key]
            clock.now += seconds
            return None

        with mock.patch.object(coordination_values, "skip_reason", lambda: None), \
                mock.patch.object(coordination_values, "insert",
                                  lambda key, value: store.setdefault(key, value)), \
                mock.patch.object(coordination_values, "wait_for", wait_for), \
                mock.patch.object(peers.time, "monotonic", clock.monotonic):
            multi_worker._check_same_replicas(_resolver(workers), local, timeout)
        return clock.now, waits

    def test_unequal_counts_are_named_in_one_line(self):
        store = {"tfpar/local_replicas/worker/1": "1", "tfpar/local_replicas/worker/2": "2"}
        with self.assertRaisesRegex(ConfigError, r"^Every worker of a job must train on as many "
                                                 r"devices as the others .* this job's have "
                                                 r"worker 0: 2, worker 1: 1, worker 2: 2\. "
                                                 r"Give each worker"):
            self.check(store, 3, 2)

    def test_equal_counts_pass_without_waiting(self):
        store = {"tfpar/local_replicas/worker/1": "2"}
        waited, _ = self.check(store, 2, 2)
        self.assertEqual(waited, 0.0)

    def test_peers_that_never_say_cost_one_minute_in_all_and_are_named_meanwhile(self):
        # Two of three workers died after connecting: one deadline for both, not one each.
        with self.assertLogs(level="WARNING") as logs:
            waited, waits = self.check({}, 3, 1)
        self.assertEqual(waited, 60.0)
        self.assertTrue(all(seconds <= 5.0 for _, seconds in waits))
        self.assertIn("Waiting for worker 1 to say how many devices it trains on", logs.output[0])
        # A shorter cluster timeout is the bound.
        waited, _ = self.check({}, 2, 1, timeout=12.0)
        self.assertEqual(waited, 12.0)
