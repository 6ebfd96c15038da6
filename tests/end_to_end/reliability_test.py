"""Reliability: divergence stops with a useful message, runs reproduce, interrupts lose nothing."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from tfpar import data
from tfpar import testing
from tfpar import training
from tfpar.cluster import launcher
from tfpar.cluster import private_network
from tfpar.errors import NonFiniteLossError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "scripts", "train.py")


def small_splits():
    return data.load("synthetic", image_shape=(28, 28, 1), synthetic_size=(96, 32))


class NonFiniteLossTest(testing.StrategyTestCase):

    def test_stops_at_the_first_non_finite_loss_and_keeps_results(self):
        config = training.TrainConfig(strategy="allreduce", dataset="synthetic", lr=1e12,
                                      batch_size=32, epochs=3, verbose=0)
        with self.assertRaisesRegex(NonFiniteLossError,
                                    r"the loss became (nan|inf) at epoch 1, step \d, on "
                                    r"\[CPU:0, CPU:1\]\. The learning rate \(1e\+12\) is "
                                    r"probably too high for the batch size \(32\); lower lr\."
                                    ) as raised:
            training.train_on_devices(config, 2, small_splits())
        self.assertLen(raised.exception.results, 1)
        self.assertLen(raised.exception.results[0].epoch_seconds, 1)  # Stopped in epoch 1.

    def test_script_writes_what_was_measured(self):
        output = os.path.join(self.get_temp_dir(), "diverged.json")
        result = subprocess.run(
            [sys.executable, TRAIN, "--dataset=digits", "--num_devices=1", "--epochs=2",
             "--lr=1e12", "--verbose=0", f"--output={output}"],
            capture_output=True, text=True, timeout=300)
        self.assertEqual(result.returncode, 2)
        self.assertIn("Error: Training stopped: the loss became", result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        with open(output, encoding="utf-8") as f:
            self.assertLen(json.load(f)["results"], 1)


class ReproducibilityTest(testing.StrategyTestCase):

    def test_seed_and_determinism_reproduce_weights_and_accuracy(self):
        base = self.get_temp_dir()
        config = training.TrainConfig(strategy="mirrored", dataset="synthetic", epochs=2,
                                      batch_size=32, verbose=0, deterministic=True, seed=7)
        runs = [training.train_on_devices(
                    dataclasses.replace(config, model_dir=os.path.join(base, str(i))), 2,
                    small_splits()) for i in range(2)]
        self.assertEqual(runs[0].test_accuracy, runs[1].test_accuracy)
        self.assertEqual(runs[0].history["loss"], runs[1].history["loss"])
        readers = [tf.train.load_checkpoint(os.path.join(base, str(i), "mirrored_2_devices"))
                   for i in range(2)]
        names = [n for n in readers[0].get_variable_to_shape_map() if "VARIABLE" in n]
        for name in names:
            np.testing.assert_array_equal(readers[0].get_tensor(name),
                                          readers[1].get_tensor(name), err_msg=name)


class InterruptTest(tf.test.TestCase):

    def test_sigterm_keeps_the_old_results_and_a_resumable_state(self):
        base = self.get_temp_dir()
        output, model_dir = os.path.join(base, "results.json"), os.path.join(base, "state")
        with open(output, "w", encoding="utf-8") as f:
            f.write('{"previous": "complete"}\n')
        job = subprocess.Popen(
            [sys.executable, TRAIN, "--dataset=digits", "--num_devices=1", "--epochs=200",
             "--verbose=0", f"--output={output}", f"--model_dir={model_dir}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        state = os.path.join(model_dir, "mirrored_1_devices")
        deadline = time.monotonic() + 240
        while tf.train.latest_checkpoint(state) is None:
            self.assertIsNone(job.poll(), job.stderr.read() if job.poll() is not None else "")
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)  # A preemption notice: saved where it stops.
        _, stderr = job.communicate(timeout=120)
        self.assertEqual(job.returncode, 85, stderr[-2000:])
        self.assertRegex(stderr, r"Preempted \(SIGTERM\): state saved at (epoch \d+ step \d+|the "
                                 r"end of epoch \d+) in .*mirrored_1_devices, [\d.]+ s after the "
                                 r"notice; run the same command to resume\.")
        self.assertNotIn("Traceback", stderr)
        with open(output, encoding="utf-8") as f:
            self.assertEqual(json.load(f), {"previous": "complete"})
        self.assertEqual([n for n in os.listdir(base) if n.endswith(".tmp")], [])
        self.assertIsNotNone(tf.train.latest_checkpoint(state))


class WaitingWorkerCase(tf.test.TestCase):
    """Reads a waiting worker's lines, and stops it."""

    def read_until(self, job: subprocess.Popen, text: str) -> list[str]:
        lines: list[str] = []
        while not any(text in line for line in lines):
            line = job.stderr.readline()
            self.assertTrue(line, "".join(lines)[-2000:])  # It must not end by itself.
            lines.append(line)
        return lines

    def assert_sigterm_ends_the_wait(self, job: subprocess.Popen) -> None:
        signalled = time.monotonic()
        job.send_signal(signal.SIGTERM)  # A preemption notice before training: stops at once.
        _, stderr = job.communicate(timeout=60)
        self.assertEqual(job.returncode, 85, stderr[-2000:])
        self.assertLess(time.monotonic() - signalled, 10)
        self.assertIn("Preempted (SIGTERM) outside training: no training step had run", stderr)
        self.assertNotIn("Traceback", stderr)


