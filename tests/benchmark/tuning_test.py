"""Tests of tuning: what is timed for in-process and multi-process strategies, what is stored
and what is said (the runner replaced by given rates; tests/cli/benchmark_test.py runs it)."""

import json
import os
import tempfile
from unittest import mock

import tensorflow as tf

from tfpar.benchmark import runner
from tfpar.benchmark import tuning
from tfpar.benchmark.measurements import Configuration
from tfpar.benchmark.measurements import Measurement
from tfpar.host import machine
from tfpar.host import thread_layouts
from tfpar.training import recommendations


class TuneTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.path = os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), "layouts.json")
        self.enter_context(mock.patch.dict(os.environ, {thread_layouts.TUNING_FILE_ENV: self.path}))
        self.swept: list[Configuration] = []
        # A CPU without native bfloat16 unless a test says otherwise: no precision probe.
        self.cpu = self.enter_context(mock.patch.object(
            machine, "cpu", return_value={**machine.cpu(), "native_bfloat16": "no"}))

    def tune(self, strategy: str, rates: list[float], steps: int = 20) -> tuning.Tuned:
        """Tunes ``strategy`` on 2 devices, the i-th configuration timed at ``rates[i]``."""
        def run(sweep, steps, rounds):
            self.swept = list(sweep)
            self.assertEqual(len(sweep), len(rates))
            return [Measurement(c, [], images_per_second=[rate, rate * 1.001])
                    for c, rate in zip(sweep, rates)]

        with mock.patch.object(runner, "run", run):
            return tuning.tune(Configuration(strategy, 2, "lenet", 64), steps, 2)

    def stored(self) -> dict:
        with open(self.path) as f:
            (record,) = json.load(f).values()
        return record

    def test_one_process_times_layouts_steps_per_call_and_one_process_per_device(self):
        layouts = thread_layouts.candidates(2)
        tuned = self.tune("allreduce", [100.0] * len(layouts) + [110.0, 120.0])
        self.assertEqual([c.thread_layout for c in self.swept[:len(layouts)]], layouts)
        per_call, processes = self.swept[len(layouts):]
        self.assertEqual((per_call.steps_per_execution, per_call.strategy.name), (8, "allreduce"))
        self.assertEqual((processes.strategy.name, processes.steps_per_execution),
                         ("multi_worker_allreduce", 1))
        self.assertEqual(tuned.chosen, 0)  # No layout beat the default.
        text = "\n".join(tuned.lines())
        self.assertIn("Thread layouts for 2 devices (lenet, allreduce):", text)
        self.assertIn("each compiled call costs 9% of a step's time here: "
                      "compile(steps_per_execution=8)", text)
        self.assertIn("one process per device pays here: tfpar-launch --num_workers=2 "
                      "-- <your command with strategy multi_worker_allreduce>", text)
        record = self.stored()["2"]
        self.assertEqual((record["steps_per_execution"], record["one_process_per_device"]),
                         ({"8": 1.1}, {"multi_worker_allreduce": 1.2}))
        self.assertEqual(thread_layouts.chosen(2)[1], (
            "tuned with lenet, 1.00x the default; 8 steps per compiled call 1.10x; "
            "one process per device (multi_worker_allreduce) 1.20x"))

    def test_a_layout_that_does_not_pay_says_nothing_beyond_its_figure(self):
        layouts = thread_layouts.candidates(2)
        tuned = self.tune("mirrored", [100.0] * len(layouts) + [101.0, 90.0], steps=4)
        self.assertEqual(self.swept[len(layouts)].steps_per_execution, 2)  # Half the steps.
        self.assertEqual(self.swept[-1].strategy.name, "multi_worker")  # Keras's own step.
        text = "\n".join(tuned.lines())
        self.assertIn("2 steps per compiled call gain nothing measurable here", text)
        self.assertNotIn("pays here", text)

    def test_a_cpu_with_native_bfloat16_times_it_and_auto_follows(self):
        self.cpu.return_value = {**machine.cpu(), "native_bfloat16": "yes (AMX-BF16)"}
        layouts = thread_layouts.candidates(2)
        tuned = self.tune("mirrored", [100.0] * len(layouts) + [101.0, 150.0, 90.0])
        precision = self.swept[len(layouts) + 1]
        self.assertEqual((precision.dtype, precision.steps_per_execution, precision.strategy.name),
                         ("mixed_bfloat16", 1, "mirrored"))
        self.assertIn("mixed_bfloat16 pays here: --dtype=auto chooses it",
                      "\n".join(tuned.lines()))
        self.assertEqual(self.stored()["2"]["dtype"], {"mixed_bfloat16": 1.5})
        record = recommendations.tuned_record(2)
        self.assertEqual(recommendations.precision({"CPU"}, cpu_bfloat16="yes (AMX-BF16)",
                                                   tuned=record),
                         ("mixed_bfloat16", "this CPU runs bfloat16 natively (AMX-BF16), 1.50x "
                                            "float32 when tuned here"))
        # Where tuning found it slower, auto keeps float32 although the CPU has it.
        self.tune("mirrored", [100.0] * len(layouts) + [101.0, 95.0, 90.0])
        self.assertEqual(recommendations.precision({"CPU"}, cpu_bfloat16="yes (AMX-BF16)",
                                                   tuned=recommendations.tuned_record(2)),
                         ("float32", "mixed_bfloat16 ran 0.95x float32 when tuned on this "
                                     "machine kind"))

    def test_worker_processes_time_their_threads_and_steps_per_call_for_the_host(self):
        layouts = thread_layouts.worker_candidates(2)
        rates = [100.0] + [108.0] + [105.0] * (len(layouts) - 2) + [110.0]
        tuned = self.tune("multi_worker_allreduce", rates)
        self.assertEqual([c.thread_layout for c in self.swept[:len(layouts)]], layouts)
        per_call = self.swept[len(layouts)]  # No one-process-per-device probe: they are.
        self.assertEqual((per_call.strategy.name, per_call.steps_per_execution, len(self.swept)),
                         ("multi_worker_allreduce", 8, len(layouts) + 1))
        self.assertEqual(self.stored()["2 workers"]["steps_per_execution"], {"8": 1.1})
        self.assertEqual(tuned.chosen, 1)
        self.assertIn("Thread layouts for 2 workers on one host (lenet, multi_worker_allreduce):",
                      tuned.lines()[0])
        self.assertIn("<- stored", tuned.lines()[2])
        self.assertEqual(list(self.stored()), ["2 workers"])
        self.assertEqual(thread_layouts.chosen_for_workers(2)[0], layouts[1])


if __name__ == "__main__":
    tf.test.main()
