"""tfpar's oneDNN choice: TensorFlow's rule per CPU kind, tfpar's where it differs, the user's
settings untouched, and the choice set before TensorFlow starts (or one line where too late)."""

import os
import signal
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
from absl.testing import absltest
from absl.testing import parameterized

from tfpar.host import onednn

# The flags of the kinds these machines come in (from /proc/cpuinfo, abridged).
ZEN3 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
AMX = ZEN3 | {"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
ALDER_LAKE = ZEN3 | {"avx_vnni"}  # AVX-VNNI without AVX-512: TensorFlow turns oneDNN on.
SANDY_BRIDGE = {"sse4_2", "avx"}
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw"}  # AVX-512 without VNNI: TensorFlow leaves it off.
ARM = {"fp", "asimd", "sve"}


class ChooseTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("zen4", ZEN4, True, "tensorflow"), ("amx", AMX, True, "tensorflow"),
        ("avx_vnni", ALDER_LAKE, True, "tensorflow"),
        ("zen3_avx2", ZEN3, True, "tfpar"), ("skylake_sp", SKYLAKE_SP, False, "tensorflow"),
        ("avx_only", SANDY_BRIDGE, False, "tensorflow"), ("arm", ARM, False, "tensorflow"),
        ("unreadable", None, False, "tensorflow"))
    def test_per_cpu_kind(self, flags, on, decided_by):
        choice = onednn.choose(flags, {})
        self.assertEqual((choice.on, choice.decided_by), (on, decided_by))
        # tfpar writes only where it decides otherwise than TensorFlow's rule.
        self.assertEqual(bool(choice.environment), decided_by == "tfpar"
                         and on != bool(onednn.tensorflow_default(flags)))

    def test_on_avx2_onednn_runs_capped_at_avx_and_never_under_the_users_own_cap(self):
        choice = onednn.choose(ZEN3, {})
        self.assertEqual((choice.on, choice.cap, choice.decided_by), (True, "AVX", "tfpar"))
        self.assertEqual({k: v for k, v in choice.environment.items()
                          if k != onednn.SET_BY_TFPAR_ENV},
                         {onednn.ENABLE_ENV: "1", onednn.CAP_ENV: "AVX"})
        self.assertEqual(choice.describe().split(" (")[0], "on, capped at AVX")
        # Where TensorFlow turns oneDNN on, its rule stays, uncapped.
        self.assertIsNone(onednn.choose(ZEN4, {}).cap)
        # A cap of the user's own (AVX2 here, whose kernels crash) is never turned on by tfpar.
        mine = onednn.choose(ZEN3, {onednn.CAP_ENV: "AVX2"})
        self.assertEqual((mine.on, mine.cap, dict(mine.environment)), (False, "AVX2", {}))
        self.assertIn("ONEDNN_MAX_CPU_ISA=AVX2 is set", mine.reason)
        # Inherited by a process tfpar starts: still tfpar's choice.
        inherited = onednn.choose(ZEN3, dict(choice.environment))
        self.assertEqual(inherited, choice)

    def test_a_policy_tfpar_does_not_know_keeps_tensorflows_rule(self):
        choice = onednn.choose(ZEN3, {onednn.POLICY_ENV: "avx512"})
        self.assertEqual((choice.on, choice.decided_by, dict(choice.environment)),
                         (False, "tensorflow", {}))
        self.assertEqual(choice.reason, "TFPAR_ONEDNN='avx512' is not auto or tensorflow, so "
                                        "TensorFlow's rule applies")
        self.assertEqual(onednn.choose(ZEN3, {onednn.POLICY_ENV: " Auto "}).decided_by, "tfpar")
        # Said on every kind, even where the outcome is TensorFlow's rule anyway.
        self.assertIn("'avx512' is not auto or tensorflow",
                      onednn.choose(ZEN4, {onednn.POLICY_ENV: "avx512"}).describe())

    @parameterized.named_parameters(
        # An AVX-512 CPU capped by hand below AVX-512: TensorFlow still hands oneDNN bfloat16.
        ("zen4_capped_at_avx", ZEN4, {onednn.ENABLE_ENV: "1", onednn.CAP_ENV: "AVX"}, True),
        ("zen4_capped_at_avx2", ZEN4, {onednn.ENABLE_ENV: "1", onednn.CAP_ENV: "avx2"}, True),
        ("zen4_uncapped", ZEN4, {}, False),
        ("zen4_capped_at_avx512", ZEN4, {onednn.CAP_ENV: "AVX512_CORE"}, False),
        ("zen4_off", ZEN4, {onednn.ENABLE_ENV: "0", onednn.CAP_ENV: "AVX"}, False),
        # tfpar's own cap on an AVX2 CPU: TensorFlow keeps bfloat16 on Eigen there.
        ("zen3_tfpars_cap", ZEN3, {}, False))
    def test_where_bfloat16_has_no_kernel(self, flags, environ, expected):
        choice = onednn.choose(flags, environ)
        self.assertEqual(onednn.bfloat16_without_kernels(choice, flags), expected)

    def test_tensorflows_rule_is_its_default_policy(self):
        for flag in onednn.TENSORFLOW_ONEDNN_FLAGS:
            self.assertTrue(onednn.tensorflow_default(ZEN3 | {flag}), flag)
        self.assertFalse(onednn.tensorflow_default(ZEN3))
        self.assertIsNone(onednn.tensorflow_default(ARM))

    @parameterized.named_parameters(("on", "1", True), ("true", "TRUE", True), ("off", "0", False),
                                    ("false", "false", False))
    def test_the_users_setting_wins_on_every_kind(self, value, on):
        for flags in (ZEN3, ZEN4, AMX):
            choice = onednn.choose(flags, {onednn.ENABLE_ENV: value})
            self.assertEqual((choice.on, choice.decided_by, dict(choice.environment)),
                             (on, "you", {}))

    def test_a_value_tensorflow_does_not_read_keeps_its_default(self):
        choice = onednn.choose(ZEN4, {onednn.ENABLE_ENV: "yes"})
        self.assertEqual((choice.on, choice.decided_by), (True, "tensorflow"))
        self.assertIn("'yes' is not 0, 1, false or true", choice.reason)

    def test_a_value_is_read_as_tensorflow_reads_it_unstripped(self):
        # TensorFlow's ReadBoolFromEnvVar lowercases but does not strip: " 0" is no value it
        # reads, so it keeps its default (on here, where it turns oneDNN on by itself).
        choice = onednn.choose(ZEN4, {onednn.ENABLE_ENV: " 0"})
        self.assertEqual((choice.on, choice.decided_by), (True, "tensorflow"))
        self.assertIn("' 0' is not 0, 1, false or true", choice.reason)
        self.assertEqual(onednn.choose(ZEN4, {onednn.ENABLE_ENV: "FALSE"}).on, False)

    def test_tfpars_avx2_setting_inherited_on_another_cpu_kind_is_removed(self):
        # A process started by tfpar on an AVX2 CPU, running on an AVX-512 one: the inherited
        # cap was tfpar's choice for the other kind, not the user's; it is taken away before
        # TensorFlow starts, so what TensorFlow runs is this kind's choice.
        inherited = dict(onednn.choose(ZEN3, {}).environment)
        choice = onednn.choose(ZEN4, inherited)
        self.assertEqual((choice.on, choice.cap, choice.decided_by), (True, None, "tensorflow"))
        self.assertEqual(set(choice.unset), set(inherited))
        # The same kind inherits the same choice and removes nothing.
        self.assertEqual(onednn.choose(ZEN3, inherited).unset, ())

    def test_tfpars_own_setting_inherited_by_a_worker_is_not_the_users(self):
        chosen = onednn.choose(ZEN3, {})
        self.assertEqual((chosen.on, chosen.decided_by), (True, "tfpar"))
        inherited = onednn.choose(ZEN3, dict(chosen.environment))
        self.assertEqual(inherited, chosen)
        # A user who changed the value after tfpar wrote it is the user.
        changed = {**chosen.environment, onednn.ENABLE_ENV: "1" if not chosen.on else "0"}
        self.assertEqual(onednn.choose(ZEN3, changed).decided_by, "you")

    def test_leaving_tensorflows_rule_alone(self):
        choice = onednn.choose(ZEN3, {onednn.POLICY_ENV: "tensorflow"})
        self.assertEqual((choice.on, choice.decided_by, dict(choice.environment)),
                         (False, "tensorflow", {}))

    def test_describe_says_state_and_who(self):
        self.assertRegex(onednn.choose(ZEN4, {}).describe(),
                         r"^on \(tensorflow: the CPU has AVX512_VNNI")
        self.assertRegex(onednn.choose(ZEN3, {onednn.ENABLE_ENV: "0"}).describe(),
                         r"^off \(you: TF_ENABLE_ONEDNN_OPTS=0\)$")


