"""Tests of scripts/benchmark.py: flag errors before any process starts; a tiny run's report."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tfpar.host import machine

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "benchmark.py")


class ScriptTest(tf.test.TestCase):

    def test_a_run_names_the_cpu_its_figures_come_from(self):
        # The same configuration runs at different speeds on CPUs with and without AVX-512
        # (measured by kernel kind): the report says which kind measured it.
        result = subprocess.run(
            [sys.executable, SCRIPT, "--models=lenet", "--strategies=default",
             "--num_devices=1", "--batch_size=8", "--steps=2", "--rounds=1",
             "--warmup_steps=0"], capture_output=True, text=True, timeout=300,
            env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertRegex(result.stdout, r"\nMachine: .+, \d+ cores, native bfloat16: "
                                        r"(no|unknown)\n")  # Capped at AVX2: never native.
        self.assertIn("(oneDNN capped at AVX2)", result.stdout)
        self.assertRegex(result.stdout, r"\nlenet +default +\[CPU:0\] ")

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_tune_times_the_layouts_and_stores_one_for_this_machine_kind(self):
        path = os.path.join(self.get_temp_dir(), "layouts.json")
        result = subprocess.run(
            [sys.executable, SCRIPT, "--tune", "--models=lenet", "--strategies=mirrored",
             "--num_devices=2", "--batch_size=8", "--steps=4", "--rounds=1",
             "--warmup_steps=0"], capture_output=True, text=True, timeout=300,
            env={**os.environ, "TFPAR_TUNING_FILE": path})
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertIn("Thread layouts for 2 devices (lenet, mirrored):", result.stdout)
        # Every candidate layout, the default with 2 steps per call (4 steps a round), in
        # mixed_bfloat16 where this CPU runs it natively, and one worker process per device
        # through the launcher's path.
        native = machine.cpu()["native_bfloat16"].startswith("yes")
        self.assertEqual(result.stdout.count(" img/s "), 7 if native else 6)
        self.assertEqual("the default in mixed_bfloat16" in result.stdout, native)
        self.assertIn("the default, 2 steps per compiled call", result.stdout)
        self.assertIn("one process per device (multi_worker)", result.stdout)
        self.assertRegex(result.stdout, r"each compiled call costs \d+% of a step's time here: "
                         r"compile\(steps_per_execution=2\)|2 steps per compiled call gain "
                         "nothing measurable here")
        self.assertEqual(result.stdout.count("<- stored"), 1)
        with open(path) as f:
            (record,) = json.load(f).values()
        self.assertEqual(list(record), ["2"])
        self.assertEqual(record["2"]["model"], "lenet")
        self.assertGreaterEqual(record["2"]["speedup"], 1.0)
        self.assertEqual(list(record["2"]["steps_per_execution"]), ["2"])
        self.assertEqual(list(record["2"]["one_process_per_device"]), ["multi_worker"])
        self.assertEqual(list(record["2"].get("dtype", {})), ["mixed_bfloat16"] if native else [])

    def test_bad_flags_fail_before_any_process_starts(self):
        for flags, message in (
                (["--batch_size=1", "--num_devices=1,2"],
                 "--batch_size must be at least the largest device count (2), so every replica "
                 "gets an example. Received: --batch_size=1."),
                (["--steps=1"], "--steps must be at least 2. Received: --steps=1."),
                (["--threads_per_device=0"],
                 "--threads_per_device must be at least 1. Received: --threads_per_device=0."),
                (["--tune", "--num_devices=1"],
                 "--tune times thread layouts of several devices (or worker processes) on "
                 "this machine: give a device count above 1. Received: num_devices=[1]."),
                (["--allreduce=tree"], "--allreduce must be one of collective, naive, ring")):
            result = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True,
                                    text=True)
            self.assertEqual(result.returncode, 2, result.stderr[-2000:])
            self.assertIn(f"Error: {message}", result.stderr)


if __name__ == "__main__":
    tf.test.main()
