"""The workers tfpar starts run with Keras 3 even where Ray switched tf.keras to Keras 2."""

import io
import sys
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

from tfpar.cluster import launcher
from tfpar.cluster import worker_environment


class WorkerEnvironmentTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(("1", True), ("True", True), ("true", True), ("yes", False),
                              ("TRUE", False), ("0", False), ("", False), (None, False))
    def test_what_switches_tf_keras_to_keras_2(self, value, asked):
        environment = {} if value is None else {"TF_USE_LEGACY_KERAS": value}
        self.assertEqual(worker_environment.legacy_keras_asked(environment), asked)

    def test_a_worker_keeps_the_environment_but_the_switch(self):
        self.assertEqual(worker_environment.worker_environment(
            {"TF_CONFIG": "new"}, {"TF_USE_LEGACY_KERAS": "1", "PATH": "/bin", "TF_CONFIG": "old"}),
            {"PATH": "/bin", "TF_CONFIG": "new"})

    def test_the_launchers_workers_do_not_get_rays_switch_and_it_says_so(self):
        out = io.StringIO()
        with mock.patch.dict("os.environ", {"TF_USE_LEGACY_KERAS": "1"}):
            status = launcher.launch([sys.executable, "-c", "import os; print('switch:', "
                                      "os.environ.get('TF_USE_LEGACY_KERAS'))"], 2, out=out)
        self.assertEqual(status, 0)
        self.assertEqual(out.getvalue().count("switch: None"), 2, out.getvalue())
        self.assertStartsWith(out.getvalue(), "launcher: TF_USE_LEGACY_KERAS (Ray's "
                                              "TensorflowTrainer sets it) is not passed to the "
                                              "workers: tf.keras is Keras 3 in them")


if __name__ == "__main__":
    tf.test.main()