class ApplyTest(absltest.TestCase):

    def test_set_before_tensorflow_starts(self):
        environ: dict[str, str] = {}
        with mock.patch.object(onednn, "cpu_flags", return_value=ZEN3), \
                mock.patch.object(onednn, "tensorflow_started", return_value=False):
            choice = onednn.apply(environ)
            self.assertIsNone(onednn.too_late())
        self.assertEqual(environ, dict(onednn.choose(ZEN3, {}).environment))
        self.assertEqual(choice.decided_by, "tfpar")

    def test_too_late_is_one_line_only_where_tensorflow_runs_otherwise(self):
        environ: dict[str, str] = {}
        wanted = onednn.choose(ZEN3, {})
        with mock.patch.object(onednn, "cpu_flags", return_value=ZEN3), \
                mock.patch.object(onednn, "tensorflow_started", return_value=True):
            actual = onednn.apply(environ)
            line = onednn.too_late()
        self.assertEqual(environ, {})  # Nothing written: TensorFlow already read it.
        self.assertEqual(actual.decided_by, "tensorflow")
        self.assertEqual((wanted.on, actual.on), (True, False))
        self.assertRegex(line, r"^TensorFlow was imported before tfpar, .*: oneDNN is off where "
                               r"tfpar would have it on, capped at AVX\. Import tfpar before "
                               r"TensorFlow \(and Keras\), or start Python with "
                               r"TF_ENABLE_ONEDNN_OPTS=1 ONEDNN_MAX_CPU_ISA=AVX\.$")
        # Where tfpar chose as TensorFlow did, there is nothing to say.
        with mock.patch.object(onednn, "cpu_flags", return_value=ZEN4), \
                mock.patch.object(onednn, "tensorflow_started", return_value=True):
            onednn.apply({})
            self.assertIsNone(onednn.too_late())

    def test_an_inherited_cap_is_removed_before_tensorflow_starts(self):
        environ = dict(onednn.choose(ZEN3, {}).environment)
        with mock.patch.object(onednn, "cpu_flags", return_value=ZEN4), \
                mock.patch.object(onednn, "tensorflow_started", return_value=False):
            actual = onednn.apply(environ)
        self.assertEqual(environ, {})
        self.assertEqual((actual.on, actual.cap), (True, None))

    def test_an_inherited_cap_in_force_is_reported_with_its_origin(self):
        # TensorFlow started before tfpar, under a cap tfpar set for an AVX2 CPU in the process
        # that started this one: the cap is in force, said so, and bfloat16 is refused (one
        # line) rather than dying inside oneDNN.
        environ = dict(onednn.choose(ZEN3, {}).environment)
        marker = environ[onednn.SET_BY_TFPAR_ENV]
        with mock.patch.object(onednn, "cpu_flags", return_value=ZEN4), \
                mock.patch.object(onednn, "tensorflow_started", return_value=True):
            actual = onednn.apply(environ)
        self.assertEqual(environ[onednn.CAP_ENV], "AVX")  # TensorFlow read it: left.
        self.assertEqual((actual.on, actual.cap, actual.decided_by), (True, "AVX", "tfpar"))
        self.assertEqual(actual.reason,
                         f"inherited from the process that started this one "
                         f"({onednn.SET_BY_TFPAR_ENV}={marker!r}: tfpar's choice for another CPU "
                         "kind), in force since TensorFlow started before tfpar was imported")
        self.assertTrue(onednn.bfloat16_without_kernels(actual, ZEN4))
        with mock.patch.dict(onednn._APPLIED, wanted=onednn.choose(ZEN4, environ),
                             actual=actual):
            self.assertRegex(onednn.too_late(), r": oneDNN is on, capped at AVX where tfpar "
                                                r"would have it on\. Import tfpar before "
                                                r"TensorFlow \(and Keras\), or start Python "
                                                r"without ONEDNN_MAX_CPU_ISA "
                                                r"TF_ENABLE_ONEDNN_OPTS\.$")

    def test_tensorflow_imported_first_is_said_as_such_not_as_a_setting(self):
        with mock.patch.object(onednn, "cpu_flags", return_value=ZEN3), \
                mock.patch.object(onednn, "tensorflow_started", return_value=True):
            actual = onednn.apply({})
        self.assertEqual(actual.describe(), "off (tensorflow: TensorFlow was imported before "
                                            "tfpar, so its own rule applies: off on this CPU)")

    def test_what_is_reported_is_read_back_from_tensorflow(self):
        choice = onednn.Choice(True, None, "tfpar", "a reason")
        with mock.patch.dict(onednn._APPLIED, actual=choice), \
                mock.patch.object(onednn, "tensorflow_started", return_value=True), \
                mock.patch.object(onednn.onednn_state, "tensorflow_runs_onednn",
                                  return_value=False):
            self.assertEqual(onednn.current().describe(),
                             "off (tensorflow: read back from TensorFlow, which runs it off "
                             "where tfpar expected on: a reason)")
        # In a process: a value TensorFlow does not read is reported as what it runs.
        code = textwrap.dedent("""
            import tfpar
            import tensorflow as tf
            from tfpar.compat import onednn_state
            from tfpar.host import onednn
            print(onednn.current().on, onednn_state.tensorflow_runs_onednn())
        """)
        env = {k: v for k, v in os.environ.items()
               if k not in (onednn.SET_BY_TFPAR_ENV, onednn.POLICY_ENV, onednn.CAP_ENV)}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={**env, onednn.ENABLE_ENV: " 0"}, timeout=300)
        on = bool(onednn.tensorflow_default(onednn.cpu_flags()))
        self.assertEqual(result.stdout.split(), [str(on), str(on)], result.stderr[-2000:])

    def test_import_tfpar_sets_it_in_a_fresh_process_and_leaves_the_users(self):
        code = textwrap.dedent("""
            import os, sys
            import tfpar
            from tfpar.host import onednn
            assert "tensorflow" not in sys.modules
            print(os.environ.get("TF_ENABLE_ONEDNN_OPTS"), onednn.current().decided_by)
        """)
        env = {k: v for k, v in os.environ.items()
               if k not in (onednn.ENABLE_ENV, onednn.SET_BY_TFPAR_ENV, onednn.POLICY_ENV)}
        mine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**env, onednn.ENABLE_ENV: "0"}, check=True)
        self.assertEqual(mine.stdout.split(), ["0", "you"])
        chosen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=env, check=True)
        expected = onednn.choose(onednn.cpu_flags(), env)
        self.assertEqual(chosen.stdout.split(),
                         [expected.environment.get(onednn.ENABLE_ENV, "None"),
                          expected.decided_by])