class UnreachablePeerTest(WaitingWorkerCase):
    """A worker whose peer's port completes TCP's handshake but never answers (a firewall, a
    proxy, a dead machine behind one): the wait is reported, bounded, and ends on SIGTERM."""

    def start_worker(self, *flags):
        silent = socket.socket()
        self.addCleanup(silent.close)
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        peer = f"127.0.0.1:{silent.getsockname()[1]}"
        own = f"127.0.0.1:{launcher.free_ports(1)[0]}"
        tf_config = {"cluster": {"worker": [peer, own]}, "task": {"type": "worker", "index": 1}}
        job = subprocess.Popen(
            [sys.executable, TRAIN, "--dataset=digits", "--epochs=1", "--strategy=multi_worker",
             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "TF_CONFIG": json.dumps(tf_config)})
        self.addCleanup(job.kill)
        return job, peer

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_the_wait_is_reported_and_bounded_by_the_cluster_timeout(self):
        job, peer = self.start_worker("--cluster_timeout=7")
        _, stderr = job.communicate(timeout=120)
        self.assertEqual(job.returncode, 69, stderr[-2000:])
        self.assertIn(f"Waiting for worker 0 ({peer}) since", stderr)
        self.assertIn(f"Error: Worker 0 ({peer}) did not come up within 7 s (its port did "
                      "not answer", stderr)
        self.assertNotIn("Traceback", stderr)

    def test_sigterm_ends_the_wait(self):
        job, _ = self.start_worker("--cluster_timeout=300")
        self.read_until(job, "Waiting for worker 0")
        self.assert_sigterm_ends_the_wait(job)


class DroppedPacketsTest(WaitingWorkerCase):
    """A peer whose packets are dropped (a firewall that drops, a dead host on a routed
    network): inside a network namespace of the test's own, the worker's address on one end of
    a veth pair and a static neighbour entry for the peer's address, which nothing answers, so a
    connection to it times out in silence. No packet leaves the namespace."""

    WORKER, PEER = "192.0.2.1", "192.0.2.2"  # TEST-NET-1, inside the namespace only.

    def start_worker(self, *flags):
        network = private_network.Namespace()
        self.addCleanup(network.close)
        for command in (("link", "add", "tfpar0", "type", "veth", "peer", "name", "tfpar1"),
                        ("addr", "add", f"{self.WORKER}/24", "dev", "tfpar0"),
                        ("link", "set", "tfpar0", "up"), ("link", "set", "tfpar1", "up"),
                        ("neigh", "add", self.PEER, "lladdr", "02:00:00:00:00:02", "dev",
                         "tfpar0", "nud", "permanent")):
            subprocess.run(["ip", *command], check=True, preexec_fn=network.enter)
        hosts = f"{self.WORKER}:23456,{self.PEER}:23456"
        start = time.monotonic()
        job = subprocess.Popen(
            [sys.executable, TRAIN, "--dataset=digits", "--epochs=1", "--strategy=multi_worker",
             f"--worker_hosts={hosts}", "--task_index=0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=network.enter, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        self.addCleanup(job.kill)
        return job, start

    def wait_for_the_waiting_line(self, job, start):
        lines = self.read_until(job, f"Waiting for worker 1 ({self.PEER}:23456)")
        # Said before a connection to the silent peer could time out (Linux gives up on a SYN
        # after 127 s); the bound leaves room for TensorFlow's import on a loaded machine.
        self.assertLess(time.monotonic() - start, 45, "".join(lines)[-2000:])
        return lines

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_the_worker_says_what_it_waits_for_and_gives_up_at_the_timeout(self):
        job, start = self.start_worker("--cluster_timeout=15")
        lines = self.wait_for_the_waiting_line(job, start)
        stderr = "".join(lines) + job.communicate(timeout=120)[1]
        self.assertEqual(job.returncode, 69, stderr[-2000:])
        self.assertBetween(time.monotonic() - start, 15, 45)
        self.assertIn(f"Error: Worker 1 ({self.PEER}:23456) did not come up within 15 s",
                      stderr)
        self.assertNotIn("Traceback", stderr)

    def test_sigterm_ends_the_wait(self):
        job, start = self.start_worker("--cluster_timeout=300")
        self.wait_for_the_waiting_line(job, start)
        self.assert_sigterm_ends_the_wait(job)


class PeerLeavesDuringSetUpTest(tf.test.TestCase, parameterized.TestCase):
    """A peer that is up when the worker looks (it answers the worker's probe) and gone before
    TensorFlow has connected the cluster: TensorFlow's own wait would last an hour (the leader's
    for ever) inside a call that no signal interrupts; the set-up ends at the cluster timeout."""

    @parameterized.named_parameters(("leader", 0), ("follower", 1))
    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_the_set_up_ends_at_the_cluster_timeout_with_one_line(self, index):
        peer = socket.socket()
        self.addCleanup(peer.close)
        peer.bind(("127.0.0.1", 0))
        peer.listen()

        def answer_once_then_leave():
            connection, _ = peer.accept()
            connection.send(b"up\n")
            connection.close()
            peer.close()

        threading.Thread(target=answer_once_then_leave, daemon=True).start()
        hosts = [f"127.0.0.1:{launcher.free_ports(1)[0]}"]
        hosts.insert(1 - index, f"127.0.0.1:{peer.getsockname()[1]}")
        start = time.monotonic()
        job = subprocess.run(
            [sys.executable, TRAIN, "--dataset=digits", "--epochs=1", "--strategy=multi_worker",
             f"--worker_hosts={','.join(hosts)}", f"--task_index={index}",
             "--cluster_timeout=10"], capture_output=True, text=True, timeout=180)
        self.assertEqual(job.returncode, 69, job.stderr[-2000:])
        self.assertLess(time.monotonic() - start, 90)
        self.assertIn("Error: A peer went away while TensorFlow connected the cluster: not every "
                      "task registered within 10 s.", job.stderr)
        self.assertNotIn("Traceback", job.stderr)


if __name__ == "__main__":
    tf.test.main()
