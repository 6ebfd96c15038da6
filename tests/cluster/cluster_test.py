"""Tests of cluster specs and resolvers, and of waiting for the peers."""

import contextlib
import json
import os
import signal
import socket
import threading
import time
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

from tfpar.cluster import launcher
from tfpar.cluster import peers as cluster_peers
from tfpar.cluster import spec as cluster_spec
from tfpar.errors import ClusterError
from tfpar.errors import PeerUnreachableError
from tfpar.errors import PortTakenError


class ClusterSpecTest(tf.test.TestCase, parameterized.TestCase):

    def test_valid_tf_config(self):
        text = json.dumps({"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
                           "task": {"type": "worker", "index": 1}})
        self.assertEqual(cluster_spec.parse_tf_config(text),
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
            cluster_spec.parse_tf_config(text)

    def test_resolver_from_flags(self):
        resolver = cluster_spec.resolver("flags", ["127.0.0.1:1", "127.0.0.1:2"], 1)
        self.assertEqual((resolver.task_type, resolver.task_id), ("worker", 1))
        with self.assertRaisesRegex(ClusterError, "task index must be from 0 to 1"):
            cluster_spec.resolver("flags", ["127.0.0.1:1", "127.0.0.1:2"], None)

    def test_resolver_checks_tf_config_before_connecting(self):
        with mock.patch.dict(os.environ, {"TF_CONFIG": '{"cluster": []}'}):
            with self.assertRaisesRegex(ClusterError, 'needs "cluster" and "task"'):
                cluster_spec.resolver()

    def test_tasks_on_host_counts_the_chief_and_workers_sharing_an_address(self):
        spec = {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001", "10.0.0.2:2001",
                                                        "[::1]:2002"]}
        self.assertEqual(cluster_spec.tasks_on_host(spec, "worker", 0), 2)
        self.assertEqual(cluster_spec.tasks_on_host(spec, "worker", 1), 1)
        self.assertEqual(cluster_spec.tasks_on_host(spec, "worker", 2), 1)
        self.assertEqual(cluster_spec.tasks_on_host(
            {"worker": {0: "127.0.0.1:2001", 3: "127.0.0.1:2004"}}, "worker", 3), 2)

    def test_no_cluster_is_a_single_worker(self):
        with mock.patch.dict(os.environ, {}, clear=True):
            self.assertIsNone(cluster_spec.resolver())


