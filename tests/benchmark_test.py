"""Tests of the benchmark: every configuration in its own process, measured in paired rounds."""

import csv
import json
import os
import subprocess
import sys

import tensorflow as tf

from tfpar import benchmark
from tfpar.benchmark import Configuration
from tfpar.benchmark import Measurement
from tfpar.errors import ConfigError


def _measurement(strategy, num_devices, images_per_second, flops=0, all_reduce_seconds=None):
    devices = [f"CPU:{i}" for i in range(num_devices)]
    return Measurement(Configuration(strategy, num_devices, "lenet", 8), devices, flops,
                       images_per_second, all_reduce_seconds or [0.0] * len(images_per_second))


class TableTest(tf.test.TestCase):

    def test_paired_ratios(self):
        measurements = [
            _measurement("keras", 1, [100.0, 50.0, 100.0]),
            _measurement("mirrored", 1, [80.0, 45.0, 100.0]),
            _measurement("mirrored", 2, [150.0, 60.0, 160.0], 2 * 10**7, [0.01, 0.02, 0.01]),
            _measurement("allreduce", 2, [165.0, 66.0, 160.0]),
        ]
        self.assertEqual(measurements[1].median, 80.0)
        self.assertEqual(measurements[1].best, 100.0)
        self.assertAlmostEqual(measurements[1].spread, 55 / 80)
        # Per-round ratios 150/80, 60/45, 160/100: median 1.6 (a ratio of medians would say
        # 150/80 = 1.875, of bests 1.6 by chance).
        self.assertAlmostEqual(benchmark.paired_ratio(measurements[2], measurements[1]), 1.6)
        rows = benchmark.table(measurements, epoch_examples=900).splitlines()
        self.assertEqual(rows[0].split(), ["model", "strategy", "devices", "threads", "images/s",
                                           "worst", "best", "steal", "GFLOP/s", "sec/epoch",
                                           "all-reduce", "in", "step", "speedup", "efficiency",
                                           "vs", "first", "vs", "keras"])
        self.assertRegex(rows[2], r"^lenet +keras +\[CPU:0\] +- +100\.0 +50\.0 +100\.0 +0% ")
        # mirrored on 2: median 150 images/s * 2e7 FLOPs = 3 GFLOP/s, 900 / 150 = 6 s/epoch;
        # all-reduce share of a step (8 images): 0.01 s * 150 / 8, 0.02 * 60 / 8, 0.01 * 160 / 8
        # -> median 19%; speedup over 1 device 1.6x, efficiency 0.8; vs keras: 1.5, 1.2, 1.6
        # -> 1.5.
        self.assertRegex(rows[4], r"mirrored +\[CPU:0, CPU:1\] +1 +150\.0 +60\.0 +160\.0 +0% +3\.0 "
                                  r"+6\.0 +19% +- +1\.60x +0\.80 +1\.000 +1\.500$")
        # allreduce over mirrored on the same devices: 1.1, 1.1, 1.0 -> 1.1.
        self.assertRegex(rows[5], r"allreduce .* 1\.100 +1\.600$")


    def test_communication_in_step(self):
        # With its all-reduce the step runs at 80, 45, 90 images/s; without it, in the same
        # rounds, at 100, 50, 100: per-round ratios 0.8, 0.9, 0.9 -> the all-reduce takes 10%.
        with_it = Measurement(Configuration("allreduce", 2, "lenet", 8), ["CPU:0", "CPU:1"], 0,
                              [80.0, 45.0, 90.0], [0.0] * 3)
        alone = Measurement(Configuration("allreduce", 2, "lenet", 8, communication=False),
                            ["CPU:0", "CPU:1"], 0, [100.0, 50.0, 100.0], [0.0] * 3)
        rows = benchmark.table([with_it, alone]).splitlines()
        self.assertRegex(rows[2], r"^lenet +allreduce +\[CPU:0, CPU:1\] .* 0% +10% +1\.00x")
        self.assertRegex(rows[3], r"^lenet +allreduce\(no all-reduce\) .* 0% +- +1\.00x")

    def test_accumulation_multiplies_the_step_batch(self):
        configuration = Configuration("allreduce", 2, "lenet", 64,
                                      options=(("accumulation_steps", 4),))
        self.assertEqual(configuration.step_batch_size, 256)

    def test_the_sweep_adds_runs_without_communication_for_the_allreduce_step(self):
        sweep = benchmark.configurations(["mirrored", "allreduce"], [2], ["lenet"], 64,
                                         communication_share=True)
        self.assertEqual([(c.label, c.communication) for c in sweep],
                         [("mirrored", True), ("allreduce", True),
                          ("allreduce(no all-reduce)", False)])


