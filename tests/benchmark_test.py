"""Tests of the benchmark: it measures every configuration and tabulates ratios correctly."""

import csv
import os

import tensorflow as tf

from tfpar import benchmark
from tfpar import testing


class TableTest(tf.test.TestCase):

    def test_ratios(self):
        m = benchmark.Measurement
        measurements = [
            m("keras", ["CPU:0"], "lenet", 8, [100.0]),
            m("mirrored", ["CPU:0"], "lenet", 8, [80.0, 90.0, 100.0]),
            m("mirrored", ["CPU:0", "CPU:1"], "lenet", 8, [150.0], 2 * 10**7),
            m("allreduce", ["CPU:0", "CPU:1"], "lenet", 8, [165.0]),
        ]
        self.assertEqual(measurements[1].median, 90.0)
        self.assertEqual(measurements[1].best, 100.0)
        self.assertAlmostEqual(measurements[1].spread, 20 / 90)
        rows = benchmark.table(measurements, epoch_examples=900).splitlines()
        self.assertEqual(rows[0].split(), ["model", "strategy", "devices", "images/s", "median",
                                           "spread", "GFLOP/s", "sec/epoch", "speedup",
                                           "efficiency", "vs", "first", "vs", "keras"])
        # mirrored on 2 against its best round on 1 (100): speedup 1.50x, efficiency 0.75,
        # vs keras 150/100; 150 images/s * 2e7 FLOPs = 3 GFLOP/s.
        self.assertRegex(rows[4], r"mirrored +\[CPU:0, CPU:1\] +150\.0 +150\.0 +0% +3\.0 +6\.0 "
                                  r"+1\.50x +0\.75 +1\.000 +1\.500")
        # allreduce over mirrored on the same devices: 165/150 = 1.1.
        self.assertRegex(rows[5], r"allreduce .* 1\.100 +1\.650$")


class FilesTest(tf.test.TestCase):

    def test_csv_and_plot(self):
        measurements = [benchmark.Measurement(s, ["CPU:0", "CPU:1"][:n], "lenet", 8, [100.0 * n])
                        for s in ("mirrored", "allreduce") for n in (1, 2)]
        path = os.path.join(self.get_temp_dir(), "bench.csv")
        benchmark.write_csv(path, measurements)
        with open(path, encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        self.assertEqual([(r["strategy"], r["num_devices"], r["speedup"]) for r in rows],
                         [("mirrored", "1", "1.0"), ("mirrored", "2", "2.0"),
                          ("allreduce", "1", "1.0"), ("allreduce", "2", "2.0")])
        png = os.path.join(self.get_temp_dir(), "bench.png")
        benchmark.plot(png, measurements)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class RunTest(testing.StrategyTestCase):

    def test_measures_each_configuration_every_round(self):
        lines = []
        measurements = benchmark.run(["mirrored", "allreduce"], [1, 2], ["lenet"], batch_size=8,
                                     steps=2, warmup_rounds=1, rounds=2, baseline=True,
                                     progress=lines.append)
        self.assertEqual([(m.strategy, len(m.devices)) for m in measurements],
                         [("keras", 1), ("mirrored", 1), ("mirrored", 2), ("allreduce", 1),
                          ("allreduce", 2)])
        for m in measurements:
            self.assertLen(m.images_per_second, 2)
            self.assertGreater(m.median, 0)
        self.assertLen(lines, 5 * 3)
        self.assertStartsWith(lines[0], "warm-up: lenet keras [CPU:0]")


if __name__ == "__main__":
    tf.test.main()
