"""Tests of multi-worker training: cluster checks, the launcher, and 2 workers vs one process."""

import io
import json
import os
import re
import subprocess
import sys
import time
from unittest import mock

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfpar import cluster
from tfpar import launcher
from tfpar import testing
from tfpar.errors import ClusterError

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
            launcher.launch([sys.executable, "-c", "pass"], 2, host="10.255.255.1")

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

    def test_the_script_answers_bad_input_with_one_line(self):
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--", "/nonexistent"],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 2)
        self.assertNotIn("Traceback", result.stderr)
        self.assertIn("Error: Cannot run '/nonexistent'", result.stderr)


class TwoWorkersTest(testing.StrategyTestCase, parameterized.TestCase):

    @parameterized.parameters(("multi_worker", 24), ("multi_worker_allreduce", 23))
    def test_two_workers_match_single_process_training(self, name, num_examples):
        reference = testing.tiny_model()
        initial = os.path.join(self.get_temp_dir(), "initial.npz")
        final = os.path.join(self.get_temp_dir(), "final.npz")
        np.savez(initial, *reference.get_weights())
        out = io.StringIO()
        status = launcher.launch([sys.executable, os.path.join(HERE, "multi_worker_worker.py"),
                                  name, initial, final], 2, out=out)
        self.assertEqual(status, 0, out.getvalue()[-3000:])
        testing.fit_steps(reference, multi_worker_worker.dataset(num_examples), None)
        for expected, actual in zip(reference.get_weights(), np.load(final).values()):
            self.assertAllClose(expected, actual, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    tf.test.main()