class FilesTest(tf.test.TestCase):

    def test_csv_json_and_plot(self):
        measurements = [_measurement(s, n, [100.0 * n, 90.0 * n]) for s in ("mirrored", "allreduce")
                        for n in (1, 2)] + [_measurement("keras", 1, [120.0, 110.0])]
        path = os.path.join(self.get_temp_dir(), "bench.csv")
        benchmark.write_csv(path, measurements)
        with open(path, encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        self.assertEqual([(r["strategy"], r["num_devices"], r["speedup"]) for r in rows],
                         [("mirrored", "1", "1.0"), ("mirrored", "2", "2.0"),
                          ("allreduce", "1", "1.0"), ("allreduce", "2", "2.0"),
                          ("keras", "1", "1.0")])
        json_path = os.path.join(self.get_temp_dir(), "bench.json")
        benchmark.write_json(json_path, measurements)
        with open(json_path, encoding="utf-8") as f:
            first = json.load(f)[0]
        self.assertEqual(first["configuration"]["strategy"], "mirrored")
        self.assertEqual((first["images_per_second"], first["median"]), ([100.0, 90.0], 95.0))
        png = os.path.join(self.get_temp_dir(), "bench.png")
        benchmark.plot(png, measurements)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class ConfigurationsTest(tf.test.TestCase):

    def test_every_device_gets_the_same_share_by_default(self):
        sweep = benchmark.configurations(["mirrored", "allreduce"], [1, 4], ["lenet"], 32,
                                         baseline=True, dtype="bfloat16")
        threads = max(1, os.cpu_count() // 4)
        self.assertEqual(sweep, [
            Configuration("keras", 1, "lenet", 32, dtype="bfloat16"),
            Configuration("mirrored", 1, "lenet", 32, threads, dtype="bfloat16"),
            Configuration("mirrored", 4, "lenet", 32, threads, dtype="bfloat16"),
            Configuration("allreduce", 1, "lenet", 32, threads, dtype="bfloat16"),
            Configuration("allreduce", 4, "lenet", 32, threads, dtype="bfloat16")])
        self.assertEqual(Configuration.from_json(sweep[2].to_json()), sweep[2])

    def test_options_are_swept_for_the_entries_that_take_them(self):
        sweep = benchmark.configurations(
            ["mirrored", "allreduce"], [2], ["lenet"], 32, threads_per_device=1,
            strategy_options={"algorithm": ["collective", "ring", "naive"],
                              "bytes_per_pack": [0]})
        self.assertEqual([c.label for c in sweep], [
            "mirrored", "allreduce(algorithm=collective,bytes_per_pack=0)",
            "allreduce(algorithm=ring,bytes_per_pack=0)",
            "allreduce(algorithm=naive,bytes_per_pack=0)"])
        self.assertEqual(Configuration.from_json(sweep[2].to_json()), sweep[2])


def _benchmark_processes():
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "tfpar.benchmark_worker" in line]


class RunTest(tf.test.TestCase):

    def test_measures_each_configuration_every_round(self):
        lines = []
        sweep = benchmark.configurations(["mirrored", "allreduce", "multi_worker"], [1, 2],
                                         ["lenet"], 8, baseline=True, ceiling=True,
                                         warmup_steps=1)
        measurements = benchmark.run(sweep, steps=3, rounds=2, progress=lines.append)
        self.assertEqual([(m.strategy, m.devices) for m in measurements],
                         [("keras", ["CPU:0"]), ("mirrored", ["CPU:0"]),
                          ("mirrored", ["CPU:0", "CPU:1"]), ("allreduce", ["CPU:0"]),
                          ("allreduce", ["CPU:0", "CPU:1"]), ("multi_worker", ["CPU:0"]),
                          ("multi_worker", ["worker:0/CPU:0", "worker:1/CPU:0"]),
                          ("independent", ["process:0/CPU:0"]),
                          ("independent", ["process:0/CPU:0", "process:1/CPU:0"])])
        for m in measurements:
            self.assertLen(m.images_per_second, 2)
            self.assertLen(m.all_reduce_seconds, 2)
            self.assertGreater(m.median, 0)
            self.assertEqual(m.training_flops_per_image, measurements[0].training_flops_per_image)
        self.assertLen(lines, 9 + 9 * 2)
        self.assertEqual(lines[0], "starting lenet keras on 1 device(s), default threads")
        # The second round starts with the second configuration.
        self.assertStartsWith(lines[9 + 9], "round 2/2: lenet mirrored on 1 device(s)")
        self.assertEmpty(_benchmark_processes())

    def test_profile_steps_write_a_trace_per_process(self):
        profile_dir = os.path.join(self.get_temp_dir(), "profile")
        # Two independent processes, not a multi_worker job: TensorFlow 2.21's profiler
        # crashes now and then while collecting its data in a multi_worker process on a loaded
        # machine ("double free or corruption", "munmap_chunk(): invalid pointer"), before and
        # after tfpar's changes; the benchmark's per-process directories are the same code.
        sweep = [Configuration(benchmark.CEILING, 2, "lenet", 8, warmup_steps=1)]
        measurements = benchmark.run(sweep, steps=2, rounds=1, progress=None, profile_steps=2,
                                     profile_dir=profile_dir)
        self.assertLen(measurements[0].images_per_second, 1)
        for process in (0, 1):
            traces = tf.io.gfile.glob(os.path.join(
                profile_dir, f"lenet_{benchmark.CEILING}_2_process{process}", "plugins",
                "profile", "*", "*.xplane.pb"))
            self.assertLen(traces, 1)

    def test_a_configuration_that_cannot_run_is_a_clear_error(self):
        sweep = [Configuration("mirrored", 2, "lenet", 8, jit_compile=True)]
        with self.assertRaisesRegex(ConfigError, "--jit_compile cannot run on 2 CPU replicas"):
            benchmark.run(sweep, steps=2, rounds=1, progress=None)
        self.assertEmpty(_benchmark_processes())


class ScriptTest(tf.test.TestCase):

    def test_bad_flags_fail_before_any_process_starts(self):
        script = os.path.join(os.path.dirname(__file__), "..", "scripts", "benchmark.py")
        for flags, message in (
                (["--batch_size=1", "--num_devices=1,2"],
                 "--batch_size must be at least the largest device count (2), so every replica "
                 "gets an example. Received: --batch_size=1."),
                (["--steps=1"], "--steps must be at least 2. Received: --steps=1."),
                (["--threads_per_device=0"],
                 "--threads_per_device must be at least 1. Received: --threads_per_device=0.")):
            result = subprocess.run([sys.executable, script, *flags], capture_output=True,
                                    text=True)
            self.assertEqual(result.returncode, 2, result.stderr[-2000:])
            self.assertIn(f"Error: {message}", result.stderr)


if __name__ == "__main__":
    tf.test.main()
