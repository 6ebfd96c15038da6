"""Tests of scripts/benchmark.py: flag errors before any process starts."""

import os
import subprocess
import sys

import tensorflow as tf


class ScriptTest(tf.test.TestCase):

    def test_bad_flags_fail_before_any_process_starts(self):
        script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "benchmark.py")
        for flags, message in (
                (["--batch_size=1", "--num_devices=1,2"],
                 "--batch_size must be at least the largest device count (2), so every replica "
                 "gets an example. Received: --batch_size=1."),
                (["--steps=1"], "--steps must be at least 2. Received: --steps=1."),
                (["--threads_per_device=0"],
                 "--threads_per_device must be at least 1. Received: --threads_per_device=0."),
                # Keras's multi-step loop fails across workers (keras-team/keras#19246).
                (["--strategies=multi_worker", "--steps=4", "--steps_per_execution=2"],
                 "--steps_per_execution > 1 does not run across workers")):
            result = subprocess.run([sys.executable, script, *flags], capture_output=True,
                                    text=True)
            self.assertEqual(result.returncode, 2, result.stderr[-2000:])
            self.assertIn(f"Error: {message}", result.stderr)


if __name__ == "__main__":
    tf.test.main()