class WaitForPeersTest(tf.test.TestCase):

    def _resolver(self, own_port: int, peer_port: int):
        return cluster_spec.resolver("flags", [f"127.0.0.1:{own_port}",
                                               f"127.0.0.1:{peer_port}"], 0)

    def _free_port(self) -> int:
        return launcher.free_ports(1)[0]

    def test_the_chief_leaves_after_its_peers(self):
        # A peer whose port answers (a running worker) is waited for until it leaves; one that
        # does not answer (ended, or hung) is not.
        peer = socket.socket()
        peer.bind(("127.0.0.1", 0))
        peer.listen()
        port = peer.getsockname()[1]

        def answer_then_leave():
            deadline = time.monotonic() + 1.0
            peer.settimeout(0.2)
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    connection = peer.accept()[0]
                    connection.send(b"up")
                    connection.close()
            peer.close()

        threading.Thread(target=answer_then_leave).start()
        start = time.monotonic()
        cluster_peers.leave_last(self._resolver(self._free_port(), port), timeout=10)
        self.assertGreater(time.monotonic() - start, 0.9)  # It waited for the peer to leave.
        start = time.monotonic()
        cluster_peers.leave_last(self._resolver(self._free_port(), port), timeout=120)
        # The peer was gone: it returned long before its timeout.
        self.assertLess(time.monotonic() - start, 60)

    def test_the_chief_stopped_while_it_waits_leaves_quietly(self):
        # A peer that answers for ever (a hung worker whose port still accepts); the launcher
        # stops the job meanwhile (SIGINT): no KeyboardInterrupt from the exit handler.
        peer = socket.socket()
        peer.bind(("127.0.0.1", 0))
        peer.listen()
        self.addCleanup(peer.close)
        threading.Timer(0.5, signal.pthread_kill, (threading.get_ident(), signal.SIGINT)).start()
        start = time.monotonic()
        cluster_peers.leave_last(self._resolver(self._free_port(), peer.getsockname()[1]),
                                 timeout=120)
        # Stopped by the interrupt, long before its timeout.
        self.assertLess(time.monotonic() - start, 60)

    def test_says_whom_it_waits_for_and_gives_up(self):
        own, peer = launcher.free_ports(2)
        messages = []
        with self.assertRaisesRegex(PeerUnreachableError,
                                    rf"^Worker 1 \(127\.0\.0\.1:{peer}\) did not come up within "
                                    r"1\.5 s \(its port did not answer.*\)\. Start every task"):
            cluster_peers.wait_for_peers(self._resolver(own, peer), timeout=1.5,
                                   report=messages.append, report_every=0.5)
        self.assertNotEmpty(messages)
        self.assertRegex(messages[0], rf"^Waiting for worker 1 \(127\.0\.0\.1:{peer}\) since "
                                      r"\d\d:\d\d:\d\d \(\d+ s; giving up after 1\.5 s\)\.$")

    def test_returns_once_the_peer_is_up(self):
        # Both tasks wait for each other, as two workers do; then the peer starts its
        # TensorFlow server on its port, which answers from then on.
        own, peer = launcher.free_ports(2)

        def other_worker():
            cluster_peers.wait_for_peers(
                cluster_spec.resolver("flags", [f"127.0.0.1:{own}", f"127.0.0.1:{peer}"], 1), 10)
            self.servers.append(tf.distribute.Server(
                tf.train.ClusterSpec({"worker": [f"localhost:{peer}"]}), "worker", 0))

        self.servers = []
        other = threading.Thread(target=other_worker)
        other.start()
        waiting = []  # "Waiting for" lines, while the peer's server starts.
        cluster_peers.wait_for_peers(self._resolver(own, peer), timeout=10, report=waiting.append)
        # This task's port goes on answering (its server would), until the peer has seen it.
        with socket.socket() as stay:
            stay.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            stay.bind(("127.0.0.1", own))
            stay.listen()
            stay.settimeout(0.2)
            deadline = time.monotonic() + 30
            while other.is_alive() and time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    connection = stay.accept()[0]
                    connection.send(b"up")
                    connection.close()
        other.join(10)
        self.assertFalse(other.is_alive())
        self.assertTrue(all(line.startswith("Waiting for worker 1") for line in waiting))

    def test_a_peer_whose_server_runs_already_counts_as_up(self):
        port = self._free_port()
        self.server = tf.distribute.Server(
            tf.train.ClusterSpec({"worker": [f"localhost:{port}"]}), "worker", 0)
        cluster_peers.wait_for_peers(self._resolver(self._free_port(), port), timeout=10,
                               report=self.fail)

    def test_a_port_that_connects_but_never_answers_is_waited_for(self):
        # What a firewall, a proxy or a dead machine behind one looks like: TCP's handshake
        # completes (the kernel's backlog) but nothing ever answers.
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            port = silent.getsockname()[1]
            messages = []
            with self.assertRaisesRegex(ClusterError, rf"^Worker 1 \(127\.0\.0\.1:{port}\) "
                                                      r"did not come up within 3 s \(its port "
                                                      r"did not answer"):
                cluster_peers.wait_for_peers(self._resolver(self._free_port(), port), timeout=3,
                                       report=messages.append, report_every=1)
        self.assertRegex(messages[0], rf"^Waiting for worker 1 \(127\.0\.0\.1:{port}\)")

    def test_a_taken_port_is_named(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with self.assertRaisesRegex(PortTakenError, rf"Port {port} of this worker "
                                                        r".* is in use by another program"):
                cluster_peers.wait_for_peers(self._resolver(port, self._free_port()), timeout=5)
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
                cluster_peers.wait_for_peers(self._resolver(*launcher.free_ports(2)), timeout=60)
        finally:
            timer.cancel()
            signal.signal(signal.SIGTERM, previous)
        self.assertLess(time.monotonic() - start, 30)


if __name__ == "__main__":
    tf.test.main()
