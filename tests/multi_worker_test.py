"""Tests of multi-worker training: cluster checks, the launcher, and 2 workers vs one process."""

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from unittest import mock

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import cluster
from tfpar import launcher
from tfpar import testing
from tfpar.errors import ClusterError
from tfpar.errors import ConfigError
from tfpar.errors import PortTakenError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import multi_worker_worker  # noqa: E402  (the worker program, importable for its model)


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


class LauncherTest(tf.test.TestCase):

    def test_a_failing_worker_stops_the_others(self):
        code = ("import json, os, sys, time\n"
                "rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
                "print('started', flush=True)\n"
                "sys.exit(3) if rank == 1 else time.sleep(60)\n")
        out = io.StringIO()
        start = time.monotonic()
        status = launcher.launch([sys.executable, "-c", code], 2, out=out)
        self.assertEqual(status, 3)
        self.assertLess(time.monotonic() - start, 30)  # Worker 0 was stopped, not waited for.
        self.assertIn("[worker 0] started", out.getvalue())
        self.assertIn("[worker 1] started", out.getvalue())
        self.assertIn("launcher: worker 1 exited with 3; stopped the other workers.",
                      out.getvalue())

    def test_each_worker_gets_its_own_tf_config(self):
        configs = [json.loads(c) for c in launcher.tf_configs(3)]
        self.assertEqual([c["task"]["index"] for c in configs], [0, 1, 2])
        workers = configs[0]["cluster"]["worker"]
        self.assertLen(set(workers), 3)
        self.assertTrue(all(w.startswith("127.0.0.1:") for w in workers))

    def test_empty_command(self):
        with self.assertRaisesRegex(launcher.ConfigError, "Give the command to run after '--'"):
            launcher.launch([], 2)

    def test_a_program_that_cannot_run(self):
        with self.assertRaisesRegex(launcher.ConfigError, r"Cannot run '/nonexistent': No such "
                                                          r"file or directory\. Give a program"):
            launcher.launch(["/nonexistent", "x"], 2)

    def test_a_host_that_is_not_this_machine(self):
        with self.assertRaisesRegex(launcher.ConfigError, r"Cannot open a port on host "
                                                          r"'10\.255\.255\.1' .*give one of its "
                                                          r"addresses, e\.g\. 127\.0\.0\.1"):
            launcher.launch([sys.executable, "-c", "pass"], 2, host="10.255.255.1",
                            network="host")

    def test_a_private_network_has_only_loopback(self):
        with self.assertRaisesRegex(ConfigError, r"A private network has only loopback: host "
                                                 r"must be a loopback address .* Received: "
                                                 r"'10\.0\.0\.1'"):
            launcher.launch([sys.executable, "-c", "pass"], 2, host="10.0.0.1")

    def test_both_sides_name_the_private_network_alike(self):
        self.assertEqual(launcher.PRIVATE_NETWORK_ENV, cluster.PRIVATE_NETWORK_ENV)

    def test_starts_again_with_new_ports_when_a_port_was_taken(self):
        marker = os.path.join(self.get_temp_dir(), "tried")
        code = ("import os, sys\n"
                f"marker = {marker!r} + os.environ['TF_CONFIG'][-3]\n"
                "if not os.path.exists(marker):\n"
                "    open(marker, 'w').close()\n"
                "    sys.exit(75)\n"
                "print('port', os.environ['TF_CONFIG'].split(':')[-3][:5], flush=True)\n")
        out = io.StringIO()
        status = launcher.launch([sys.executable, "-c", code], 2, out=out, network="host")
        self.assertEqual(status, 0, out.getvalue())
        self.assertIn("launcher: a worker's port was taken by another program; starting again "
                      "with new ports (attempt 2 of 3).", out.getvalue())
        self.assertIn("listen on every network interface, unauthenticated", out.getvalue())

    def test_workers_listen_on_a_private_loopback_and_stop_on_sigterm(self):
        process = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=2", "--",
             sys.executable, os.path.join(HERE, "multi_worker_worker.py"), "serve"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        try:
            ready = {}
            for line in process.stdout:  # Event-driven: each worker says when it is in.
                match = re.match(r"\[worker (\d)\] ready (\d+) (\d+)", line)
                if match:
                    ready[match[1]] = (int(match[2]), int(match[3]))
                if len(ready) == 2:
                    break
            self.assertLen(ready, 2)
            pid, port = ready["1"]
            listening = re.compile(rf"^\s*\d+: [0-9A-F]+:{port:04X} [0-9A-F]+:0000 0A ", re.M)
            with open(f"/proc/{pid}/net/tcp6") as f6, open(f"/proc/{pid}/net/tcp") as f4:
                self.assertRegex(f6.read() + f4.read(), listening)  # Inside the job: listening.
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # Outside it: nothing there.
                with open(table) as f:
                    self.assertNotRegex(f.read(), listening)
            with open(f"/proc/{pid}/net/dev") as f:
                self.assertEqual([l.split(":")[0].strip() for l in f.readlines()[2:]], ["lo"])
            with self.assertRaises(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            # TensorFlow's preemption notifier would swallow SIGTERM: the worker must stop.
            os.kill(pid, signal.SIGTERM)
            rest = process.communicate(timeout=60)[0]
        finally:
            process.kill()
        self.assertIn("launcher: worker 1 was killed by signal 15; stopped the other workers.",
                      rest)

    def test_only_the_chief_reports(self):
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=2", "--",
             sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--strategy=multi_worker",
             "--dataset=digits", "--epochs=1", "--batch_size=256"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        self.assertEqual(result.returncode, 0, result.stdout[-3000:])
        self.assertEqual(re.findall(r"\[worker (\d)\] test acc:", result.stdout), ["0"])
        self.assertEqual(re.findall(r"\[worker (\d)\] strategy +devices", result.stdout), ["0"])
        # Progress bars too: Keras's step counter appears on worker 0 only.
        self.assertNotRegex(result.stdout, r"\[worker 1\] .*\d+/\d+ ")
        self.assertNotIn("shuffle=True was passed", result.stdout)

    def test_a_worker_told_to_stop_keeps_a_resumable_state(self):
        model_dir = os.path.join(self.get_temp_dir(), "state")
        command = [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--num_workers=2",
                   "--", sys.executable, os.path.join(ROOT, "scripts", "train.py"),
                   "--strategy=multi_worker", "--dataset=digits", "--batch_size=256",
                   f"--model_dir={model_dir}", "--verbose=2"]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        process = subprocess.Popen(command + ["--epochs=1000"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=env)
        try:
            for line in process.stdout:
                if "Saved training state after epoch 2 " in line:
                    break
            workers = [int(p) for p in subprocess.run(
                ["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()]
            self.assertLen(workers, 2)
            os.kill(max(workers), signal.SIGTERM)  # One worker, as a scheduler would.
            rest = process.communicate(timeout=60)[0]
        finally:
            process.kill()
        self.assertEqual(process.returncode, 130, rest[-3000:])
        self.assertRegex(rest, r"\[worker 1\] Interrupted\. .*the state of the last finished "
                               r"epoch is there")
        self.assertIn("launcher: worker 1 exited with 130; stopped the other workers.", rest)
        resumed = subprocess.run(command + ["--epochs=3"], capture_output=True, text=True,
                                 env=env, timeout=300)
        self.assertEqual(resumed.returncode, 0, resumed.stdout[-3000:])
        self.assertRegex(resumed.stdout, r"\[worker 0\] Resuming from .*ckpt-[23]")

    def test_the_script_answers_bad_input_with_one_line(self):
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--", "/nonexistent"],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 2)
        self.assertNotIn("Traceback", result.stderr)
        self.assertIn("Error: Cannot run '/nonexistent'", result.stderr)


class OverlapTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters((2, "threads 1 2"), (1, "threads 1 1"))
    def test_a_worker_with_cores_to_spare_keeps_a_thread_for_its_collectives(
            self, compute_threads, expected):
        # A worker of one CPU device gets 1 inter-op thread from the device split; with it, a
        # profile showed every gradient all-reduce waiting for the end of the backward pass.
        # With one compute thread, the spare thread contended and is not added.
        code = ("from tfpar import devices, strategies\n"
                f"devices.ensure_logical_cpus(1, {compute_threads})\n"
                "import tensorflow as tf\n"
                "before = tf.config.threading.get_inter_op_parallelism_threads()\n"
                "strategies.get('multi_worker', 1)\n"
                "after = tf.config.threading.get_inter_op_parallelism_threads()\n"
                "print('threads', before, after)\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        self.assertIn(expected, result.stdout, result.stderr[-2000:])


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


class TwoWorkersTest(testing.StrategyTestCase, parameterized.TestCase):

    @parameterized.parameters(
        ("multi_worker", 24), ("multi_worker_allreduce", 23),
        # Micro-batches of 2+2 and 2+1 (the last batch) accumulated before one all-reduce.
        ("multi_worker_allreduce", 23, {"accumulation_steps": 2}))
    def test_two_workers_match_single_process_training(self, name, num_examples, options=None):
        reference = testing.tiny_model()
        initial = os.path.join(self.get_temp_dir(), "initial.npz")
        final = os.path.join(self.get_temp_dir(), "final.npz")
        np.savez(initial, *reference.get_weights())
        out = io.StringIO()
        status = launcher.launch([sys.executable, os.path.join(HERE, "multi_worker_worker.py"),
                                  name, initial, final, json.dumps(options or {})], 2,
                                 out=out)
        self.assertEqual(status, 0, out.getvalue()[-3000:])
        testing.fit_steps(reference, multi_worker_worker.dataset(num_examples), None)
        for expected, actual in zip(reference.get_weights(), np.load(final).values()):
            self.assertAllClose(expected, actual, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    tf.test.main()
