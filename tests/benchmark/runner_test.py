"""Tests of the benchmark's runner: processes per configuration, rounds, profiles, errors."""

import os
import subprocess

import pytest
import tensorflow as tf

from tfpar import benchmark
from tfpar.benchmark import Configuration
from tfpar.errors import ConfigError


def _benchmark_processes():
    """This test process's benchmark workers still running (another test process's, under
    pytest -n, are its own)."""
    out = subprocess.run(["ps", "-eo", "ppid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if "tfpar.benchmark.worker" in line and int(line.split()[0]) == os.getpid()]


class RunTest(tf.test.TestCase):

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_measures_each_configuration_every_round(self):
        lines = []
        sweep = benchmark.configurations(["mirrored", "multi_worker"], [2], ["lenet"], 8,
                                         baseline=True, ceiling=True, warmup_steps=1)
        measurements = benchmark.run(sweep, steps=3, rounds=2, progress=lines.append)
        self.assertEqual([(m.strategy, m.devices) for m in measurements],
                         [("keras", ["CPU:0"]), ("mirrored", ["CPU:0", "CPU:1"]),
                          ("multi_worker", ["worker:0/CPU:0", "worker:1/CPU:0"]),
                          ("independent", ["process:0/CPU:0", "process:1/CPU:0"])])
        for m in measurements:
            self.assertLen(m.images_per_second, 2)
            self.assertLen(m.all_reduce_seconds, 2)
            self.assertGreater(m.median, 0)
            self.assertEqual(m.training_flops_per_image, measurements[0].training_flops_per_image)
            # Start-up to the first step: TensorFlow's import alone takes seconds.
            self.assertBetween(m.startup_seconds, 1.0, 300.0)
        self.assertLen(lines, 4 + 4 * 2)
        self.assertEqual(lines[0], "starting lenet keras on 1 device(s), default threads")
        # The second round starts with the second configuration.
        self.assertStartsWith(lines[4 + 4], "round 2/2: lenet mirrored on 2 device(s)")
        self.assertEmpty(_benchmark_processes())

    @pytest.mark.cluster  # Several processes for a while: `pytest -m cluster`.
    def test_profile_steps_write_a_trace_per_process_and_the_chief_of_a_job(self):
        profile_dir = os.path.join(self.get_temp_dir(), "profile")
        sweep = [Configuration(benchmark.CEILING, 2, "lenet", 8, warmup_steps=1),
                 Configuration("multi_worker", 2, "lenet", 8, warmup_steps=1)]
        measurements = benchmark.run(sweep, steps=2, rounds=1, progress=None, profile_steps=2,
                                     profile_dir=profile_dir)
        self.assertLen(measurements[1].images_per_second, 1)

        def traces(name):
            return tf.io.gfile.glob(os.path.join(profile_dir, name, "plugins", "profile", "*",
                                                 "*.xplane.pb"))

        # Independent processes trace each; of a multi_worker job only the chief does
        # (TensorFlow 2.21's profiler aborts now and then in the other workers).
        for process in (0, 1):
            self.assertLen(traces(f"lenet_{benchmark.CEILING}_2_process{process}"), 1)
        self.assertLen(traces("lenet_multi_worker_2_process0"), 1)
        self.assertEmpty(traces("lenet_multi_worker_2_process1"))

    def test_a_configuration_that_cannot_run_is_a_clear_error(self):
        sweep = [Configuration("mirrored", 2, "lenet", 8, jit_compile=True)]
        with self.assertRaisesRegex(ConfigError, "^jit_compile=True cannot run on 2 replicas "
                                                 "with CPUs among them"):
            benchmark.run(sweep, steps=2, rounds=1, progress=None)
        self.assertEmpty(_benchmark_processes())


if __name__ == "__main__":
    tf.test.main()
