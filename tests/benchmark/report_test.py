"""Tests of the benchmark's table, paired ratios and files (CSV, JSON, PNG)."""

import csv
import dataclasses
import json
import os

import tensorflow as tf

from tfpar import benchmark
from tfpar.benchmark import Configuration
from tfpar.benchmark import Measurement
from tfpar.benchmark import report as benchmark_report


def _measurement(strategy, num_devices, images_per_second, flops=0, all_reduce_seconds=None):
    devices = [f"CPU:{i}" for i in range(num_devices)]
    return Measurement(Configuration(strategy, num_devices, "lenet", 8), devices, flops,
                       images_per_second, all_reduce_seconds or [0.0] * len(images_per_second))


class TableTest(tf.test.TestCase):

    def test_paired_ratios(self):
        measurements = [
            _measurement("keras", 1, [100.0, 50.0, 100.0]),
            _measurement("mirrored", 1, [80.0, 45.0, 100.0]),
            dataclasses.replace(_measurement("mirrored", 2, [150.0, 60.0, 160.0], 2 * 10**7,
                                             [0.01, 0.02, 0.01]), startup_seconds=12.34),
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
                                           "all-reduce", "in", "step", "start-up", "speedup",
                                           "efficiency",
                                           "vs", "first", "vs", "keras"])
        self.assertRegex(rows[2], r"^lenet +keras +\[CPU:0\] +- +100\.0 +50\.0 +100\.0 +0% ")
        # mirrored on 2: median 150 images/s * 2e7 FLOPs = 3 GFLOP/s, 900 / 150 = 6 s/epoch;
        # all-reduce share of a step (8 images): 0.01 s * 150 / 8, 0.02 * 60 / 8, 0.01 * 160 / 8
        # -> median 19%; speedup over 1 device 1.6x, efficiency 0.8; vs keras: 1.5, 1.2, 1.6
        # -> 1.5. Start-up to the first step: 12.3 s (not measured for the others: "-").
        self.assertRegex(rows[4], r"mirrored +\[CPU:0, CPU:1\] +1 +150\.0 +60\.0 +160\.0 +0% +3\.0 "
                                  r"+6\.0 +19% +- +12\.3 s +1\.60x +0\.80 +1\.000 +1\.500$")
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
        self.assertRegex(rows[2], r"^lenet +allreduce +\[CPU:0, CPU:1\] .* 0% +10% +- +1\.00x")
        self.assertRegex(rows[3], r"^lenet +allreduce\(no all-reduce\) .* 0% +- +- +1\.00x")

    def test_the_all_reduce_model_is_fitted_per_multi_worker_entry(self):
        # All-reduce times of 2, 6 and 14 ms at 2, 4 and 8 workers: the ring's 2 (N - 1)
        # messages of 1 ms each, nothing for the bytes; 62 ms at 32 workers.
        measurements = [
            Measurement(Configuration("multi_worker_allreduce", n, "lenet", 8),
                        [f"worker:{i}/CPU:0" for i in range(n)], 0, [100.0] * 3, [seconds] * 3,
                        gradient_bytes=516_272)
            for n, seconds in ((2, 2e-3), (4, 6e-3), (8, 14e-3))]
        measurements.append(_measurement("allreduce", 2, [100.0] * 3, 0, [1e-3] * 3))  # In-process.
        self.assertEqual(benchmark_report.scaling_lines(measurements, predict_at=(32,)), [
            "All-reduce model of lenet multi_worker_allreduce (ring, 0.52 MB of gradients, fitted "
            "to 2, 4, 8 workers): 1.00 ms a message, bandwidth not resolved (the times are "
            "latency); at 32 workers on this network: 62.0 ms."])
        self.assertEqual(benchmark_report.scaling_lines(measurements[:1]), [])  # One count only.

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


if __name__ == "__main__":
    tf.test.main()
