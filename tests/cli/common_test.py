"""Tests of the programs' shared pieces: errors named by their flags, signals."""

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap

import tensorflow as tf
from absl import flags

from tfpar import worker_contract
from tfpar.cli import common
from tfpar.errors import ConfigError
from tfpar.errors import ExitStatus


class ExitCleanlyTest(tf.test.TestCase):

    def test_a_library_error_names_the_flag_of_its_argument(self):
        flags.DEFINE_string("tfpar_test_dir", None, "A flag of this test.")
        flags.FLAGS.mark_as_parsed()

        def main(argv):
            raise ConfigError("{argument} 'x' does not exist.", argument="tfpar_test_dir")

        err = io.StringIO()
        with self.assertRaises(SystemExit) as exited, contextlib.redirect_stderr(err):
            common.exit_cleanly(main)([])
        self.assertEqual(exited.exception.code, 2)
        self.assertEqual(err.getvalue(), "Error: --tfpar_test_dir 'x' does not exist.\n")
        self.assertEqual(common.flag_name("algorithm", {"algorithm": "tfpar_test_dir"}),
                         "--tfpar_test_dir")
        self.assertEqual(common.flag_name("no_such_flag"), "no_such_flag")

    def test_signals_after_the_program_are_left_to_the_caller(self):
        # A test process (or a notebook) that ran a program's main keeps its own SIGTERM
        # handling: the watcher that ends a stuck program acts only while one runs.
        code = ("import os, signal, time\n"
                "from tfpar.cli import common\n"
                "common.exit_cleanly(lambda argv: None)([])\n"
                "signal.signal(signal.SIGTERM, lambda *a: print('handled', flush=True))\n"
                "os.kill(os.getpid(), signal.SIGTERM)\n"
                f"time.sleep({common.STOP_GRACE_SECONDS + 1})\n"
                "print('alive', flush=True)\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertEqual(result.stdout.split(), ["handled", "alive"])


    def test_a_ctrl_c_while_an_error_ends_the_program_prints_no_traceback(self):
        # As a launcher stops every worker when one fails: a worker that printed its error
        # line may get SIGINT while it exits.
        code = textwrap.dedent("""
            import atexit, os, signal, time
            from tfpar.cli import common
            from tfpar.errors import ConfigError

            def interrupted_clean_up():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)

            atexit.register(interrupted_clean_up)

            def main(argv):
                raise ConfigError("batch_size must be positive.")

            common.exit_cleanly(main)([])
            """)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertEqual(result.stderr.strip(), "Error: batch_size must be positive.")


class NoticeFromTheFirstInstantTest(tf.test.TestCase):
    """A notice that reaches a program before training is a notice: status 85 and a stop
    record saying so, not an interruption (130), which a scheduler does not requeue."""

    def run_notified(self, where: str) -> tuple[subprocess.CompletedProcess, dict]:
        record = os.path.join(self.get_temp_dir(), f"{where}.json")
        code = textwrap.dedent(f"""
            import os, signal, sys
            from tfpar.cli import common, train
            def notice(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGTERM)  # The handler runs at the next bytecode.
                return original(*args, **kwargs)
            if {where!r} == "parsing_flags":
                original = train.FLAGS.__class__.__call__
                train.FLAGS.__class__.__call__ = notice
            else:
                original = train.config_from_flags
                train.config_from_flags = notice
            sys.argv = ["tfpar-train", "--dataset=digits", "--epochs=1"]
            train.run()
        """)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120,
                                env={**os.environ, worker_contract.STOP_RECORD_ENV: record})
        with open(record, encoding="utf-8") as f:
            return result, json.load(f)

    def test_while_the_flags_become_a_config(self):
        result, record = self.run_notified("making_the_config")
        self.assertEqual(result.returncode, ExitStatus.PREEMPTED, result.stderr[-2000:])
        self.assertEqual(record["status"], ExitStatus.PREEMPTED)
        self.assertRegex(record["reason"], r"^Preempted \(SIGTERM\) outside training")
        self.assertNotIn("Traceback", result.stderr)

    def test_while_absl_parses_the_flags(self):
        result, record = self.run_notified("parsing_flags")
        self.assertEqual(result.returncode, ExitStatus.PREEMPTED, result.stderr[-2000:])
        self.assertEqual(record["status"], ExitStatus.PREEMPTED)
        self.assertNotIn("Traceback", result.stderr)


if __name__ == "__main__":
    tf.test.main()
