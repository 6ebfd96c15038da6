"""Tests of the programs' shared pieces: errors named by their flags, signals."""

import contextlib
import io
import subprocess
import sys

import tensorflow as tf
from absl import flags

from tfpar.cli import common
from tfpar.errors import ConfigError


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


if __name__ == "__main__":
    tf.test.main()
