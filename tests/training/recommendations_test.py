"""Tests of what the machine recommends (precision, steps per call) and of "auto" in runs."""

import contextlib
import dataclasses
import io
import os
import tempfile
from unittest import mock

import keras
import tensorflow as tf

from tfpar import data
from tfpar import testing
from tfpar import training
from tfpar.errors import ConfigError
from tfpar.host import machine
from tfpar.host import onednn
from tfpar.host import thread_layouts
from tfpar.training import recommendations


class CpuSplitTest(tf.test.TestCase):
    """Where several logical devices of one CPU lose to one device, the advice says so."""

    def choice(self, on):
        return onednn.Choice(on, None, "tensorflow", "a reason")

    def test_said_with_eigens_kernels_only(self):
        with mock.patch.object(onednn, "current", return_value=self.choice(False)):
            note = recommendations.cpu_split_note(2, {"CPU"})
            self.assertStartsWith(note, "2 logical devices of one CPU train slower than one "
                                        "device here: TensorFlow runs its Eigen kernels")
            self.assertIsNone(recommendations.cpu_split_note(1, {"CPU"}))
            self.assertIsNone(recommendations.cpu_split_note(2, {"GPU"}))
            advice = recommendations.recommend(devices=2)
            self.assertEqual(advice.reasons[-1], f"devices: {note}")
        with mock.patch.object(onednn, "current", return_value=self.choice(True)):
            self.assertIsNone(recommendations.cpu_split_note(2, {"CPU"}))
            self.assertIsNone(recommendations.cpu_split_note(1, {"CPU"}))
            self.assertFalse(any(r.startswith("devices:")
                                 for r in recommendations.recommend(devices=2).reasons))

    def test_one_device_under_the_avx_cap_is_told_of_eigens_kernels(self):
        capped = onednn.choose({"sse4_2", "avx", "avx2", "fma"}, {})  # An AVX2 CPU.
        self.assertEqual((capped.on, capped.cap, capped.decided_by), (True, "AVX", "tfpar"))
        with mock.patch.object(onednn, "current", return_value=capped):
            self.assertEqual(recommendations.cpu_split_note(1, {"CPU"}),
                             "on one device TensorFlow's Eigen kernels (TF_ENABLE_ONEDNN_OPTS=0) "
                             "may train faster than oneDNN capped at AVX, which tfpar chooses on "
                             "this CPU (LeNet-sized convolutions do, larger ones not): time both")
            self.assertIsNone(recommendations.cpu_split_note(2, {"CPU"}))
            self.assertIsNone(recommendations.cpu_split_note(1, {"GPU"}))


class PrecisionTest(tf.test.TestCase):

    def test_a_cpu_with_native_bfloat16_gets_mixed_bfloat16(self):
        policy, why = recommendations.precision({"CPU"}, cpu_bfloat16="yes (AMX-BF16)")
        self.assertEqual(policy, "mixed_bfloat16")
        self.assertEqual(why, "this CPU runs bfloat16 natively (AMX-BF16)")

    def test_a_cpu_without_it_stays_float32_and_says_why(self):
        policy, why = recommendations.precision({"CPU"}, cpu_bfloat16="no")
        self.assertEqual(policy, "float32")
        self.assertStartsWith(why, "this CPU has no native bfloat16")
        self.assertIn("slower than float32", why)

    def test_gpus_from_compute_capability_8(self):
        self.assertEqual(recommendations.precision({"GPU"}, [(8, 0), (9, 0)])[0],
                         "mixed_bfloat16")
        self.assertEqual(recommendations.precision({"GPU"}, [(8, 6), (7, 5)])[0], "float32")
        self.assertEqual(recommendations.precision({"GPU"}, [])[0], "float32")
        self.assertEqual(recommendations.precision({"CPU", "GPU"})[0], "float32")

    def test_read_from_the_cpus_flags_at_run_time(self):
        native = machine.cpu()["native_bfloat16"]
        expected = "mixed_bfloat16" if native.startswith("yes") else "float32"
        self.assertEqual(recommendations.recommend(1).dtype_policy, expected)


class StepsPerCallTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.path = os.path.join(self.get_temp_dir(), "tuning.json")
        patcher = mock.patch.dict(os.environ, {"TFPAR_TUNING_FILE": self.path})
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_what_tuning_found_faster(self):
        self.assertEqual(recommendations.steps_per_call(2)[0], 1)
        self.assertIn("not tuned on this machine kind", recommendations.steps_per_call(2)[1])
        thread_layouts.store(2, thread_layouts.default(2), model="lenet", speedup=1.0,
                             steps_per_execution={"8": 1.11})
        self.assertEqual(recommendations.steps_per_call(2),
                         (8, "8 steps per compiled call ran 1.11x faster when tuned on this "
                             "machine kind"))
        thread_layouts.store(2, thread_layouts.default(2), steps_per_execution={"8": 1.01})
        self.assertEqual(recommendations.steps_per_call(2)[0], 1)
        self.assertEqual(recommendations.steps_per_call(4)[0], 1)  # Tuned for 2 only.

    def test_a_recommendation_as_compile_arguments_and_policy(self):
        thread_layouts.store(1, thread_layouts.default(1), steps_per_execution={"4": 1.3})
        advice = recommendations.recommend(1)
        self.assertEqual(advice.compile_arguments(), {"steps_per_execution": 4})
        self.assertLen(advice.reasons, 2)
        try:
            advice.apply_policy()
            self.assertEqual(keras.mixed_precision.global_policy().name, advice.dtype_policy)
        finally:
            keras.mixed_precision.set_global_policy("float32")


class AutoInRunsTest(testing.StrategyTestCase):

    def test_auto_is_chosen_said_once_and_trains(self):
        config = training.TrainConfig(dataset="synthetic", epochs=1, batch_size=32, verbose=0,
                                      dtype="auto", steps_per_execution="auto")
        splits = data.load("synthetic", image_shape=(28, 28, 1), synthetic_size=(64, 16))
        printed = io.StringIO()
        with tempfile.TemporaryDirectory() as folder, \
                mock.patch.dict(os.environ, {"TFPAR_TUNING_FILE": os.path.join(folder, "t")}), \
                contextlib.redirect_stdout(printed):
            result = training.train_on_devices(config, 2, splits)
        policy = recommendations.precision({"CPU"})[0]
        self.assertRegex(printed.getvalue(), rf"^Chosen for this machine: precision {policy} "
                                             r"\(.*\); 1 step\(s\) per compiled call \(not "
                                             r"tuned on this machine kind")
        self.assertLen(result.epoch_seconds, 1)
        self.assertEqual(keras.mixed_precision.global_policy().name, "float32")

    def test_the_config_takes_auto_or_a_count(self):
        config = training.TrainConfig(steps_per_execution="auto", dtype="auto")
        self.assertEqual(config.steps_per_execution, "auto")
        self.assertEqual(dataclasses.replace(config, steps_per_execution="8")
                         .steps_per_execution, 8)  # As the flag gives it.
        for bad in ("fast", 0, True):
            with self.assertRaisesRegex(ConfigError, r"steps_per_execution must be an integer "
                                                     r">= 1 or 'auto'"):
                dataclasses.replace(config, steps_per_execution=bad)


if __name__ == "__main__":
    tf.test.main()