SMALL_RESNET_FIT = textwrap.dedent("""
    import os
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(int(os.environ["THREADS"]))
    import keras
    keras.mixed_precision.set_global_policy(os.environ.get("DTYPE", "float32"))
    from tfpar.models import resnet
    rng = np.random.default_rng(0)
    x, y = rng.random((80, 12, 12, 1), dtype=np.float32), rng.integers(0, 3, 80)
    model = resnet.resnet((4, 8), (1, 1), num_classes=3, input_shape=(12, 12, 1))
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    print("trained")
""")


@pytest.mark.cluster  # Fresh processes of TensorFlow: CI's cluster stage, not the README's.
class Avx2KernelsTest(absltest.TestCase):
    """Why tfpar caps oneDNN at AVX on AVX2 CPUs: its AVX2 kernels (as every CPU these tests run
    on can be made to use, with ``ONEDNN_MAX_CPU_ISA=AVX2``) still crash on a small ResNet on one
    thread, where its AVX kernels train it; and where bfloat16 has kernels under the cap. When a
    TensorFlow release changes these, this fails: measure, and reconsider ``AVX2_CHOICE``."""

    def fit(self, **environment):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_ENABLE_ONEDNN",
                                                                        "ONEDNN_", "TFPAR_ONEDNN"))}
        return subprocess.run([sys.executable, "-c", SMALL_RESNET_FIT], capture_output=True,
                              text=True, timeout=300,
                              env={**env, "TF_CPP_MIN_LOG_LEVEL": "3", **environment})

    def test_onednns_avx2_kernels_crash_on_one_thread_where_its_avx_kernels_train(self):
        # A logical CPU device of a 2-core machine split in two has one intra-op thread.
        self.assertIn("trained", self.fit(TF_ENABLE_ONEDNN_OPTS="0", THREADS="1").stdout)
        for _ in range(2):  # What tfpar chooses on an AVX2 CPU.
            capped = self.fit(THREADS="1", **onednn.AVX2_CHOICE)
            self.assertIn("trained", capped.stdout, capped.stderr[-2000:])
        crashes = [self.fit(TF_ENABLE_ONEDNN_OPTS="1", ONEDNN_MAX_CPU_ISA="AVX2",
                            THREADS="1").returncode for _ in range(2)]
        # Killed by the heap's check (SIGABRT) or a segmentation fault, not a Python error.
        self.assertTrue(any(code in (-signal.SIGABRT, -signal.SIGSEGV) for code in crashes),
                        f"oneDNN's AVX2 kernels trained the small ResNet (exit {crashes}): "
                        "measure them and reconsider tfpar.host.onednn.AVX2_CHOICE")

    def test_bfloat16_under_the_avx_cap_trains_exactly_where_tfpar_says_it_has_kernels(self):
        # On an AVX2 CPU TensorFlow keeps bfloat16 on Eigen's kernels and it trains; on an
        # AVX-512 CPU capped at AVX it hands them to oneDNN, which has none.
        self.assertIn("trained", self.fit(TF_ENABLE_ONEDNN_OPTS="0", THREADS="1",
                                          DTYPE="mixed_bfloat16").stdout)
        capped = self.fit(THREADS="1", DTYPE="mixed_bfloat16", **onednn.AVX2_CHOICE)
        flags = onednn.cpu_flags()
        missing = onednn.bfloat16_without_kernels(onednn.choose(flags, onednn.AVX2_CHOICE), flags)
        self.assertEqual("trained" not in capped.stdout, missing, capped.stderr[-2000:])


if __name__ == "__main__":
    absltest.main()
