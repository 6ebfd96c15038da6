"""Tests of tfpar.env: the report a user pastes into a bug report."""

import json
import os
import subprocess
import sys
import unittest.mock

import tensorflow as tf

from tfpar import env
from tfpar import strategies
from tfpar.host import machine

QUIET = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


class EnvTest(tf.test.TestCase):

    def test_json_report(self):
        result = subprocess.run([sys.executable, "-m", "tfpar.cli.env", "--json"],
                                capture_output=True, text=True, timeout=120, env=QUIET)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        info = json.loads(result.stdout)
        self.assertEqual(info["versions"]["tensorflow"], tf.__version__)
        self.assertEqual(sorted(info["strategies"]), sorted(strategies.available()))
        self.assertEqual(info["strategies"]["allreduce"]["options"]["algorithm"],
                         "'collective'")
        self.assertEqual(info["cluster"]["source"], "none")
        self.assertEqual(info["machine"]["cpu_cores"], os.cpu_count())
        self.assertEqual(info["machine"]["cpu"], env.describe_cpu())
        self.assertStartsWith(info["keras_fixes"]["applied"], "yes")
        self.assertCountEqual(info["keras_fixes"]["fixes"], [
            "symbolic_build", "reduce_per_replica", "multi_step_train_function",
            "multi_step_test_function", "aggregating_assign_add", "aggregating_assign_sub",
            "backup_chief_writes", "backup_chief_deletes", "backup_state_beyond_weights",
            "backup_epoch_count",
            "scaled_loss_records", "scaled_loss_marks", "scaled_compute_loss_marks",
            "mean_of_scaled_losses", "run_time_refusals", "run_time_refusals_test",
            "run_time_refusals_predict", "mid_epoch_start"])
        self.assertIn(info["machine"]["mixed_bfloat16"].split(" ")[0], ("native", "emulated",
                                                                         "unknown"))
        self.assertStartsWith(info["iterator_release"]["applied"], "yes")

    def test_the_report_leaves_the_cpu_splittable(self):
        code = ("from tfpar import devices, env; env.collect(); "
                "devices.ensure_logical_cpus(3); import tensorflow as tf; "
                "print(len(tf.config.list_logical_devices('CPU')))")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120, env=QUIET)
        self.assertEqual(result.stdout.strip().splitlines()[-1], "3", result.stderr[-2000:])

    def test_a_malformed_tf_config_is_reported_not_raised(self):
        previous = os.environ.get("TF_CONFIG")
        os.environ["TF_CONFIG"] = "{bad"
        try:
            text = env.format_text(env.collect())
        finally:
            if previous is None:
                del os.environ["TF_CONFIG"]
            else:
                os.environ["TF_CONFIG"] = previous
        self.assertIn("error: TF_CONFIG is not valid JSON", text)


class VersionTest(tf.test.TestCase):

    def test_the_command_prints_no_tensorflow_start_up_lines_unless_asked(self):
        command = [sys.executable, "-m", "tfpar.cli.env"]
        environment = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        quiet = subprocess.run(command, capture_output=True, text=True, timeout=120,
                               env=environment)
        self.assertEqual(quiet.returncode, 0, quiet.stderr)
        self.assertEqual(quiet.stderr, "")
        self.assertIn("versions:", quiet.stdout)
        shown = subprocess.run(command + ["--show_tensorflow_log"], capture_output=True,
                               text=True, timeout=120, env=environment)
        self.assertNotEqual(shown.stderr, "")  # TensorFlow's own start-up lines.

    def test_major_minor_of_releases_and_prereleases(self):
        self.assertEqual(env.major_minor("2.21.0"), (2, 21))
        self.assertEqual(env.major_minor("3.15.1"), (3, 15))
        self.assertEqual(env.major_minor("2.21rc1"), (2, 21))
        self.assertEqual(env.major_minor("3.16.0.dev2025"), (3, 16))

class CpuTest(tf.test.TestCase):
    """The CPU line: the widest vector extension decides which oneDNN kernels run."""

    def setUp(self):
        super().setUp()
        # A cap the suite runs under (the user's, or tfpar's on an AVX2 CPU) is not these tests'.
        cap = os.environ.pop("ONEDNN_MAX_CPU_ISA", None)
        if cap is not None:
            self.addCleanup(os.environ.__setitem__, "ONEDNN_MAX_CPU_ISA", cap)

    def cpu(self, text, **environ):
        path = os.path.join(self.get_temp_dir(), "cpuinfo")
        with open(path, "w") as f:
            f.write(text)
        with unittest.mock.patch.dict(os.environ, environ):
            return env.cpu(path)

    def test_the_widest_extension_of_the_first_cpu(self):
        first = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx fma avx2\n"
        info = self.cpu(first + "\nprocessor\t: 1\nflags\t\t: avx512f\n")
        self.assertEqual(info, {"model": "AMD EPYC 7B13", "vector_extension": "AVX2",
                                "onednn_max_cpu_isa": "unset", "native_bfloat16": "no",
                                "native_low_precisions": "none", "family_model": "?/?"})
        self.assertEqual(self.cpu("flags : avx2 avx512f avx512bw\n")["vector_extension"],
                         "AVX-512")
        self.assertEqual(self.cpu("flags : sse2\n")["vector_extension"], "none")

    def test_native_bfloat16_read_from_the_flags_and_the_onednn_cap(self):
        # Two machines of one model (Intel family 6 model 207), with and without AMX.
        amx = "flags : avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16\n"
        self.assertEqual(self.cpu(amx)["native_bfloat16"], "yes (AMX-BF16)")
        self.assertEqual(self.cpu("flags : avx512f avx512_bf16 avx512_fp16\n")
                         ["native_bfloat16"], "yes (AVX512-BF16)")
        self.assertEqual(self.cpu(amx, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
                         ["native_bfloat16"], "yes (AVX512-BF16)")
        self.assertEqual(self.cpu(amx, ONEDNN_MAX_CPU_ISA="avx2")["native_bfloat16"], "no")
        self.assertEqual(self.cpu("flags : avx2 fma\n")["native_bfloat16"], "no")  # Zen 2.
        self.assertEqual(env.cpu(os.path.join(self.get_temp_dir(), "absent"))
                         ["native_bfloat16"], "unknown")
        self.assertEqual(self.cpu(amx)["native_low_precisions"], "bfloat16 (AMX-BF16), "
                         "bfloat16 (AVX512-BF16), float16 (AVX512-FP16)")
        self.assertEqual(self.cpu(amx, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
                         ["native_low_precisions"], "bfloat16 (AVX512-BF16)")
        self.assertEqual(self.cpu("flags : avx2 fma\n")["native_low_precisions"], "none")
        self.assertEqual(machine.native_low_precisions({"avx512_fp16", "amx_bf16"}),
                         ["bfloat16 (AMX-BF16)", "float16 (AVX512-FP16)"])

    def test_onednn_cap_and_a_machine_without_cpuinfo(self):
        self.assertEqual(self.cpu("flags : avx512f\n", ONEDNN_MAX_CPU_ISA="AVX2")
                         ["onednn_max_cpu_isa"], "AVX2")
        self.assertEqual(env.cpu(os.path.join(self.get_temp_dir(), "absent"))
                         ["vector_extension"], "unknown")


if __name__ == "__main__":
    tf.test.main()
