"""Tests of tfpar.env: the report a user pastes into a bug report."""

import json
import os
import subprocess
import sys

import tensorflow as tf

from tfpar import env
from tfpar import strategies

QUIET = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


class EnvTest(tf.test.TestCase):

    def test_json_report(self):
        result = subprocess.run([sys.executable, "-m", "tfpar.env", "--json"],
                                capture_output=True, text=True, timeout=120, env=QUIET)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        info = json.loads(result.stdout)
        self.assertEqual(info["versions"]["tensorflow"], tf.__version__)
        self.assertEqual(sorted(info["strategies"]), sorted(strategies.available()))
        self.assertEqual(info["strategies"]["allreduce"]["options"]["algorithm"],
                         "'collective'")
        self.assertEqual(info["cluster"]["source"], "none")
        self.assertEqual(info["machine"]["cpu_cores"], os.cpu_count())
        self.assertStartsWith(info["keras_fixes"]["applied"], "yes")
        self.assertCountEqual(info["keras_fixes"]["fixes"], ["symbolic_build",
                                                             "reduce_per_replica"])

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


if __name__ == "__main__":
    tf.test.main()
