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

    def test_a_run_names_the_cpu_and_what_auto_chose_on_it(self):
        # The same configuration runs at different speeds on CPUs with and without AVX-512
        # (measured by kernel kind): the report says which kind measured it.
        output = os.path.join(self.get_temp_dir(), "auto.json")
        result = subprocess.run(
            [sys.executable, SCRIPT, "--models=lenet", "--strategies=default",
             "--num_devices=1", "--batch_size=8", "--steps=16", "--rounds=1",
             "--warmup_steps=0", "--dtype=auto", "--steps_per_execution=auto",
             f"--output={output}"], capture_output=True, text=True, timeout=300,
            env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2",
                 "TFPAR_TUNING_FILE": os.path.join(self.get_temp_dir(), "none.json")})
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertRegex(result.stdout, r"\nMachine: .+, \d+ cores, native bfloat16: "
                                        r"(no|unknown)\n")  # Capped at AVX2: never native.
        self.assertIn("(oneDNN capped at AVX2)", result.stdout)
        self.assertRegex(result.stdout, r"\nlenet +default +\[CPU:0\] ")
        # Without native bfloat16, auto stays float32 and says why, before anything runs.
        self.assertStartsWith(result.stdout, "Chosen for 1 device(s): precision float32 (this "
                              "CPU has no native bfloat16")
        self.assertIn("1 step(s) per compiled call (not tuned on this machine kind",
                      result.stdout.splitlines()[0])
        with open(output, encoding="utf-8") as f:
            (row,) = json.load(f)
        self.assertEqual(row["configuration"]["dtype"], "float32")

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
                (["--allreduce=tree"], "--allreduce must be one of collective, naive, ring"),
                (["--steps_per_execution=auto", "--steps=10"],
                 "--steps must be at least 16. Received: --steps=10."),
                (["--steps_per_execution=two"], "--steps_per_execution must be an integer >= 1 "
                 "or 'auto'. Received: --steps_per_execution='two'."),
                (["--steps_per_execution=0"], "--steps_per_execution must be an integer >= 1 "
                 "or 'auto'. Received: --steps_per_execution=0."),
                (["--tune", "--num_devices=2", "--dtype=auto"],
                 "--dtype=auto chooses from what tune stores; tune times the precisions and "
                 "steps per call itself. Give tune a fixed value (float32 and 1 time the "
                 "others)."),
                (["--dtype=fp8"], "flag --dtype=fp8: value should be one of <float32|bfloat16|"
                 "mixed_float16|mixed_bfloat16|auto>.")):
            result = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True,
                                    text=True)
            self.assertEqual(result.returncode, 2, result.stderr[-2000:])
            self.assertIn(f"Error: {message}", result.stderr)


if __name__ == "__main__":
    tf.test.main()
