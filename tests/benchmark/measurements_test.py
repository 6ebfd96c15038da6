"""Tests of benchmark configurations and sweeps."""

import os
from unittest import mock

import tensorflow as tf

from tfpar import benchmark
from tfpar import strategies
from tfpar.benchmark import Configuration
from tfpar.benchmark import measurements
from tfpar.host import machine
from tfpar.host import thread_layouts
from tfpar.strategies import registry


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


class ChosenForTheMachineTest(tf.test.TestCase):
    """The benchmark's --dtype=auto and --steps_per_execution=auto."""

    def setUp(self):
        super().setUp()
        for patcher in (
                mock.patch.dict(os.environ, {"TFPAR_TUNING_FILE": os.path.join(
                    self.get_temp_dir(), "tuning.json")}),
                mock.patch.object(machine, "cpu", return_value={
                    **machine.cpu(), "native_bfloat16": "yes (AMX-BF16)"})):
            patcher.start()
            self.addCleanup(patcher.stop)

    def test_each_configuration_gets_what_its_devices_would_train_with(self):
        # Tuned for 2 devices: 8 steps per call pay, bfloat16 measured slower there.
        thread_layouts.store(2, thread_layouts.default(2), steps_per_execution={"8": 1.2},
                             dtype={"mixed_bfloat16": 0.9})
        thread_layouts.store(thread_layouts.workers_key(2), thread_layouts.default(1),
                             steps_per_execution={"4": 1.1})
        sweep = benchmark.configurations(["mirrored", "multi_worker"], [1, 2], ["lenet"], 32,
                                         baseline=True, ceiling=True)
        chosen, said = measurements.chosen_for_the_machine(sweep, dtype=True,
                                                           steps_per_execution=True)
        got = {(c.strategy.name, c.num_devices): (c.dtype, c.steps_per_execution) for c in chosen}
        self.assertEqual(got, {
            ("keras", 1): ("mixed_bfloat16", 1),  # As the 1-device strategies: not tuned.
            ("mirrored", 1): ("mixed_bfloat16", 1),
            ("mirrored", 2): ("float32", 8),
            ("multi_worker", 1): ("mixed_bfloat16", 1),
            ("multi_worker", 2): ("mixed_bfloat16", 4),
            ("independent", 1): ("mixed_bfloat16", 1),
            ("independent", 2): ("float32", 8)})  # The same settings as mirrored on 2.
        self.assertEqual([c.strategy for c in chosen], [c.strategy for c in sweep])
        self.assertCountEqual(said, [
            "Chosen for 1 device(s): precision mixed_bfloat16 (this CPU runs bfloat16 "
            "natively (AMX-BF16)); 1 step(s) per compiled call (not tuned on this machine "
            "kind (tfpar-benchmark --tune times several steps per call)).",
            "Chosen for 2 device(s): precision float32 (mixed_bfloat16 ran 0.90x float32 "
            "when tuned on this machine kind); 8 step(s) per compiled call (8 steps per "
            "compiled call ran 1.20x faster when tuned on this machine kind).",
            "Chosen for 2 worker processes: precision mixed_bfloat16 (this CPU runs bfloat16 "
            "natively (AMX-BF16)); 4 step(s) per compiled call (4 steps per compiled call "
            "ran 1.10x faster when tuned on this machine kind)."])

    def test_only_what_is_asked_is_chosen(self):
        sweep = benchmark.configurations(["mirrored"], [2], ["lenet"], 32, dtype="float32",
                                         steps_per_execution=3)
        chosen, said = measurements.chosen_for_the_machine(sweep, dtype=True,
                                                           steps_per_execution=False)
        self.assertEqual((chosen[0].dtype, chosen[0].steps_per_execution),
                         ("mixed_bfloat16", 3))
        self.assertEqual(said, ["Chosen for 2 device(s): precision mixed_bfloat16 (this CPU "
                                "runs bfloat16 natively (AMX-BF16))."])


class ResolvedOnceTest(tf.test.TestCase):

    def test_nothing_looks_a_strategy_up_once_the_sweep_is_made(self):
        # The sweep resolves the names; what follows asks the values, as a run's config does.
        sweep = benchmark.configurations(
            ["mirrored", "allreduce", "multi_worker_allreduce"], [1, 2], ["lenet"], 32,
            baseline=True, ceiling=True, communication_share=True,
            strategy_options={"accumulation_steps": [1, 2]})
        with mock.patch.object(registry, "entry", side_effect=AssertionError("looked up")):
            chosen, _ = measurements.chosen_for_the_machine(sweep, True, True)
            runs = [(c.label, c.num_processes, c.step_batch_size, c.description)
                    for c in chosen]
            sent = [c.to_json() for c in sweep]
        # A worker resolves the name anew, in its own process, to the same value.
        self.assertEqual([Configuration.from_json(text) for text in sent], sweep)
        self.assertIn(("keras", 1, 32, "lenet keras on 1 device(s), default threads"), runs)
        self.assertIn(("independent", 2, 32, mock.ANY), runs)
        self.assertIn(("allreduce(accumulation_steps=2)", 1, 64, mock.ANY), runs)
        self.assertIn(("allreduce(accumulation_steps=2,no all-reduce)", 1, 64, mock.ANY), runs)
        self.assertIn(("multi_worker_allreduce(accumulation_steps=1)", 2, 32, mock.ANY), runs)
        # Keras's step has no all-reduce of tfpar's to leave out.
        self.assertNotIn("mirrored(no all-reduce)", [label for label, *_ in runs])

    def test_a_name_is_resolved_on_construction(self):
        self.assertEqual(Configuration("allreduce", 2, "lenet", 8, options=(
            ("accumulation_steps", 4),)).strategy,
            strategies.choose("allreduce", accumulation_steps=4))
        self.assertIs(Configuration("keras", 1, "lenet", 8).strategy, benchmark.BASELINE)
        self.assertIs(Configuration("independent", 2, "lenet", 8).strategy, benchmark.CEILING)
        # BASELINE and CEILING were their names; since 0.4.0 they equal only themselves.
        self.assertNotEqual(benchmark.BASELINE, "keras")
        self.assertEqual(benchmark.BASELINE.name, "keras")
        self.assertNotEqual(benchmark.BASELINE, benchmark.CEILING)


if __name__ == "__main__":
    tf.test.main()
