"""Tests of cluster specs and resolvers, and of waiting for the peers."""

import json
import os
import signal
import socket
import threading
import time
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

from tfpar.errors import ClusterError
from tfpar.errors import PortTakenError
from tfpar.multiworker import cluster
from tfpar.multiworker import launcher


class ClusterSpecTest(tf.test.TestCase, parameterized.TestCase):

    def test_valid_tf_config(self):
        text = json.dumps({"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
                           "task": {"type": "worker", "index": 1}})
        self.assertEqual(cluster.parse_tf_config(text),
                         ({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "worker", 1))

    @parameterized.named_parameters(
        ("not_json", "{cluster:", r"TF_CONFIG is not valid JSON"),
        ("no_task", '{"cluster": {"worker": ["a:1"]}}', r'needs "cluster" and "task"'),
        ("no_workers", '{"cluster": {}, "task": {"type": "worker", "index": 0}}',
         r"needs a 'worker' list"),
        ("bad_port", '{"cluster": {"worker": ["a:99999"]}, "task": {"type": "worker", "index": 0}}',
         r"port from 1 to 65535\. Received: 'a:99999'"),
        ("index_out_of_range",
         '{"cluster": {"worker": ["a:1", "a:2"]}, "task": {"type": "worker", "index": 2}}',
         r"task index must be from 0 to 1 for 2 worker\(s\)\. Received: 2"),
        ("duplicate", '{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", '
                      '"index": 0}}', r"appears twice"),
        ("bad_type", '{"cluster": {"worker": ["a:1"], "ps": ["b:1"]}, "task": {"type": "worker", '
                     '"index": 0}}', r"Unsupported task type\(s\) ps"),
    )
    def test_malformed_tf_config(self, text, message):
        with self.assertRaisesRegex(ClusterError, message):
            cluster.parse_tf_config(text)

    def test_resolver_from_flags(self):
        resolver = cluster.resolver("flags", ["127.0.0.1:1", "127.0.0.1:2"], 1)
        self.assertEqual((resolver.task_type, resolver.task_id), ("worker", 1))
        with self.assertRaisesRegex(ClusterError, "task index must be from 0 to 1"):
            cluster.resolver("flags", ["127.0.0.1:1", "127.0.0.1:2"], None)

    def test_resolver_checks_tf_config_before_connecting(self):
        with mock.patch.dict(os.environ, {"TF_CONFIG": '{"cluster": []}'}):
            with self.assertRaisesRegex(ClusterError, 'needs "cluster" and "task"'):
                cluster.resolver()

    def test_no_cluster_is_a_single_worker(self):
        with mock.patch.dict(os.environ, {}, clear=True):
            self.assertIsNone(cluster.resolver())


class WaitForPeersTest(tf.test.TestCase):

    def _resolver(self, own_port: int, peer_port: int):
        return cluster.resolver("flags", [f"127.0.0.1:{own_port}", f"127.0.0.1:{peer_port}"], 0)

    def _free_port(self) -> int:
        return launcher.free_ports(1)[0]

    def test_says_whom_it_waits_for_and_gives_up(self):
        own, peer = launcher.free_ports(2)
        messages = []
        with self.assertRaisesRegex(ClusterError, rf"^Worker 1 \(127\.0\.0\.1:{peer}\) did not "
                                                  r"come up within 1\.5 s\. Start every task"):
            cluster.wait_for_peers(self._resolver(own, peer), timeout=1.5,
                                   report=messages.append, report_every=0.5)
        self.assertNotEmpty(messages)
        self.assertRegex(messages[0], rf"^Waiting for worker 1 \(127\.0\.0\.1:{peer}\) since "
                                      r"\d\d:\d\d:\d\d \(\d+ s; giving up after 1\.5 s\)\.$")

    def test_returns_once_the_peer_is_up(self):
        own = self._free_port()
        with socket.socket() as peer:
            peer.bind(("127.0.0.1", 0))
            peer.listen()
            cluster.wait_for_peers(self._resolver(own, peer.getsockname()[1]), timeout=5,
                                   report=self.fail)

    def test_a_taken_port_is_named(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with self.assertRaisesRegex(PortTakenError, rf"Port {port} of this worker "
                                                        r".* is in use by another program"):
                cluster.wait_for_peers(self._resolver(port, self._free_port()), timeout=5)
        self.assertEqual(PortTakenError.exit_status, 75)

    def test_a_signal_interrupts_the_wait(self):
        def interrupt(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, interrupt)
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
        start = time.monotonic()
        try:
            timer.start()
            with self.assertRaises(KeyboardInterrupt):
                cluster.wait_for_peers(self._resolver(*launcher.free_ports(2)), timeout=60)
        finally:
            timer.cancel()
            signal.signal(signal.SIGTERM, previous)
        self.assertLess(time.monotonic() - start, 30)


if __name__ == "__main__":
    tf.test.main()
